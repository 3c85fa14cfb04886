"""Checkpoint format (versioned), loading with validation, and plain-torch import/export.

A VirtualOptimizer ``state_dict()`` looks like torch's, plus one key::

    {"state": {param_id: {key: value}}, "param_groups": [...],   # torch's layout, int ids
     "optstate": {"format_version": 1, "step": int, "policy": {...}, ...}}

where ``value`` is a tensor or number as the inner optimizer made it, or for encoded state::

    {"encoded": {"codec": {...codec config...}, "shape": [..], "dtype": "float32",
                 "host_tier": bool, "payload": {"codes": uint8 tensor, "scales": fp32 tensor}}}

Only tensors and primitives: loads under ``torch.load(weights_only=True)``. Shapes depend on
the parameter shapes and codecs only. A dict without the ``optstate`` key is a plain torch
optimizer state_dict and is imported (then stored as the policy says).
"""
from __future__ import annotations

from typing import Dict

import torch

from .codecs import EncodedTensor, codec_from_config, slab_shape
from .dtensor import is_dtensor, like_param, local, local_rows_of, payload_to_dtensor, slab_placements
from .master_weights import MASTER_KEY
from .store import ParamState, allocate_many, as_stored, copy_stored, is_scalar_state


FORMAT_VERSION = 1
META_KEY = "optstate"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"state_dict: unknown dtype {name!r}")
    return dtype


def pack_value(value, param=None):
    """One state value for a checkpoint. For a DTensor parameter the payload goes out as
    DTensors on its mesh with global shapes (so DCP saves every rank's shard, and a load on
    another mesh reads the same global payload). A 1-D parameter's shards split its slab row:
    per-element codecs (fp32, bf16, fp24, corrections) go out that way on any mesh, block codecs
    only where the shards hold whole blocks (elsewhere the state is kept fp32). A layout that
    keeps no whole slab rows or columns per rank (``Shard(d > 0)``, ``Partial``) keeps its state
    uncompressed; held in host memory it is still an encoded (lossless) value, and goes out
    decoded, laid out like the parameter, as a resident uncompressed state does (its payload as
    one DTensor would claim every rank's shard is the whole tensor)."""
    if isinstance(value, EncodedTensor):
        if param is not None and is_dtensor(param) and slab_placements(param, value.codec.granularity) is None:
            return like_param(param, value.decode(local(param).device).reshape(local(param).shape))
        shape, payload = list(value.shape), dict(value.payload)
        if param is not None and is_dtensor(param):
            shape = list(param.shape)
            payload = payload_to_dtensor(param, value, slab_shape(param.shape))
        return {"encoded": {"codec": value.codec.config(), "shape": shape, "dtype": _dtype_name(value.dtype),
                            "host_tier": value.host_tier, "payload": payload}}
    return value


def unpack_value(value, what: str, param=None):
    """Inverse of :func:`pack_value`; for a DTensor parameter, keep this rank's shard."""
    if isinstance(value, dict) and "encoded" in value:
        spec = value["encoded"]
        try:
            codec = codec_from_config(spec["codec"])
            shape, payload = tuple(spec["shape"]), dict(spec["payload"])
            if param is not None and is_dtensor(param) and tuple(param.shape) == shape:
                layout = codec.payload_layout(*slab_shape(shape), _parse_dtype(spec["dtype"]))
                payload = {k: (t.to_local() if is_dtensor(t) else local_rows_of(param, t, layout[k][2]))
                           for k, t in payload.items()}
                shape = tuple(local(param).shape)
            return EncodedTensor(codec, payload, shape, _parse_dtype(spec["dtype"]), bool(spec.get("host_tier", False)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"state_dict: malformed encoded entry for {what}: {e}") from None
    return value


def build_state_dict(engine, param_groups) -> dict:
    """The engine's state in our format, against the live ``param_groups`` (hooks run by the caller)."""
    engine.sync_transfers()  # offloaded state must be written back before it is read
    groups, state = [], {}
    index = 0
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(index, index + len(g["params"])))
        for p in g["params"]:
            st = engine.state.get(p)
            if st:
                state[index] = {k: pack_value(v, p) for k, v in st.items()}
            index += 1
        groups.append(packed)
    for key, value in engine.state.items():  # state kept under keys of its own (MADGRAD's "k"), as torch keeps it
        if not isinstance(key, torch.Tensor):
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    meta = {"format_version": FORMAT_VERSION, "step": engine.step_count, "policy": engine.policy.state_dict(),
            "seed": engine.seed, "nonfinite_skipped": engine.nonfinite_skipped(),
            "clip": engine.clip_release.clip_state()}
    if groups:  # also in the first group: torch.distributed.checkpoint keeps only state and groups
        groups[0][META_KEY] = meta
    return {"state": state, "param_groups": groups, "optstate": meta}


def saved_groups_meta(state_dict):
    groups = state_dict.get("param_groups") or []
    return groups[0].get(META_KEY) if groups and isinstance(groups[0], dict) else None


def _cast_like_torch(param: torch.Tensor, key, value, group: dict, keep_dtype: bool = False):
    """torch.optim.Optimizer.load_state_dict's casting of one raw state value; ``keep_dtype``:
    moved to the parameter's device only (state kept in the master's fp32 on purpose)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("capturable", False) or group.get("fused", False):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point() and not keep_dtype:
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def _fused_fp32_state(value: EncodedTensor, param) -> bool:
    """The fused path keeps uncompressed state of bf16/fp16 parameters in fp32 on purpose."""
    return value.codec.lossless and value.dtype == torch.float32 and param.dtype in (torch.bfloat16, torch.float16)


def _check_payload(param, key, value: EncodedTensor, what: str) -> None:
    """Every payload tensor has the dtype and shape its codec lays out, real (not meta, not
    sparse) storage on the host or on the parameter's kind of device, and finite scales."""
    if not (value.dtype.is_floating_point or value.dtype.is_complex):
        raise ValueError(f"state_dict: {what} state {key!r} has dtype {value.dtype}; encoded state must be "
                         "a floating-point or complex dtype")
    rows, cols = value.slab
    layout = value.codec.payload_layout(rows, cols, value.dtype)
    extra = set(value.payload) - set(layout)
    if extra:
        raise ValueError(f"state_dict: {what} state {key!r}: payload has unexpected entries {sorted(extra)} "
                         f"for codec {value.codec.name!r}")
    devices = {"cpu", local(param).device.type}
    for name, (shape, dtype, _) in layout.items():
        t = value.payload.get(name)
        where = f"state_dict: {what} state {key!r}: payload {name!r}"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where} is missing (codec {value.codec.name!r} expects a {dtype} tensor of "
                             f"shape {tuple(shape)})")
        t = local(t)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"{where} is a {t.dtype} tensor of shape {tuple(t.shape)}; codec "
                             f"{value.codec.name!r} expects {dtype} of shape {tuple(shape)}")
        if t.layout != torch.strided or t.device.type not in devices:
            raise ValueError(f"{where} is a {t.layout} tensor on {t.device}; expected a dense tensor on "
                             f"{' or '.join(sorted(devices))}")
        if name == "scales" and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where} holds NaN/inf scales")


def _check_entry(param, key, value, what: str, elementwise: bool) -> None:
    if isinstance(value, EncodedTensor):
        if tuple(value.shape) != tuple(local(param).shape):
            raise ValueError(f"state_dict: {what} state {key!r} has shape {tuple(value.shape)}, "
                             f"the parameter has shape {tuple(local(param).shape)}")
        _check_payload(param, key, value, what)
    elif isinstance(value, torch.Tensor) and not is_scalar_state(value) and elementwise:
        if value.numel() != param.numel():
            raise ValueError(f"state_dict: {what} state {key!r} has shape {tuple(value.shape)}, "
                             f"the parameter has shape {tuple(param.shape)}")


def check_is_state_dict(state_dict) -> None:
    """Raise unless ``state_dict`` looks like an optimizer state_dict."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be an optimizer state_dict with 'state' and 'param_groups'")


def _check_same_keys(keys_by_group: Dict[tuple, list]) -> None:
    """Within one parameter group the optimizer keeps the same state keys for every parameter of
    the same rank that has state: an entry missing one of them would fail later, inside ``step()``."""
    for (gi, _), entries in keys_by_group.items():
        expected = set().union(*(keys for _, keys in entries if keys))
        for what, keys in entries:
            missing = expected - keys if keys else set()
            if missing:
                raise ValueError(f"state_dict: {what} (group {gi}) is missing state {sorted(missing)} that the "
                                 "other parameters of its group have")


def _checked_meta(state_dict: dict, groups):
    """The saved optstate metadata (or None) and clip state, after checking the format version,
    the clip state and the group and parameter counts against ``groups``."""
    saved_groups = state_dict["param_groups"]
    meta = state_dict.get(META_KEY)
    if meta is None:
        meta = saved_groups_meta(state_dict)
    if meta is not None and meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"state_dict: format_version {meta.get('format_version')} is newer than this "
                         f"optstate ({FORMAT_VERSION}); upgrade optstate to load it")
    clip = {} if meta is None else meta.get("clip", {})
    norm = clip.get("last_grad_norm") if isinstance(clip, dict) else None
    if not isinstance(clip, dict) or (norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                                            or not norm >= 0)):
        raise ValueError(f"state_dict: optstate clip state must be {{'last_grad_norm': a number >= 0}}, got {clip!r}")
    if len(saved_groups) != len(groups):
        raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, the optimizer has {len(groups)}")
    for i, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"state_dict: parameter group {i} has {len(sg['params'])} parameters, "
                             f"the optimizer's has {len(g['params'])}")
    return meta, clip


def _saved_ids(groups, saved_groups):
    """Saved parameter id -> (the live parameter, its group, the group's index)."""
    out = {}
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        for saved_id, p in zip(sg["params"], g["params"]):
            out[saved_id] = (p, g, gi)
    return out


def _unpacked_state(engine, state_dict: dict, ids):
    """Each saved entry checked and unpacked for its parameter: ``(new state, saved keys per
    (group, rank), encoded values to place per (codec, host, device, dtype))``."""
    new_state: Dict[torch.Tensor, ParamState] = {}
    keys_by_group: Dict[int, list] = {}
    encoded = {}  # (codec, host, device, dtype) -> [(state dict, key, source)]: placed together below
    for saved_id, entry in state_dict["state"].items():
        if saved_id not in ids and isinstance(saved_id, str):
            # an optimizer's own non-parameter state (MADGRAD's "k"), as it was saved (DCP keys
            # parameters by name: those are in ids)
            new_state[saved_id] = entry
            continue
        if saved_id not in ids:
            raise ValueError(f"state_dict: state for unknown parameter id {saved_id!r}")
        param, group, group_index = ids[saved_id]
        name = engine.name_of(param)
        what = f"parameter {saved_id}" + (f" ({name!r})" if name else "")
        if not isinstance(entry, dict):
            raise ValueError(f"state_dict: state of {what} must be a dict")
        st = ParamState()
        masters = MASTER_KEY in entry  # a parameter with master weights keeps its state in fp32
        for key, value in entry.items():
            value = unpack_value(value, what, param)
            _check_entry(param, key, value, what, engine.elementwise)
            if isinstance(value, EncodedTensor) and value.dtype != param.dtype and param.is_floating_point() \
                    and not is_dtensor(param) and not _fused_fp32_state(value, param) and not masters:
                # saved for a parameter of another float dtype: like torch, state follows the
                # parameter's dtype (decoded here, re-encoded by conform() below); a parameter with
                # master weights keeps its state in the master's fp32 on purpose
                value = value.decode(param.device, dtype=param.dtype)
            if isinstance(value, EncodedTensor):
                target = torch.device("cpu") if value.host_tier else param.device
                encoded.setdefault((value.codec, value.host_tier, target, value.dtype), []).append((st, key, value, param))
            else:
                value = _cast_like_torch(param, key, value, group, keep_dtype=masters)
            st[key] = value
        new_state[param] = st
        # an optimizer may key state by the tensor's rank (Adafactor factors matrices): compare like with like
        keys_by_group.setdefault((group_index, local(param).dim()), []).append((what, set(entry)))
    return new_state, keys_by_group, encoded


def load_state_dict(engine, groups, state_dict: dict) -> None:
    """Validate everything first; then swap the new state in and update ``groups`` in place
    (hooks run by the caller)."""
    check_is_state_dict(state_dict)
    saved_groups = state_dict["param_groups"]
    meta, clip = _checked_meta(state_dict, groups)
    new_state, keys_by_group, encoded = _unpacked_state(engine, state_dict, _saved_ids(groups, saved_groups))
    _check_same_keys(keys_by_group)
    pin = engine.pin_memory if engine.pin_memory is not None else torch.cuda.is_available()
    for (codec, host, device, dtype), items in encoded.items():
        placed = allocate_many(codec, [src.shape for _, _, src, _ in items], dtype, device, host, pin, engine.pinned)
        for (st, key, src, param), dst in zip(items, placed):
            copy_stored(dst, src)  # a lossless codec on the device is placed as a raw tensor
            st[key] = as_stored(param, dst)

    # Everything validated: commit.
    engine.sync_transfers()
    engine.invalidate_plan()
    engine.state.clear()
    engine.state.update(new_state)
    for g, sg in zip(groups, saved_groups):
        g.update({k: v for k, v in sg.items() if k not in ("params", "param_names", META_KEY)})
    if meta is not None:
        engine.step_count = int(meta.get("step", 0))
        engine.restore_nonfinite_count(int(meta.get("nonfinite_skipped", 0)))
        engine.policy.load_state_dict(meta.get("policy", {}))
        engine.clip_release.load_clip_state(clip)
    else:
        engine.step_count = _infer_step(new_state)
    with torch.no_grad():
        engine.conform()


def _infer_step(state) -> int:
    steps = [int(v.item() if isinstance(v, torch.Tensor) else v)
             for st in state.values() if isinstance(st, dict) for k, v in st.items() if k == "step" and v is not None]
    return max(steps, default=0)


def decoded_param_state(st: dict, device, param=None) -> dict:
    """A parameter's state with encoded values decoded (DTensors for a DTensor parameter)."""
    def decode(v):
        if not isinstance(v, EncodedTensor):
            return v
        out = v.decode(device)
        return like_param(param, out) if param is not None and is_dtensor(param) else out
    return {k: decode(v) for k, v in st.items()}


def to_plain_state_dict(state_dict: dict, device="cpu") -> dict:
    """Decode an optstate ``state_dict`` (e.g. read from a checkpoint file) into torch's plain
    optimizer format, without building an optimizer. Plain dicts pass through unchanged."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be an optimizer state_dict with 'state' and 'param_groups'")
    state = {}
    for pid, entry in state_dict["state"].items():
        values = {k: unpack_value(v, f"parameter {pid}") for k, v in entry.items()}
        state[pid] = {k: (v.decode(device) if isinstance(v, EncodedTensor) else v) for k, v in values.items()}
    return {"state": state, "param_groups": [{k: v for k, v in g.items() if k != META_KEY}
                                             for g in state_dict["param_groups"]]}


def export_state_dict(engine, param_groups, device="cpu") -> dict:
    """A torch-format state_dict with every state decoded (for the unwrapped optimizer)."""
    engine.sync_transfers()
    groups, state, index = [], {}, 0
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k not in ("params", META_KEY)}
        packed["params"] = list(range(index, index + len(g["params"])))
        for p in g["params"]:
            st = engine.state.get(p)
            if st:
                state[index] = {k: (v.decode(device) if isinstance(v, EncodedTensor) else
                                    (v.to(device) if isinstance(v, torch.Tensor) and not is_scalar_state(v) else v))
                                for k, v in st.items()}
            index += 1
        groups.append(packed)
    return {"state": state, "param_groups": groups}

