"""Which parameters gradient release hooks, and whether release can run on them: FSDP2 shards (their
process group found), one process, or refused (plain data parallelism); frameworks that shard the
model after wrap() get the hooks moved to the parameters they swapped in."""
from __future__ import annotations

import torch

from ..state.dtensor import is_dtensor


DEFERRED = "deferred"  # check_release_supported at wrap(): plain parameters under several processes, for now


def check_release_supported(engine, params, defer_data_parallel: bool = False):
    """Refuse what gradient release cannot do correctly (clear errors, nothing changed); return
    the process group whose ranks hold the shards under FSDP2 (their norms are summed), else None.
    ``defer_data_parallel`` (at wrap(): Accelerate's and the Trainer's FSDP2 shard the model after
    the optimizer exists): plain parameters under several processes return :data:`DEFERRED`, and
    :func:`follow_parameters` checks again at the first backward or step."""
    if engine.prefetch_during_backward:
        raise ValueError("release_gradients=True cannot be combined with backward-time prefetch "
                         "(prefetch_during_backward=True or a prefetch_budget other than 'auto'/0): a released "
                         "parameter is updated in backward already")
    sharded = [p for p in params if is_dtensor(p)]
    if sharded:
        mesh = sharded[0].device_mesh
        if len(sharded) != len(params) or mesh.ndim != 1 or any(p.device_mesh != mesh for p in sharded):
            raise ValueError("release_gradients=True with DTensor parameters needs every parameter sharded by FSDP2 "
                             "over one 1-D device mesh")
        return mesh.get_group()
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        if defer_data_parallel:
            return DEFERRED
        raise ValueError("release_gradients=True under data parallelism (e.g. DDP) would update parameters before "
                         "their gradients are all-reduced (the hook runs on the local gradient); use FSDP2 "
                         "(fully_shard), whose hooks run after the reduce-scatter, or one process")
    return None


def follow_parameters(engine, params=None, defer_data_parallel: bool = False) -> bool:
    """Gradient release on the parameters ``param_groups`` hold now. A framework may replace them
    after wrap() (Accelerate's FSDP2 prepare, also under the HF Trainer, swaps in DTensor
    parameters): the backward hooks move to the current parameters and their shards' process group
    is found; a check deferred at wrap() is made now (plain parameters under data parallelism
    raise, unless ``defer_data_parallel``: wrap() and add_param_group). Cheap when nothing changed;
    returns whether anything did. ``params``: the groups' parameters, when the caller has them listed."""
    release = engine.clip_release
    if params is None:
        params = [p for g in engine.inner.param_groups for p in g["params"]]
    ids = tuple(map(id, params))
    if ids == release.param_ids and not release.deferred_check:
        return False
    group = check_release_supported(engine, params, defer_data_parallel)
    if ids != release.param_ids:
        if release.param_ids is not None:  # hooks on other parameters: moved to these
            engine.sync_transfers()
            engine.schedule.remove_hooks()
            engine.invalidate_plan()
            release._infos = {}
        engine.schedule.register_hooks(params)
        release.param_ids = ids
    release.deferred_check = group is DEFERRED
    release.group = None if group is DEFERRED else group
    return True
