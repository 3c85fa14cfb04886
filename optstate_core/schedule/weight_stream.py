"""Weight streaming: decoder layers' weights live in host memory and visit the device only for their
layer's forward, its recompute and backward, and its update.

:func:`optstate_core.stream_weights` (or ``optimizer.stream_weights(model)``) takes a model and its
wrapped optimizer (gradient release on). Each streamed
layer's parameters keep their shape, dtype and device (the optimizer, its state and its plans see
the same tensors as without streaming), but their device storage is freed between visits
(``untyped_storage().resize_(0)``, as FSDP frees unsharded parameters) and their values live in a
host copy (pinned when the device is CUDA):

* **forward**: a forward pre-hook copies the layer in (and the next ``prefetch`` layers); after the
  forward the layer is freed again unless autograd will read its weights from this forward (a
  forward with gradients outside activation checkpointing, reentrant or not), in which case it
  stays until its update;
* **recompute and backward**: under activation checkpointing the recompute runs the forward again,
  whose pre-hook brings the layer back; it then stays through backward;
* **update**: gradient release updates the device copy in backward (the paths ``step()`` takes,
  so a streamed run equals an unstreamed one bit for bit); once every parameter of the layer that
  had a gradient is updated, the device copy is written back to the host copy and freed. On a
  backward that does not end in a step, the layer is freed once all its gradients are accumulated;
* **the turns**: the last ``prefetch + 1`` layers of a training forward stay for their recompute,
  and the first ``prefetch + 1`` stay after their update for the next forward (written back all
  the same), so the two turns of a step copy nothing.

On CUDA the copies in run on a copy stream and the write-backs on a stream of their own, both
behind the compute: the compute stream waits for a layer's copy in only when it is about to run
it, a write-back waits for the update, a copy in for that layer's last write-back, and a freed
layer's memory is reused only after the compute and the write-back queued before its release. The
host never waits. ``model.state_dict()`` reads the host copies, ``model.load_state_dict()`` writes through the device
copy to them; :meth:`WeightStream.gathered` brings every layer to the device for code that reads or
writes the weights directly.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from .activation_stream import ActivationStream
from .layer_visits import (checked_layers, checkpoints_itself, decoder_layers, first_grad_output, in_backward,
                           stays_over_the_turn, under_checkpoint)

log = logging.getLogger("optstate")


#: host copies of parameters whose weights :func:`offload_weights` moved before an optimizer
#: existed; :class:`WeightStream` takes them over
#: (keyed by id: a tensor key would be compared by value) -> (a weak reference to it, its host copy)
_OFFLOADED: Dict[int, tuple] = {}


#: the layers offload_weights() gave a state-dict hook that reads those host copies (once each)
_READS_HOST_COPIES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _take_offloaded(p) -> Optional[torch.Tensor]:
    """The host copy offload_weights() made of ``p`` (handed over: forgotten here), or None."""
    entry = _OFFLOADED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    del _OFFLOADED[id(p)]
    return entry[1]


def offload_weights(model: nn.Module, layers: Optional[Sequence[nn.Module]] = None) -> int:
    """Move the weights of ``model``'s decoder layers (or ``layers``) to host memory now (pinned for
    CUDA), their device storage freed; :func:`stream_weights` later streams them from there. For a
    model built one layer at a time (``apps.llama.build_model(stream=True)``) or handed to a
    framework that moves the model to the GPU before it builds the optimizer (the HF Trainer: the
    move is then a no-op). Returns the bytes moved."""
    moved = 0
    for module in (decoder_layers(model) if layers is None else layers):
        if module not in _READS_HOST_COPIES:  # its state_dict reads the host copies
            module._register_state_dict_hook(_offloaded_state_dict)
            _READS_HOST_COPIES.add(module)
        for p in module.parameters():
            if _OFFLOADED.get(id(p), (lambda: None,))[0]() is p or p.device.type == "meta":
                continue
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)
            host.copy_(p.detach())
            p.untyped_storage().resize_(0)
            _OFFLOADED[id(p)] = (weakref.ref(p, lambda _, key=id(p): _OFFLOADED.pop(key, None)), host)
            moved += host.numel() * host.element_size()
    return moved


def _offloaded_state_dict(module, state_dict, prefix, local_metadata):
    """A state-dict hook: the host copy of each parameter offload_weights() moved (until a stream takes it over)."""
    for name, p in module.named_parameters():
        entry = _OFFLOADED.get(id(p))
        if entry is not None and entry[0]() is p and prefix + name in state_dict:
            state_dict[prefix + name] = entry[1]
    return state_dict


class _Layer:
    """One streamed layer: its parameters, their host copies, whether the device holds them now, and
    the events that order its copies (CUDA)."""

    def __init__(self, index: int, module: nn.Module, pin: bool):
        self.index, self.module = index, module
        self.params = [p for p in module.parameters()]
        offloaded = [_take_offloaded(p) for p in self.params]  # offload_weights() moved them already
        self.host = [h if h is not None else torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                     for p, h in zip(self.params, offloaded)]
        self.nbytes = [p.numel() * p.element_size() for p in self.params]
        self.bytes = sum(self.nbytes)  # the layer's weights, as they cross PCIe
        self.resident = True
        self.keep = False  # autograd reads these weights (a forward with gradients): kept until updated
        self.waiting: set = set()  # ids of parameters whose update (or accumulation) this backward awaits
        self.loaded = None  # CUDA: the event after the copy in (the compute stream waits for it)
        self.written = None  # CUDA: the event after the last write-back (the next copy in waits for it)

    def write_back(self, stream) -> None:
        """Device copy -> host copy after the update queued so far: on ``stream`` (CUDA: the
        write-back stream, so the compute goes on meanwhile; the device memory is kept until the
        copy is done) or the current one (None)."""
        pairs = [(p, h) for p, h in zip(self.params, self.host) if p.untyped_storage().nbytes()]
        if stream is None:
            with torch.no_grad():
                for p, h in pairs:
                    h.copy_(p.detach())
            return
        updated = torch.cuda.Event()
        updated.record()
        with torch.no_grad(), torch.cuda.stream(stream):
            stream.wait_event(updated)
            for p, h in pairs:
                h.copy_(p.detach(), non_blocking=True)
                p.record_stream(stream)
            self.written = torch.cuda.Event()
            self.written.record(stream)

    def free(self) -> None:
        """Give the device storage back; on CUDA the memory is reused only after the compute stream's
        work queued so far (it was allocated on the copy stream)."""
        for p in self.params:
            if p.is_cuda and p.untyped_storage().nbytes():
                p.record_stream(torch.cuda.current_stream(p.device))
            p.untyped_storage().resize_(0)
        self.resident, self.keep = False, False

    def load(self, stream) -> None:
        """Host copy -> a fresh device storage, on ``stream`` (CUDA: the copy stream; None: the
        current stream)."""
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            if stream is not None and self.written is not None:
                stream.wait_event(self.written)
            for p, h, n in zip(self.params, self.host, self.nbytes):
                p.untyped_storage().resize_(n)
                p.detach().copy_(h, non_blocking=h.is_pinned())
            if stream is not None:
                self.loaded = torch.cuda.Event()
                self.loaded.record(stream)
        self.resident = True

    def ready(self) -> None:
        """Make the compute stream wait for the copy in, or for a layer that stayed on the device,
        its last write-back (its next update must not overwrite what is still being copied)."""
        event = self.loaded if self.loaded is not None else self.written
        if event is not None:
            torch.cuda.current_stream(self.params[0].device).wait_event(event)
        self.loaded = None  # (``written`` stays: the next copy in waits for it too; a done event costs nothing)


class WeightStream:
    """Streams the weights of ``layers`` through the device around each visit (see the module doc).
    The ``prefetch + 1`` layers at each turn stay on the device across it: the last ones from their
    forward to their recompute, the first ones from their update to the next forward."""

    def __init__(self, layers: Sequence[nn.Module], release, boundary, prefetch: int = 1):
        self.release, self.boundary, self.prefetch = release, boundary, prefetch
        self.layers: List[_Layer] = []
        self._layer_of: Dict[int, _Layer] = {}
        self._index_of: Dict[int, int] = {}
        self._handles = []
        self.h2d_bytes = 0  # bytes copied in / written back so far
        self.d2h_bytes = 0
        self.closed = False  # close() ended it
        self.activations = None  # the ActivationStream started with it (offload_activations=True)
        cuda = [p.device for m in layers for p in m.parameters() if p.is_cuda]
        self.copy_stream = torch.cuda.Stream(cuda[0]) if cuda else None  # copies in
        self.home_stream = torch.cuda.Stream(cuda[0]) if cuda else None  # write-backs
        for i, module in enumerate(layers):
            layer = _Layer(i, module, pin=bool(cuda))
            self.layers.append(layer)
            self._index_of[id(module)] = i
            for p in layer.params:
                self._layer_of[id(p)] = layer
                self._handles.append(p.register_post_accumulate_grad_hook(self._gradient_ready))
            self._handles += [module.register_forward_pre_hook(self._before_forward),
                              module.register_forward_hook(self._after_forward)]
            self._handles += [module._register_state_dict_hook(_host_state_dict(layer)),
                              module.register_load_state_dict_pre_hook(self._before_load),
                              module.register_load_state_dict_post_hook(self._after_load)]
            layer.write_back(self.home_stream)  # (those offload_weights() moved have nothing to write)
            layer.free()
        release.add_update_listener(self._updated)

    # -- the visits --------------------------------------------------------------------------------
    def _bring(self, layer: _Layer) -> None:
        if not layer.resident:
            layer.load(self.copy_stream)
            self.h2d_bytes += layer.bytes

    def _before_forward(self, module, args) -> None:
        """This layer, and the ``prefetch`` layers after it (before it in a recompute: backward runs
        the layers in reverse)."""
        i, backward = self._index_of[id(module)], in_backward()
        if backward:  # a recompute
            self._before_backward(i)
            return
        layer = self.layers[i]
        for each in [layer] + self.layers[i + 1:i + 1 + self.prefetch]:
            self._bring(each)
        layer.ready()
        saves = torch.is_grad_enabled() and not under_checkpoint() and not checkpoints_itself(module)
        turn = module.training and stays_over_the_turn(i, len(self.layers), self.prefetch)
        if saves or turn:
            # a forward that saves these weights for backward, or a training forward's turn to
            # backward is near: they stay until their update, or until their gradients are in
            self._stay(layer)

    def _after_forward(self, module, args, output) -> None:
        i = self._index_of[id(module)]
        out = first_grad_output(output) if torch.is_grad_enabled() and not in_backward() else None
        if out is not None:  # the layer's backward (and recompute) begins once this has its gradient
            out.register_hook(lambda grad, i=i: self._before_backward(i))
        if not self.layers[i].keep:
            self.layers[i].free()

    def _before_backward(self, i: int) -> None:
        """Layer ``i``'s recompute or backward is next: it, and the ``prefetch`` layers before it
        (backward runs the layers in reverse), come in and stay until updated. Reached from the
        recompute's forward pre-hook, or from the gradient of the layer's output where the
        recompute runs no hook (:func:`checkpoints_itself`); whichever comes first does it."""
        layer = self.layers[i]
        for each in [layer] + self.layers[max(0, i - self.prefetch):i][::-1]:
            self._bring(each)
        layer.ready()
        if not layer.keep:
            self._stay(layer)

    @staticmethod
    def _stay(layer: _Layer) -> None:
        layer.keep = True
        layer.waiting = {id(p) for p in layer.params if p.requires_grad}

    def _gradient_ready(self, param) -> None:
        """On a backward that does not end in a step, a layer goes once its gradients are all in."""
        if self.release.release and self.boundary.will_step:
            return  # the update listener frees it
        self._done(self._layer_of[id(param)], param, write=False)

    def _updated(self, params) -> None:
        """Gradient release updated ``params``: write back and free each layer that is complete."""
        for p in params:
            layer = self._layer_of.get(id(p))
            if layer is not None:
                self._done(layer, p, write=True)

    def _done(self, layer: _Layer, param, write: bool) -> None:
        layer.waiting.discard(id(param))
        if layer.waiting or not layer.resident:
            return
        if write:
            layer.write_back(self.home_stream)
            self.d2h_bytes += layer.bytes
        if layer.index > self.prefetch:  # the first layers wait on the device for the next forward
            layer.free()
        else:
            layer.keep = False

    def _before_load(self, module, *args) -> None:
        """``load_state_dict`` writes into the device copy: bring the layer first."""
        layer = self.layers[self._index_of[id(module)]]
        self._bring(layer)
        layer.ready()

    def _after_load(self, module, incompatible_keys) -> None:
        """... then write the loaded weights home and free the layer again."""
        layer = self.layers[self._index_of[id(module)]]
        layer.write_back(self.home_stream)
        if not layer.keep and layer.index > self.prefetch:
            layer.free()

    # -- outside the visits ------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self):
        """Every streamed layer on the device for the block (reads and in-place writes of the
        weights land in the host copies when it ends)."""
        was = [layer.resident for layer in self.layers]
        for layer in self.layers:
            self._bring(layer)
            layer.ready()
        try:
            yield
        finally:
            for layer, resident in zip(self.layers, was):
                if not resident and not layer.keep:
                    layer.write_back(self.home_stream)
                    layer.free()

    def host_bytes(self) -> int:
        """Bytes of the host copies."""
        return sum(layer.bytes for layer in self.layers)

    def device_bytes(self) -> int:
        """Bytes of streamed weights on the device now."""
        return sum(layer.bytes for layer in self.layers if layer.resident)

    def close(self) -> None:
        """Bring every layer back to the device for good and remove the hooks."""
        for layer in self.layers:
            self._bring(layer)
            layer.ready()
            layer.keep = False
        for h in self._handles:
            h.remove()
        self._handles = []
        self.release.remove_update_listener(self._updated)
        if self.activations is not None:
            self.activations.close()
        self.closed = True


def _host_state_dict(layer: _Layer):
    """A state-dict hook that puts a streamed layer's host copies where its freed weights would be."""
    def hook(module, state_dict, prefix, local_metadata):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # pinned write-backs land before the host copies are read
        names = {id(p): name for name, p in module.named_parameters()}
        for p, h in zip(layer.params, layer.host):
            key = prefix + names[id(p)]
            if key in state_dict and not layer.resident:
                state_dict[key] = h
        return state_dict
    return hook


def start(model: nn.Module, release, boundary, owned: set, layers: Optional[Sequence[nn.Module]] = None,
          prefetch: int = 1, offload_activations: bool = False) -> WeightStream:
    """Stream the weights of ``model``'s decoder layers (or ``layers``) for an optimizer whose
    gradient release is ``release`` and whose parameters have the ids ``owned``; ``release.stream`` keeps
    it, one at a time (see :meth:`~optstate_core.optimizer.VirtualOptimizer.stream_weights`)."""
    if not release.release:
        raise ValueError("stream_weights: the optimizer must be wrapped with release_gradients=True or "
                         "stream_weights=True (a layer's weights are updated in backward, while on the device)")
    if release.stream is not None and not release.stream.closed:
        raise RuntimeError("stream_weights: this optimizer streams its model's weights already (opt.weight_stream); "
                           "close() that stream first")
    layers = checked_layers("stream_weights", model, layers, prefetch)
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.device.type == "meta":
                raise ValueError(f"stream_weights: layers[{i}].{name} is on the meta device; materialise it first")
            if id(p) not in owned and p.requires_grad:
                raise ValueError(f"stream_weights: layers[{i}].{name} is not a parameter of the optimizer")
    if not isinstance(offload_activations, bool):
        raise ValueError(f"stream_weights: offload_activations must be True or False, got {offload_activations!r}")
    stream = release.stream = WeightStream(layers, release, boundary, prefetch)
    if offload_activations:  # the layer inputs checkpointing keeps, through the same layers' hooks
        stream.activations = ActivationStream(layers, prefetch, model)
    log.info("optstate: streaming the weights of %d layers (%.2f GiB in host memory)", len(layers),
             stream.host_bytes() / 2**30)
    return stream
