"""The state and its formats: what the optimizer's state *is* and how it is saved.

* ``codecs/``          one small file per format (float, int8, int4, correction) + rounding
* ``store.py``         the ``optimizer.state`` mapping, tiers, tile-sized moves
* ``master_weights.py`` bf16 parameters plus an integer correction (fp32 masters as state)
* ``checkpoint.py``    the versioned checkpoint format, plain-torch import/export
* ``dtensor.py``       FSDP2 / DTensor helpers (local shards, global offsets)
* ``units.py``         byte sizes given as strings

A new format or a checkpoint change lives here.
May import: nothing else of optstate_core.
"""
