"""The step paths: what one update *does* to a parameter and its state.

* ``context.py``       what the paths are given: the StepContext (optimizer, state, policy,
                       options, step count, metrics) and the typed seams onto the schedule room
                       (Residency, Conformance, Transfers); never the engine
* ``work.py``          a parameter's unit of work, its tiles, the step's metrics
* ``gradients.py``     gradient validation before a step (transactional), NaN/inf flags
* ``inner.py``         the wrapped torch optimizer's own update on chosen tensors
* ``tiled.py``         the reference path: decode tiles, inner optimizer on views, encode back
* ``fused.py``, ``bucket.py``, ``fused_launch.py``
                       the fused path: which parameters the Triton kernels take, their launch
                       buckets, the launches
* ``fused_optimizers/`` one file per fused optimizer (state keys, eligibility, kernel, launch
                       arguments) and the registry that finds the one for an inner optimizer
* ``kernels/``         the Triton kernels, each beside its torch twin
* ``cpu_step.py``, ``cpu_compile.py``
                       the CPU fast path (one decode-update-encode call per slice) and how
                       and when it is compiled
* ``backward_check.py``, ``passthrough_skip.py``
                       NaN/inf checks of CUDA gradients in backward, and for torch-fused state

A faster kernel or a new update path lives here.
May import: state, policy.
"""
