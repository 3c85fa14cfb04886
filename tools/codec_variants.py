"""Fidelity of codec variants that are not presets (yet): registers them as extra preset names,
then runs ``optstate bench --convergence`` with the remaining arguments.

    python tools/codec_variants.py --finetune --device cuda --seeds 3 --presets 4bit,4bit-sr,4bit-srv

Variants: ``4bit-sr`` (stochastic rounding of both 4-bit moments), ``4bit-srm`` / ``4bit-srv``
(of the momentum / second moment only), ``4bit-b64`` (64-element blocks).
"""
import sys

from optstate_core import presets
from optstate_core.apps import cli
from optstate_core.codecs import Int4Codec

VARIANTS = {
    "4bit-sr": dict(momentum_codec=Int4Codec(stochastic_rounding=True), variance_codec=Int4Codec(stochastic_rounding=True)),
    "4bit-srm": dict(momentum_codec=Int4Codec(stochastic_rounding=True), variance_codec="int4"),
    "4bit-srv": dict(momentum_codec="int4", variance_codec=Int4Codec(stochastic_rounding=True)),
    "4bit-b64": dict(momentum_codec=Int4Codec(block_size=64), variance_codec=Int4Codec(block_size=64)),
}

if __name__ == "__main__":
    for name, codecs in VARIANTS.items():
        presets.PRESETS[name] = dict(warmup_steps=0, **codecs)
    sys.exit(cli.main(["bench", "--convergence", *sys.argv[1:]]))
