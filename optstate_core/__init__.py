"""optstate: optimizer-state virtualization for PyTorch (the public API, nothing else)."""
from .state.checkpoint import to_plain_state_dict
from .state.codecs import (BF16Codec, Codec, EncodedTensor, FP16Codec, FP32Codec, IdentityCodec, Int4Codec, Int8Codec,
                           Int8MomentumCodec, Minifloat8Codec, get_codec)
from .state.master_weights import cast_model, master_state_dict
from .state.units import parse_bytes
from .schedule.activation_stream import ActivationStream, offload_activations
from .schedule.weight_stream import WeightStream, offload_weights
from .optimizer import VirtualOptimizer
from .options import WrapOptions
from .tuning import Tuning
from .policy import MOMENT_CODECS, AdaptiveWarmupPolicy, ParamInfo, Policy, WarmupPolicy
from .presets import (PRESETS, OptStateAdamW, auto_wrap, stream_weights, make_low_memory_policy, make_policy, unwrap, wrap,
                      wrap_low_memory_adamw, wrap_max_compression_adamw)

OptimizerWrapper = VirtualOptimizer  # torch-optstate's name
__version__ = "0.1.0"

__all__ = [
    "wrap", "unwrap", "stream_weights", "offload_weights", "WeightStream", "offload_activations", "ActivationStream", "auto_wrap", "wrap_low_memory_adamw",
    "wrap_max_compression_adamw", "make_policy", "make_low_memory_policy", "PRESETS", "OptStateAdamW",
    "VirtualOptimizer", "WrapOptions", "Tuning", "OptimizerWrapper", "Policy", "WarmupPolicy",
    "AdaptiveWarmupPolicy", "ParamInfo", "Codec", "EncodedTensor", "FP32Codec", "IdentityCodec", "FP16Codec",
    "BF16Codec", "Int8Codec", "Minifloat8Codec", "Int8MomentumCodec", "Int4Codec", "get_codec", "to_plain_state_dict", "cast_model", "master_state_dict", "MOMENT_CODECS", "parse_bytes",
    "__version__",
]
