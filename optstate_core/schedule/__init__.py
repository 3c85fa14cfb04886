"""The step's orchestration: *when* and *where* a training step's bytes move and its updates run.

* ``engine.py``        one wrapped optimizer's state mapping and the orchestration of one step
* ``timetable.py``     the step schedule's three phases: in backward, in ``step()``, behind the
                       next forward
* ``release.py``       gradient release and clipping (updates in backward)
* ``prefetch.py``, ``stage_plan.py``, ``transfer.py``
                       the prefetch area, staging layouts, copy streams and the staging ring
* ``placement.py``     codec and tier per state (the policy's answer, FSDP2 limits, the budget)
* ``pin_ahead.py``     the first step's pinned host memory, predicted at wrap() and pinned on a thread
* ``park.py``          the phase switch: all state parked in host memory and woken
                       (``offload()``/``reload()``/``parked()``)
* ``park_buffers.py``  its host buffers, kept across parks and pinned ahead (``prepare_park()``)
* ``conform.py``, ``follow.py``
                       re-storing state in the wanted form, and state that follows parameters
                       moved or recast after wrapping

A new overlap, tier or hook lives here.
May import: state, step, policy, metrics.
"""
