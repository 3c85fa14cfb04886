"""State codecs: one small file per format, all behind the :class:`Codec` protocol."""
from __future__ import annotations

from typing import Union

from .base import Codec, EncodedTensor, slab_shape
from .kinds import StateKind
from .correction import Correction8Codec, Correction16Codec
from .float import BF16Codec, FP16Codec, FP32Codec, IdentityCodec
from .fp24 import Float24Codec
from .int4 import Int4Codec
from .int8 import Int8Codec, Int8MomentumCodec, Minifloat8Codec

CODECS = {
    "fp32": FP32Codec, "bf16": BF16Codec, "fp16": FP16Codec, "int8": Minifloat8Codec, "int4": Int4Codec,
    "corr16": Correction16Codec, "corr8": Correction8Codec, "fp24": Float24Codec,
}
ALIASES = {"none": "fp32", "identity": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "8bit": "int8", "4bit": "int4"}


def get_codec(spec: Union[str, Codec, None], **options) -> Codec:
    """A codec from an instance or a name (``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4``, or
    an alias such as ``8bit`` / ``4bit``); ``options`` go to the codec's constructor."""
    if spec is None:
        return FP32Codec()
    if isinstance(spec, Codec):
        if options:
            raise ValueError("codec options can only be given with a codec name")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"codec must be a name or a Codec instance, got {type(spec).__name__}")
    name = ALIASES.get(spec.lower(), spec.lower())
    if name not in CODECS:
        valid = ", ".join(sorted(set(CODECS) | set(ALIASES)))
        raise ValueError(f"unknown codec {spec!r}; valid names: {valid}")
    cls = CODECS[name]
    if cls is FP32Codec:
        return FP32Codec()
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"invalid options for codec {name!r}: {e}") from None


def codec_from_config(config: dict) -> Codec:
    """Rebuild a codec from :meth:`Codec.config` (used when loading checkpoints)."""
    config = dict(config)
    name = config.pop("name")
    return get_codec(name, **config)


__all__ = ["Codec", "EncodedTensor", "slab_shape", "FP32Codec", "IdentityCodec", "BF16Codec", "FP16Codec",
           "Int8Codec", "Minifloat8Codec", "Int8MomentumCodec", "Int4Codec", "Float24Codec", "Correction16Codec", "Correction8Codec", "StateKind", "get_codec", "codec_from_config", "CODECS"]
