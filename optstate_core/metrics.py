"""Memory report and step metrics: the one place that computes bits per parameter."""
from __future__ import annotations

from typing import Dict

from .state.codecs import EncodedTensor
from .state.dtensor import local
from .state.master_weights import MASTER_KEY
from .state.store import is_scalar_state, state_nbytes



def bits_per_param(state_bytes: int, n_params: int) -> float:
    """Optimizer bytes held between steps x 8 / parameter count (all optimized parameters)."""
    return 8.0 * state_bytes / n_params if n_params else 0.0


def memory_report(engine, param_groups) -> dict:
    """What the optimizer holds between steps, per tier and per codec, and the last step's costs.

    Keys: ``device_bytes``, ``host_bytes``, ``state_bytes`` (their sum), ``by_codec`` (bytes per
    codec name, ``fp32`` for raw state), ``n_params``, ``bits_per_param``, ``step``,
    ``compression_active``, ``nonfinite_skipped``, ``last_step`` (materialize / inner step /
    commit / total milliseconds, chunks, tiles, bytes moved host->device and device->host),
    ``training_bytes`` (``params``, ``master_correction``, ``gradients`` held now, and the other
    ``optimizer_state``, each ``{"device": bytes, "host": bytes}``; the correction is also in
    ``state_bytes``) and ``device_bytes_per_param`` (their device total per parameter; with
    gradients released, call it between backward and ``step`` to see them at zero), and
    ``prefetch`` (:meth:`~optstate_core.schedule.prefetch.PrefetchArea.report`: the prefetch area's budget,
    bytes staged in the last step, bytes moved per phase ``backward``/``step``/``behind_forward``,
    and on CUDA the spans of the copies that ran beside compute, ``hidden_ms``), ``granularity``
    (how the wrapped optimizer is called: ``"elementwise"``, ``"tensor"`` or ``"step"``, see
    :mod:`optstate_core.step.granularity`) and ``transient_bytes`` (the full-precision state decoded
    at once in the last step beyond what is stored: one chunk, or with ``"step"`` every parameter's),
    ``park_buffers`` (the phase switch's host buffers, kept across parks: ``bytes`` of their payloads,
    ``pinned_bytes`` pinned for them, ``prepare_seconds`` spent pinning them ahead, see :mod:`~optstate_core.schedule.park_buffers`).
    """
    device_bytes = host_bytes = 0
    by_codec: Dict[str, int] = {}
    n_params = 0
    training = {"params": {"device": 0, "host": 0}, "master_correction": {"device": 0, "host": 0},
                "gradients": {"device": 0, "host": 0}, "optimizer_state": {"device": 0, "host": 0}}
    for group in param_groups:
        for p in group["params"]:
            lp = local(p)  # this process's shard under FSDP2
            n_params += lp.numel()
            training["params"]["device"] += lp.numel() * lp.element_size()
            if p.grad is not None:
                g = local(p.grad)
                training["gradients"]["device"] += g.numel() * g.element_size()
            for key, value in engine.state.get(p, {}).items():
                nbytes = 0 if is_scalar_state(value) else state_nbytes(value)
                if not nbytes:
                    continue
                if isinstance(value, EncodedTensor):
                    name = value.codec.name
                    host = value.host_tier or value.device.type == "cpu" and p.device.type != "cpu"
                else:
                    name = "fp32" if value.is_floating_point() else str(value.dtype)
                    host = value.device.type == "cpu" and p.device.type != "cpu"
                by_codec[name] = by_codec.get(name, 0) + nbytes
                if host:
                    host_bytes += nbytes
                else:
                    device_bytes += nbytes
                part = "master_correction" if key == MASTER_KEY else "optimizer_state"
                training[part]["host" if host else "device"] += nbytes
    state_bytes = device_bytes + host_bytes
    return {
        "device_bytes": device_bytes,
        "host_bytes": host_bytes,
        "state_bytes": state_bytes,
        "by_codec": by_codec,
        "n_params": n_params,
        "bits_per_param": bits_per_param(state_bytes, n_params),
        "step": engine.step_count,
        "compression_active": engine.policy.active(max(engine.step_count - 1, 0)),  # phase of the last step
        "nonfinite_skipped": engine.nonfinite_skipped(),
        "last_step": engine.metrics.as_dict(),
        "training_bytes": training,
        "device_bytes_per_param": (sum(v["device"] for v in training.values()) / n_params) if n_params else 0.0,
        "prefetch": engine.schedule.area.report(),
        "granularity": engine.granularity,
        "transient_bytes": engine.metrics.peak_materialized_bytes,
        "park_buffers": engine.park_buffers.report(),
    }


def log_metrics(report: dict, prefix: str = "optstate/") -> Dict[str, float]:
    """A flat dict of floats for loggers (TensorBoard, W&B, Lightning's ``self.log``, ...) from a
    :func:`memory_report`."""
    last = report["last_step"]
    return {
        f"{prefix}state_mb_device": report["device_bytes"] / 2**20,
        f"{prefix}state_mb_host": report["host_bytes"] / 2**20,
        f"{prefix}bits_per_param": report["bits_per_param"],
        f"{prefix}step_ms": last["total_ms"],
        f"{prefix}overhead_ms": max(0.0, last["total_ms"] - last["inner_step_ms"]),
        f"{prefix}compression_active": float(report["compression_active"]),
        f"{prefix}nonfinite_skipped": float(report["nonfinite_skipped"]),
    }
