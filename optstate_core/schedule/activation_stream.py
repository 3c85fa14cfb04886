"""Activation offload: the layer inputs that activation checkpointing keeps live in host memory
between a layer's forward and its recompute.

Under activation checkpointing a training forward keeps one tensor per layer for backward: the
layer's input (its hidden states), from which the recompute runs the layer again. At long
sequences these add up (Llama-3-70B at 1 x 16k tokens: 80 x 256 MiB = 20 GiB), and under a memory
cap they are what is left once the weights and the optimizer state stream
(:mod:`.weight_stream`). :func:`optstate_core.offload_activations` (``model``; ``layers``, as for
weight streaming, default the model's decoder layers) moves them:

* **forward**: when the next layer starts (the caller may still read a layer's input after it, as a
  residual added outside the layer does), the input a checkpointed forward kept is copied to host
  memory (pinned, from a pool reused every step) on a stream of its own and its device storage is
  freed (``untyped_storage().resize_(0)``: the tensor autograd keeps is the same object, its
  storage empty); the last ``prefetch + 1`` layers keep theirs, their recompute comes first;
* **backward**: a layer's recompute (its forward pre-hook in backward) brings its input back if it
  is not there yet and copies in the inputs of the ``prefetch`` layers before it, on a copy stream;
  the compute stream waits for a copy only where it is about to read it.

The bytes are copied through a tensor of their own over the same storage, so autograd's version
counters do not move: the recompute and backward see the tensors they saved. A forward is
offloaded only where the input is kept for a recompute: inside reentrant checkpointing (gradients
off while the input requires them) or non-reentrant checkpointing. An input whose storage the
layer's output shares is left alone. Code that keeps the layer inputs itself would read empty
storage until backward: a training forward of the model with ``output_hidden_states=True`` (its
argument or its config) is refused with a ``ValueError``; other such code must not be combined
with the offload.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from .layer_visits import (checked_layers, checkpoints_itself, first_grad_output, in_backward, stays_over_the_turn,
                           under_checkpoint)

log = logging.getLogger("optstate")


def _raw(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a tensor of its own (writes through it move no version counter)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _hidden_states(args, kwargs) -> Optional[torch.Tensor]:
    """A layer call's input: its first positional tensor, or ``hidden_states=``."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    x = kwargs.get("hidden_states")
    return x if isinstance(x, torch.Tensor) else None


def _kept_for_recompute(module: nn.Module, x: torch.Tensor, outer_grad: bool) -> bool:
    """Whether this forward of ``module`` runs inside activation checkpointing and keeps ``x`` for
    the recompute (non-reentrant: its saved-tensor hook; the layer checkpoints its own forward; or
    reentrant: gradients off inside a model forward that has them on, ``outer_grad``, while the
    input needs them)."""
    if in_backward():
        return False
    if torch.is_grad_enabled():
        return under_checkpoint() or checkpoints_itself(module)
    return outer_grad and x.requires_grad


class _Offloaded:
    """One layer input kept for a recompute: the tensor (weakly: autograd owns it), its storage's
    bytes on the host once sent, and the event that orders the copy in (CUDA)."""

    def __init__(self, x: torch.Tensor):
        self.tensor = weakref.ref(x)
        self.nbytes = x.untyped_storage().nbytes()
        self.host: Optional[torch.Tensor] = None  # its bytes in host memory, once sent
        self.resident, self.used = True, False  # used: handed back to its recompute
        self.copied = None  # CUDA: the copy in is done (the compute stream waits for it)


class ActivationStream:
    """Moves the checkpointed inputs of ``layers`` to host memory after their forward and back
    before their recompute (see the module doc)."""

    def __init__(self, layers: Sequence[nn.Module], prefetch: int = 1, model: Optional[nn.Module] = None):
        self.layers, self.prefetch = list(layers), prefetch
        self._index_of = {id(m): i for i, m in enumerate(self.layers)}
        self._pending: Dict[int, List[_Offloaded]] = {}  # layer index -> its inputs kept, latest last
        self._waiting: List[_Offloaded] = []  # inputs to send when the next layer starts
        self._pool: Dict[int, List[tuple]] = {}  # nbytes -> free (host buffer, event after its last read)
        self._streams = None  # CUDA: (out, in)
        self.d2h_bytes = self.h2d_bytes = 0
        self._handles = []
        self._outer_grad = True  # the model's forward runs with gradients (without the model: assumed)
        for module in self.layers:
            self._handles += [module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                              module.register_forward_hook(self._after_forward, with_kwargs=True)]
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._model_starts, with_kwargs=True))

    # -- forward: out ------------------------------------------------------------------------------
    def _model_starts(self, model, args, kwargs) -> None:
        """The model's forward: whether it has gradients (a no-grad forward, as generation or
        evaluation, keeps nothing for a recompute, whatever its inputs require), and no hidden states out."""
        if not in_backward():
            self._outer_grad = torch.is_grad_enabled()
            _refuse_hidden_states(model, kwargs)

    def _after_forward(self, module, args, kwargs, output) -> None:
        i = self._index_of[id(module)]
        x = _hidden_states(args, kwargs)
        if (x is None or stays_over_the_turn(i, len(self.layers), self.prefetch)
                or not _kept_for_recompute(module, x, self._outer_grad)):
            return
        storage = x.untyped_storage()
        outs = output if isinstance(output, (tuple, list)) else (output,)
        if not storage.nbytes() or any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == storage.data_ptr()
                                       for o in outs):
            return  # nothing to move, or the output is a view of the input
        entry = _Offloaded(x)
        # sent when the next layer starts: the caller may still read the input (a residual added outside the layer)
        self._waiting.append(entry)
        self._pending.setdefault(i, []).append(entry)
        out = first_grad_output(output)
        if out is not None:  # where the recompute runs no hook, the output's gradient announces it
            out.register_hook(lambda grad, i=i, entry=entry: self._before_backward(i, entry))

    def _send(self, entry: _Offloaded) -> None:
        """The input's bytes to a host buffer (CUDA: on the out stream, after the compute queued so
        far) and its device storage freed (reused once the copy is done)."""
        x = entry.tensor()
        if x is None or entry.used or x.untyped_storage().nbytes() != entry.nbytes:
            return  # gone, or its recompute came first, or its storage changed meanwhile
        storage = x.untyped_storage()
        entry.host = self._host_buffer(storage)
        with self._on("out") as stream:
            _raw(entry.host).copy_(_raw(storage), non_blocking=stream is not None)
            if stream is not None:
                x.record_stream(stream)  # its memory is reused only after the copy out
        storage.resize_(0)
        entry.resident = False
        self.d2h_bytes += entry.nbytes

    def _host_buffer(self, storage) -> torch.Tensor:
        """A host buffer of the storage's size: one the pool has (once its last copy in is done), or new."""
        free = self._pool.get(storage.nbytes())
        if free:
            host, event = free.pop()
            if event is not None:
                self._stream("out").wait_event(event)
            return host
        return torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")

    # -- backward: in ------------------------------------------------------------------------------
    def _before_forward(self, module, args, kwargs) -> None:
        """In a recompute: this layer's input back (if not there yet), and the inputs of the
        ``prefetch`` layers before it copied in ahead."""
        if not in_backward():  # a forward: the inputs of the layers before go out now
            for entry in self._waiting:
                self._send(entry)
            self._waiting.clear()
            return
        i = self._index_of[id(module)]
        x = _hidden_states(args, kwargs)
        entries = self._pending.get(i, [])
        mine = next((e for e in entries if x is not None and e.tensor() is not None
                     and e.tensor().untyped_storage()._cdata == x.untyped_storage()._cdata), None)
        self._before_backward(i, mine)

    def _before_backward(self, i: int, mine: Optional[_Offloaded]) -> None:
        """Layer ``i``'s recompute is next: its input ``mine`` back where the compute stream reads it,
        and the inputs of the ``prefetch`` layers before it copied in ahead. Reached from the
        recompute's forward pre-hook (``mine`` found by the storage the recompute's input shares) or
        from the gradient of the layer's output; whichever comes first does it."""
        self._waiting.clear()  # backward began: what was not sent stays on the device
        entries = self._pending.get(i, [])
        entries[:] = [e for e in entries if e is not mine and e.tensor() is not None]  # (and forwards without backward)
        for j in range(i - 1, max(-1, i - 1 - self.prefetch), -1):
            ahead = self._pending.get(j)
            if ahead:
                self._bring(ahead[-1])
        if mine is not None:
            self._hand_back(mine)

    def _hand_back(self, entry: _Offloaded) -> None:
        """The input back on the device where the compute stream reads it (once), its host buffer to the pool."""
        x = entry.tensor()
        if x is None or entry.used:
            return
        entry.used = True
        if entry.host is None:  # never sent
            return
        self._bring(entry)
        if entry.copied is not None:
            compute = torch.cuda.current_stream(x.device)
            compute.wait_event(entry.copied)
            x.record_stream(compute)  # autograd frees it on the compute stream
        self._recycle(entry)

    def _bring(self, entry: _Offloaded) -> None:
        x = entry.tensor()
        if entry.resident or x is None:
            return
        storage = x.untyped_storage()
        with self._on("in") as stream:
            storage.resize_(entry.nbytes)
            _raw(storage).copy_(_raw(entry.host), non_blocking=stream is not None)
            if stream is not None:
                entry.copied = torch.cuda.Event()
                entry.copied.record(stream)
        entry.resident = True
        self.h2d_bytes += entry.nbytes

    def _recycle(self, entry: _Offloaded) -> None:
        """The entry's host buffer back to the pool, usable once its copy in is done."""
        self._pool.setdefault(entry.nbytes, []).append((entry.host, entry.copied))

    # -- streams -----------------------------------------------------------------------------------
    def _stream(self, which: str):
        if self._streams is None:
            self._streams = {"out": torch.cuda.Stream(), "in": torch.cuda.Stream()}
        return self._streams[which]

    @contextlib.contextmanager
    def _on(self, which: str):
        """The copy's stream (CUDA: ``which``'s; a copy out after the compute queued so far), or None (CPU)."""
        if not torch.cuda.is_available() or not self.layers or not _on_cuda(self.layers[0]):
            yield None
            return
        stream = self._stream(which)
        if which == "out":  # the input is written by the compute queued so far (a copy in needs no such wait)
            stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            yield stream

    # -- outside the visits ------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Bytes of layer inputs in host memory now."""
        return sum(e.nbytes for entries in self._pending.values() for e in entries
                   if e.host is not None and not e.resident and e.tensor() is not None)

    def pooled_bytes(self) -> int:
        """Bytes of the host buffers held (in use or pooled)."""
        return self.host_bytes() + sum(n * len(free) for n, free in self._pool.items())

    def close(self) -> None:
        """Bring every input still out back and remove the hooks."""
        for entries in self._pending.values():
            for e in entries:
                self._hand_back(e)
        if self._streams is not None:
            torch.cuda.synchronize()
        self._pending.clear()
        self._waiting.clear()
        for h in self._handles:
            h.remove()
        self._handles = []


def _refuse_hidden_states(model, kwargs) -> None:
    """A training forward that returns every layer's hidden states would hand out the inputs this
    offload frees until backward: refused before anything runs."""
    asked = kwargs.get("output_hidden_states")
    if asked is None:
        asked = getattr(getattr(model, "config", None), "output_hidden_states", False)
    if asked and model.training and torch.is_grad_enabled():
        raise ValueError("output_hidden_states=True: with offload_activations the layer inputs (the hidden states) "
                         "live in host memory between forward and backward; ask for them in an eval or no-grad "
                         "forward, or close() the offload")


def _on_cuda(module: nn.Module) -> bool:
    p = next(module.parameters(), None)
    return p is not None and p.is_cuda


def offload_activations(model: nn.Module, layers: Optional[Sequence[nn.Module]] = None,
                        prefetch: int = 1) -> ActivationStream:
    """Keep the inputs that activation checkpointing saves for ``model``'s decoder layers (or
    ``layers``) in host memory between forward and recompute (see :mod:`.activation_stream`)."""
    layers = checked_layers("offload_activations", model, layers, prefetch)
    stream = ActivationStream(layers, prefetch, model)
    log.info("optstate: offloading the checkpointed inputs of %d layers to host memory", len(layers))
    return stream
