"""Policies: for (parameter, state key, step), which codec and which tier.

This module is the one place where those decisions are made. A decision depends only on the
parameter's *global* shape, dtype and name, the state key and the step (or the policy's phase),
never on a local shard or on the data, so every rank of a distributed job agrees.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

from .state.codecs import Codec, FP32Codec, get_codec
from .state.master_weights import MASTER_DTYPES, MASTER_KEY

#: codecs a master-weight correction may use
MASTER_CODECS = ("corr16", "corr8", "fp32")
#: codecs the moments take by name (``momentum_codec``/``variance_codec``; the integrations' ``state=``)
MOMENT_CODECS = ("int8", "int4", "bf16", "fp16", "fp32")

CodecSpec = Union[str, Codec, None]

#: State keys of torch.optim optimizers by role. A key in neither set is never compressed.
SIGNED_KEYS = frozenset({"exp_avg", "momentum_buffer", "grad_avg"})
NONNEGATIVE_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "sum", "acc_delta",
                              "variance"})  # Adafactor's unfactored second moment (1-D tensors)
#: parameter-shaped iterates (schedule-free's ``z``): lossless unless ``iterate_codec`` says otherwise
ITERATE_KEYS = frozenset({"z"})


@dataclass(frozen=True)
class ParamInfo:
    """What a policy may look at: a parameter's identity and global (unsharded) shape."""

    index: int
    group_index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    name: Optional[str] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_complex(self) -> bool:
        return self.dtype.is_complex


class Policy:
    """Base policy: everything uncompressed and on the parameter's device."""

    #: True when the policy wants the training loss (see :meth:`observe_loss`).
    wants_loss = False

    def codec_for(self, info: ParamInfo, key: str, step: int) -> Codec:
        return FP32Codec()

    def tier_for(self, info: ParamInfo, key: str, step: int) -> str:
        return "device"

    def master_codec(self, info: ParamInfo) -> Optional[Codec]:
        """The codec of a parameter's master-weight correction (``master_correction``), or None
        when the parameter keeps no master weights (its own dtype is the master)."""
        return None

    def may_compress(self, info: ParamInfo, step: int) -> bool:
        """Whether any state of this parameter may be stored compressed or off-device at ``step``."""
        return False

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Learn which optimizer this policy serves (its codecs may depend on it). Default: ignored."""

    def active(self, step: int) -> bool:
        """Whether the compressed phase is on at ``step`` (False: the warmup phase)."""
        return False

    def decision_key(self, step: int):
        """A value that changes whenever any decision of this policy may change; the engine
        reuses a step plan while it stays the same. Default: the step (never reused)."""
        return step

    def observe_loss(self, loss: float) -> None:
        """Feed the training loss (a float, identical on every rank). Default: ignored."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__


def _parse_rules(rules) -> Sequence[Tuple[re.Pattern, object]]:
    if rules is None:
        return ()
    items = rules.items() if isinstance(rules, Mapping) else rules
    parsed = []
    for pattern, spec in items:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"rules: invalid name pattern {pattern!r}: {e}") from None
        if isinstance(spec, Mapping):
            spec = {k: get_codec(v) for k, v in spec.items()}
        else:
            spec = get_codec(spec)
        parsed.append((rx, spec))
    return tuple(parsed)


def _parse_optimizer_codecs(spec) -> Dict[str, Dict[str, Codec]]:
    """``{optimizer class name: {state key: codec}}`` with codecs resolved (clear errors naming the entry)."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ValueError(f"optimizer_codecs must be a mapping {{optimizer class name: {{state key: codec}}}}, "
                         f"got {type(spec).__name__}")
    parsed = {}
    for name, keys in spec.items():
        if not isinstance(name, str) or not isinstance(keys, Mapping):
            raise ValueError(f"optimizer_codecs: entry {name!r} must map an optimizer class name to "
                             f"{{state key: codec}}, got {keys!r}")
        try:
            parsed[name] = {str(k): get_codec(v) for k, v in keys.items()}
        except ValueError as e:
            raise ValueError(f"optimizer_codecs[{name!r}]: {e}") from None
    return parsed


class WarmupPolicy(Policy):
    """Uncompressed for ``warmup_steps`` steps, then the configured codecs.

    Args (names and meanings as in torch-optstate 0.1.1, plus a few):
        warmup_steps: steps kept uncompressed before switching.
        momentum_key / variance_key: the optimizer's state keys for the first and second
            moment (``exp_avg`` / ``exp_avg_sq`` for Adam). ``momentum_buffer``, ``grad_avg``,
            ``max_exp_avg_sq``, ``exp_inf``, ``square_avg``, ``sum`` and ``acc_delta`` are
            recognized too, so SGD, RMSprop, Adamax, Adagrad and Adadelta compress as well.
        momentum_codec: codec for signed states after warmup (default ``int8``).
        variance_codec: codec for non-negative states after warmup (default ``fp32``, as in
            torch-optstate; the presets use ``int8`` or ``int4``).
        min_int8_elements: tensors with fewer elements use ``small_tensor_codec``.
        small_tensor_codec: codec for small tensors (default ``fp32``).
        device_resident: keep state on the parameter's device (default); ``False`` offloads
            every compressed state to (pinned) host memory.
        rules: ``{name_regex: codec}`` or ``{name_regex: {state_key: codec}}``; the first
            pattern that matches a parameter's name (``re.search``) overrides the codecs
            above, e.g. ``{"embed": "fp32"}``. Names come from ``named_parameters``, from
            ``param_names`` in the optimizer's groups, or from :meth:`bind_names`.
        named_parameters: ``model.named_parameters()`` or a module, to learn names.
        master_correction: keep fp32 master weights for bfloat16 parameters as the state
            ``master_correction`` in this codec: ``corr16`` (exact fp32 master, 2 bytes per
            element), ``corr8`` (16-bit significand, 1 byte) or ``fp32``; None (default): off.
            Used from the first step (no warmup); see :mod:`optstate_core.state.master_weights`.
        master_tier: where ``master_correction`` lives: ``"device"`` or ``"host"`` (pinned host
            memory; it streams through the staging ring at each update while the moments stay
            where ``device_resident`` says); None (default): with the moments.
        iterate_codec: codec for parameter-shaped iterates (:data:`ITERATE_KEYS`: schedule-free's
            ``z``), default None: fp32. ``"fp24"`` (bf16 + an 8-bit residual, 3 bytes, within
            ``2**-15`` relative) gives them the lean master-weight treatment.
        optimizer_codecs: ``{optimizer class name: {state key: codec}}``: codecs for one
            optimizer's states that replace ``momentum_codec``/``variance_codec`` (name rules
            still come first, small tensors still take ``small_tensor_codec``). The presets use it
            where an optimizer's state needs another codec (docs/compatibility.md). The wrapper
            tells the policy its optimizer (:meth:`bind_optimizer`).
        whole_blocks_1d: True (default): a 1-D state whose length is not a whole number of its
            codec's blocks takes ``small_tensor_codec`` (fp32 if that is a block codec too), so
            the codec a parameter gets is the same in one process and under FSDP2 on any mesh
            whose shards hold whole blocks, and its checkpoints reshard (:func:`splits_blocks`).
            False: it keeps the block codec in one process (and is fp32 where FSDP2 cuts its blocks).
    """

    def __init__(self, warmup_steps: int = 100, momentum_key: str = "exp_avg", variance_key: str = "exp_avg_sq",
                 variance_codec: CodecSpec = None, min_int8_elements: int = 4096,
                 small_tensor_codec: CodecSpec = None, device_resident: Optional[bool] = None,
                 momentum_codec: CodecSpec = "int8", rules=None, named_parameters=None,
                 master_correction: CodecSpec = None, master_tier: Optional[str] = None,
                 optimizer_codecs: Optional[Mapping[str, Mapping[str, CodecSpec]]] = None,
                 iterate_codec: CodecSpec = None, whole_blocks_1d: bool = True):
        if master_tier not in (None, "device", "host"):
            raise ValueError(f"master_tier must be None, 'device' or 'host', got {master_tier!r}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not isinstance(min_int8_elements, int) or isinstance(min_int8_elements, bool) or min_int8_elements < 0:
            raise ValueError(f"min_int8_elements must be an int >= 0, got {min_int8_elements!r}")
        if device_resident is not None and not isinstance(device_resident, bool):
            raise ValueError(f"device_resident must be None, True or False, got {device_resident!r}")
        for arg, key in (("momentum_key", momentum_key), ("variance_key", variance_key)):
            if not isinstance(key, str) or not key:
                raise ValueError(f"{arg} must be a non-empty string, got {key!r}")
        self.warmup_steps = warmup_steps
        self.momentum_key = momentum_key
        self.variance_key = variance_key
        self.momentum_codec = get_codec(momentum_codec)
        self.variance_codec = get_codec(variance_codec)
        self.min_int8_elements = min_int8_elements
        self.small_tensor_codec = get_codec(small_tensor_codec)
        self.device_resident = device_resident
        self.rules = _parse_rules(rules)
        self.master_correction = None if master_correction is None else get_codec(master_correction)
        self.master_tier = master_tier
        if self.master_correction is not None and self.master_correction.name not in MASTER_CODECS:
            raise ValueError(f"master_correction must be one of {', '.join(MASTER_CODECS)} or None, "
                             f"got {master_correction!r}")
        self.optimizer_codecs = _parse_optimizer_codecs(optimizer_codecs)
        self.iterate_codec = get_codec(iterate_codec)
        if not isinstance(whole_blocks_1d, bool):
            raise ValueError(f"whole_blocks_1d must be True or False, got {whole_blocks_1d!r}")
        self.whole_blocks_1d = whole_blocks_1d
        self._optimizer: Optional[str] = None  # the class name of the optimizer served (bind_optimizer)
        self._names: Dict[int, str] = {}
        self._cache: Dict[tuple, Codec] = {}
        if named_parameters is not None:
            self.bind_names(named_parameters)

    # -- names ---------------------------------------------------------------------------
    def bind_names(self, named_parameters) -> "WarmupPolicy":
        """Learn parameter names from ``model.named_parameters()`` or a module."""
        if isinstance(named_parameters, torch.nn.Module):
            named_parameters = named_parameters.named_parameters()
        for name, p in named_parameters:
            self._names[id(p)] = name
        self._cache.clear()
        return self

    def name_of(self, param: torch.Tensor) -> Optional[str]:
        return self._names.get(id(param))

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Serve ``optimizer``: its entry of ``optimizer_codecs`` applies. A policy whose
        ``optimizer_codecs`` tell two optimizer classes apart serves one of them only."""
        name = type(optimizer).__name__
        if self._optimizer not in (None, name) and (self._optimizer in self.optimizer_codecs or
                                                    name in self.optimizer_codecs):
            raise ValueError(f"policy: this policy serves a {self._optimizer} already and its optimizer_codecs "
                             f"differ for {name}; make one policy per optimizer (e.g. make_policy(...) per wrap)")
        self._optimizer = name
        self._cache.clear()

    # -- decisions -------------------------------------------------------------------------
    def role_of(self, key: str) -> Optional[str]:
        if key == MASTER_KEY:
            return "master"
        if key == self.momentum_key or (key in SIGNED_KEYS and key != self.variance_key):
            return "momentum"
        if key == self.variance_key or key in NONNEGATIVE_KEYS:
            return "variance"
        if key in ITERATE_KEYS:
            return "iterate"
        return None

    def active(self, step: int) -> bool:
        return step >= self.warmup_steps

    def decision_key(self, step: int):
        return self.active(step)

    def _rule_for(self, info: ParamInfo, key: str):
        if info.name is None:
            return None
        for rx, spec in self.rules:
            if rx.search(info.name):
                if isinstance(spec, Mapping):
                    return spec.get(key)
                return spec
        return None

    def _configured(self, info: ParamInfo, key: str) -> Codec:
        role = self.role_of(key)
        if role is None or info.is_complex or info.numel == 0:
            return FP32Codec()
        cache_key = (info.name, info.shape, key)
        codec = self._cache.get(cache_key)
        if codec is None:
            codec = self._rule_for(info, key)
            if codec is None:
                codec = self.optimizer_codecs.get(self._optimizer, {}).get(key)
                if codec is None:
                    codec = {"momentum": self.momentum_codec, "variance": self.variance_codec,
                             "iterate": self.iterate_codec}[role]
                if not codec.lossless and info.numel < self.min_int8_elements:
                    codec = self.small_tensor_codec
            if self.whole_blocks_1d and splits_blocks(codec, info.shape):
                codec = FP32Codec() if splits_blocks(self.small_tensor_codec, info.shape) else self.small_tensor_codec
            codec = codec.specialize(nonnegative=(role == "variance"))
            self._cache[cache_key] = codec
        return codec

    def master_codec(self, info):
        if self.master_correction is None or info.dtype not in MASTER_DTYPES or info.numel == 0:
            return None
        return self.master_correction

    def codec_for(self, info, key, step):
        if key == MASTER_KEY:  # the master exists from the first step: no warmup for it
            return self.master_codec(info) or FP32Codec()
        if not self.active(step):
            return FP32Codec()
        return self._configured(info, key)

    def tier_for(self, info, key, step):
        if key == MASTER_KEY and self.master_tier is not None:
            return self.master_tier
        if self.device_resident is False and key == MASTER_KEY:
            return "host"
        if self.device_resident is False and self.active(step) and self.role_of(key) is not None:
            return "host"
        return "device"

    def may_compress(self, info, step):
        if self.master_codec(info) is not None:
            return True
        if not self.active(step) or info.is_complex or info.numel == 0:
            return False
        if self.device_resident is False:
            return True
        return any(not self._configured(info, k).lossless for k in (self.momentum_key, self.variance_key, *ITERATE_KEYS))

    def describe(self):
        master = f", master_correction={self.master_correction!r}" if self.master_correction is not None else ""
        master += f", master_tier={self.master_tier!r}" if self.master_tier is not None else ""
        master += f", iterate={self.iterate_codec!r}" if not self.iterate_codec.lossless else ""
        return (f"{type(self).__name__}(warmup_steps={self.warmup_steps}, momentum={self.momentum_codec!r}, "
                f"variance={self.variance_codec!r}{master})")


def splits_blocks(codec: Codec, shape) -> bool:
    """A 1-D state whose length is not a whole number of the codec's blocks: sharded, its last
    block would straddle ranks, so it takes the small-tensor codec on every mesh (one process
    included), and the codec a parameter gets does not depend on the mesh."""
    return not codec.lossless and len(shape) == 1 and shape[0] % codec.granularity != 0


class AdaptiveWarmupPolicy(WarmupPolicy):
    """Warmup that ends early when the loss plateaus (or at ``warmup_steps`` at the latest).

    The loss comes from the closure passed to ``step`` or from :meth:`observe_loss`. The loss is
    "stale" when it does not improve on the best seen by more than ``tol`` (relative, as in
    ``loss < best * (1 - tol)``); after ``patience`` stale observations compression switches
    on for good. Under data parallelism feed the same (all-reduced) loss on every rank; the
    integrations do this for you.
    """

    wants_loss = True

    def __init__(self, warmup_steps: int = 100, *, patience: int = 5, tol: float = 1e-3, **options):
        """``options``: :class:`WarmupPolicy`'s, by keyword (one list: every option the parent gains
        is accepted here too)."""
        super().__init__(warmup_steps, **options)
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        if not (isinstance(tol, (int, float)) and 0 <= tol < 1):
            raise ValueError(f"tol must be a float in [0, 1), got {tol!r}")
        self.patience = patience
        self.tol = float(tol)
        self.best_loss: Optional[float] = None
        self.stale_steps = 0
        self.switched = False

    def active(self, step):
        return self.switched or step >= self.warmup_steps

    def observe_loss(self, loss: float) -> bool:
        """Record one loss value; returns True when this call switched compression on."""
        loss = float(loss)
        if not math.isfinite(loss) or self.switched:
            return False
        if self.best_loss is None or loss < self.best_loss - self.tol * abs(self.best_loss):
            self.best_loss = loss
            self.stale_steps = 0
            return False
        self.stale_steps += 1
        if self.stale_steps >= self.patience:
            self.switched = True
            return True
        return False

    update_on_loss = observe_loss  # torch-optstate's name

    def activate_compression(self) -> None:
        self.switched = True

    def state_dict(self):
        return {"best_loss": self.best_loss, "stale_steps": self.stale_steps, "switched": self.switched}

    def load_state_dict(self, state):
        self.best_loss = state.get("best_loss")
        self.stale_steps = int(state.get("stale_steps", 0))
        self.switched = bool(state.get("switched", False))


def named_parameter_names(named_parameters: Iterable) -> Dict[int, str]:
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters()
    return {id(p): n for n, p in named_parameters}
