"""Every ``OPTSTATE_*`` environment setting in one table.

``optstate env`` prints it with the values set in the environment now; ``docs/environment.md``
holds the same table (``optstate env --markdown`` writes it). ``tests/test_environment.py`` checks
that every ``OPTSTATE_*`` name in the code is here and in the doc, and that the defaults are the
code's. The optstate knobs are the defaults of wrap() options (:class:`~optstate_core.tuning.Tuning`,
and ``fast_math``). Kinds: ``user``, an implementation choice a user may want to make; ``diagnosis``, a switch
to isolate or tune one mechanism while measuring (the defaults are the measured choices).
"""
from __future__ import annotations

import os
from typing import NamedTuple


class Knob(NamedTuple):
    name: str
    default: str  # as the environment would spell it
    kind: str  # "user" or "diagnosis"
    read: str  # when it is read
    where: str  # the file that reads it
    what: str


_TUNING = "optstate_core/tuning.py"  # Tuning.from_env(): each knob below is the default of a wrap() option
_PER_KIND = " (every state kind's value; defaults by kind: int8 {}, int4 {}, others {})"

KNOBS = (
    Knob("OPTSTATE_CPU_COMPILE", "auto", "user", "wrap()", _TUNING,
         "the default of `tuning.cpu_compile`: when the CPU fast path compiles a shape class with torch.compile: "
         "`0` never, `1` at its first call, `auto` once its eager time reaches `OPTSTATE_CPU_COMPILE_AFTER`"),
    Knob("OPTSTATE_CPU_COMPILE_AFTER", "10", "user", "wrap()", _TUNING,
         "the default of `tuning.cpu_compile_after_s`: eager seconds per class before `auto` compiles it "
         "(a number >= 0)"),
    Knob("OPTSTATE_CPU_BATCH", "1", "user", "wrap()", _TUNING,
         "the default of `tuning.cpu_batch`: row slices one compiled CPU call steps: more shares a call's "
         "fixed cost among small parameters, at a longer compile"),
    Knob("OPTSTATE_CPU_FAST", "1", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.cpu_fast_path`: `0`: no CPU fast path, every CPU update through the tiled "
         "reference path"),
    Knob("OPTSTATE_STAGE_AHEAD", "2", "user", "wrap(); `optstate plan`", _TUNING,
         "the default of `tuning.stage_ahead`: release batches of host state staged on the GPU ahead of their "
         "update (`0`: none, each streams through the ring); more costs GPU memory"),
    Knob("OPTSTATE_PINNED_SLAB_BYTES", "268435456", "user", "wrap()", _TUNING,
         "the default of `tuning.pinned_slab_bytes`: the largest shared pinned slab of host-tier state; `0`: "
         "a pinned allocation per state"),
    Knob("OPTSTATE_PIN_AHEAD", "1", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.pin_ahead`: `0`: the first step pins host-tier state itself instead of a "
         "thread pinning it from wrap()"),
    Knob("OPTSTATE_COMPILE_AHEAD", "1", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.compile_ahead`: `0`: no Triton kernel variants compiled on a thread ahead of "
         "their first launch"),
    Knob("OPTSTATE_SLAB_MB", "64", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.prefetch_slab_bytes` (in MiB here): queued state that starts a backward-time "
         "prefetch upload (a slab)"),
    Knob("OPTSTATE_FAST_MATH", "1", "diagnosis", "wrap()", _TUNING,
         "the default of the `fast_math` option: anything but `1`: correctly rounded square root and "
         "division in the fused Adam update instead of the hardware approximations (a few ulp)"),
    Knob("OPTSTATE_NBLK", "4/1/2", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.launch_shapes`' NBLK: 256-element tiles per program of the fused kernels"
         + _PER_KIND.format(4, 1, 2)),
    Knob("OPTSTATE_NUM_WARPS", "2/1/2", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.launch_shapes`' num_warps: warps per program of the fused kernels"
         + _PER_KIND.format(2, 1, 2)),
    Knob("OPTSTATE_ITERS", "2/16/1", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.launch_shapes`' ITERS: tiles each Adam program loops over"
         + _PER_KIND.format(2, 16, 1)),
    Knob("OPTSTATE_MAXNREG", "0/64/0", "diagnosis", "wrap()", _TUNING,
         "the default of `tuning.launch_shapes`' maxnreg: register cap of the Adam kernel, `0`: none"
         + _PER_KIND.format(0, 64, 0)),
    Knob("OPTSTATE_HF_AUTOREGISTER", "1", "user", "interpreter start", "integrations/optstate_hf_names/__init__.py",
         "`0` (or `false`, `no`, `off`): the `.pth` hook of an installed optstate stays off, so "
         "`optim=\"optstate_...\"` is valid only after `import optstate_hf` (docs/hf.md)"),
    Knob("OPTSTATE_TORCH", "torch==2.13.0", "user", "install", "quickstart.py, .ci/run",
         "the torch requirement quickstart installs into a new virtualenv"),
    Knob("OPTSTATE_VENV", "./.venv", "user", "install", "quickstart.py, .ci/run",
         "the virtualenv quickstart creates and uses (CI: `./.ci-venv`)"),
)

#: ``OPTSTATE_*`` names in the code that are not environment settings
NOT_SETTINGS = {"OPTSTATE_TRIAL": "the marker of a trial's result line (apps/trial.py)"}


def markdown() -> str:
    """The table of docs/environment.md."""
    rows = ["| name | default | kind | read | where | what it changes |", "|---|---|---|---|---|---|"]
    rows += [f"| `{k.name}` | `{k.default}` | {k.kind} | {k.read} | `{k.where}` | {k.what} |" for k in KNOBS]
    return "\n".join(rows) + "\n"


def listing(environ=None) -> str:
    """Each knob with its value in ``environ`` (default: this process's), its default and kind."""
    environ = os.environ if environ is None else environ
    rows = [("name", "value", "default", "kind", "read")]
    rows += [(k.name, environ.get(k.name, "-"), k.default, k.kind, k.read) for k in KNOBS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines) + "\n(- : not set, the default applies; docs/environment.md says what each changes)\n"


def add_arguments(p) -> None:
    p.add_argument("--markdown", action="store_true", help="print the table of docs/environment.md instead")


def run(args) -> int:
    print(markdown() if args.markdown else listing(), end="")
    return 0
