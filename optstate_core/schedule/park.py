"""The phase switch: the whole optimizer state parked in host memory and woken again, e.g. around
an RL rollout or an evaluation (``offload()`` / ``reload()`` / ``with opt.parked():``, see docs/rl.md).

Parking re-stores every state in the codec it has, on the host tier (:class:`~optstate_core.schedule.conform.Conformer`:
a payload copy, nothing is re-encoded), so waking gives back the same bytes and training continues
bit for bit as if nothing had moved: compressed and uncompressed state, master-weight corrections,
tiny tensors alike; the staging ring that offloaded state streams through is freed too. State of its own shape (Adafactor's factors, :func:`~optstate_core.state.store.keeps_own_shape`)
moves to host memory as it is and back to the device it came from. Step counters and other scalars
stay where they are.

The host buffers are kept while the state is awake and reused by the next park, so the pinned
memory held does not grow with the cycles; ``prepare_park()`` pins them ahead, on a thread, so the
first park is as fast as the later ones (:mod:`.park_buffers`). Copies to and from the GPU are
queued together and waited for once; a park drops the device state only after its copies are done.

The first update after a park wakes the state (``step()``, or with gradient release the first
gradient released in backward): an update needs the state on the device anyway, and training
after ``offload()`` has always continued exactly, so a forgotten ``reload()`` costs one wake, not a
failed run.
"""
from __future__ import annotations

import logging

import torch

from ..state.dtensor import is_dtensor
from ..state.store import keeps_own_shape

log = logging.getLogger("optstate")


def check_empty_cache(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"empty_cache must be True or False, got {value!r}")
    return value


def park(engine, empty_cache: bool = False) -> None:
    """Every state to host memory (idempotent); ``empty_cache``: hand the freed device memory
    back to the driver (``torch.cuda.empty_cache()``) when the parameters are on CUDA."""
    engine.sync_transfers()
    engine.placement.force_tier = "host"
    engine.conform()  # the Conformer, then park_own_shape below (load_state_dict while parked too)
    engine.schedule.drop_device_buffers()  # the staging ring of streamed state, staged copies
    if empty_cache and any(p.is_cuda for p, _ in engine.param_infos()):
        torch.cuda.empty_cache()


def wake(engine) -> None:
    """State back to the device as far as the policy and the GPU budget allow (idempotent)."""
    engine.sync_transfers()
    engine.placement.force_tier = None
    engine.placement.resident = None
    engine.assign_residency()
    engine.conformer.conform()
    _wake_own_shape(engine)


def wake_for_update(engine, where: str) -> None:
    """Before an update: wake parked state (see the module docstring), said once in the log."""
    if not engine.parked:
        return
    if not engine.told_auto_wake:
        engine.told_auto_wake = True
        log.info("optstate: %s woke the parked optimizer state; call reload() (or leave opt.parked()) before "
                 "training to choose when it moves", where)
    with torch.no_grad():
        wake(engine)


def _own_shape_states(engine):
    """``(parameter index, its state, key, value)`` of every state of its own shape (not DTensors)."""
    for p, info in engine.param_infos():
        st = engine.state.get(p, {})
        for key, value in list(st.items()):
            if keeps_own_shape(value, p) and not is_dtensor(value):
                yield info.index, st, key, value


def park_own_shape(engine) -> None:
    """State of its own shape to host memory, as it is; where it was is noted (by parameter index,
    which copies and pickles keep) for the wake."""
    for index, st, key, value in list(_own_shape_states(engine)):
        if value.device.type != "cpu":
            engine.own_shape_devices[(index, key)] = value.device
            st[key] = value.to("cpu")


def _wake_own_shape(engine) -> None:
    for index, st, key, value in list(_own_shape_states(engine)):
        device = engine.own_shape_devices.get((index, key))
        if device is not None:
            st[key] = value.to(device)
    engine.own_shape_devices.clear()


class Parked:
    """``with opt.parked():`` (see :meth:`PhaseSwitch.parked`)."""

    def __init__(self, engine, empty_cache: bool):
        self.engine = engine
        self.empty_cache = empty_cache
        self.was_parked = False

    def __enter__(self):
        self.was_parked = self.engine.parked
        park(self.engine, self.empty_cache)
        return self

    def __exit__(self, *exc) -> bool:
        if not self.was_parked:
            wake(self.engine)
        return False


class PhaseSwitch:
    """The phase-switch methods of :class:`~optstate_core.optimizer.VirtualOptimizer`."""

    def offload(self, empty_cache: bool = False) -> None:
        """Park: move every optimizer state to host memory (e.g. during an RL rollout or an
        evaluation), in the codec it has. Idempotent; checkpointing works parked. ``empty_cache``:
        also hand the freed GPU memory back to the driver (``torch.cuda.empty_cache()``), for
        another engine (vLLM, SGLang) to take. The next update wakes the state if :meth:`reload`
        was not called (docs/rl.md)."""
        check_empty_cache(empty_cache)
        park(self._engine, empty_cache)

    def prepare_park(self, wait: bool = False) -> None:
        """Pin the host buffers that parking needs ahead, on a background thread, so that the first
        :meth:`offload` only copies (later parks reuse the first one's buffers anyway). Called
        before the first step, it starts at the end of that step, when the state exists. They
        hold as much host memory as the state holds on the GPU, page-locked, from now on.
        ``wait``: return once they are pinned. A park before they are waits for them."""
        if not isinstance(wait, bool):
            raise ValueError(f"wait must be True or False, got {wait!r}")
        self._engine.park_buffers.prepare(self._engine, wait)

    def reload(self) -> None:
        """Wake: bring state back to the GPU as far as the policy and ``gpu_budget`` allow.
        Idempotent."""
        wake(self._engine)

    @property
    def is_parked(self) -> bool:
        """Whether the state is parked (after :meth:`offload`, inside :meth:`parked`)."""
        return self._engine.parked

    def parked(self, empty_cache: bool = True) -> Parked:
        """A context manager: the state parked in host memory inside the block, woken when it ends,
        also when it raises (left parked if it was parked already when the block began)::

            with opt.parked():   # the GPU memory of the optimizer state is free here
                rollout()
        """
        check_empty_cache(empty_cache)
        return Parked(self._engine, empty_cache)
