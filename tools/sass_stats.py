"""Static SASS statistics of the fused Adam kernel as the presets launch it, compiled ahead of
time for a CUDA target without a GPU: python tools/sass_stats.py [--arch 90] [--presets 4bit,8bit]
[--shape 2x2] [--dump DIR].

Counts are static (instructions in the compiled program, not executed instructions, not
timings): the whole kernel; its main body (without the subroutines that correctly rounded
division and square root call for special operands) and that per element of a program's tiles
(instructions x threads / elements); in the main body: shared-memory traffic (LDS/STS/BAR:
layout conversions and cross-warp reductions), global loads/stores, shuffles, MUFU, branches.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from optstate_core.step.kernels.adam import adam_kernel  # noqa: E402

SCALARS = {"STEP": "*i64", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "ln_beta1": "fp32",
           "ln_beta2": "fp32", "one_minus_beta1": "fp32", "one_minus_beta2": "fp32", "eps": "fp32",
           "weight_decay": "fp32", "lr_ptr": "*fp32", "CORR": "*fp32", "m_levels": "*fp32", "m_mids": "*fp32", "m_lut": "*fp32",
           "v_levels": "*fp32", "v_mids": "*fp32", "v_lut": "*fp32", "FLAGS": "*i32", "PROG_START": "*i32",
           "N_TENSORS": "i32", "C": "i32"}
# the constexprs fused_launch.py passes for AdamW with fp32 parameters, aligned tensors, the
# NaN/inf check and fast math on (the defaults), per preset
COMMON = dict(TPOW2=256, IDX32=True, P_KIND=0, P_SR=False, AMSGRAD=False, DECOUPLED=True, MAXIMIZE=False,
              FIRST=False, CHECK_FINITE=True, LR_TENSOR=False, ALIGNED=True, FAST_MATH=True, ITERS=1, MASTER=0,
              TORCH_FUSED=False)
PRESETS = {
    "4bit": dict(M_KIND=3, V_KIND=3, M_SR=False, V_SR=True, M_LEVELS=15, V_LEVELS=16, M_INV_POW=0.5,
                 V_INV_POW=0.25, M_POW=2, V_POW=4),
    "8bit": dict(M_KIND=2, V_KIND=2, M_SR=True, V_SR=True, M_LEVELS=2, V_LEVELS=2, M_INV_POW=0.5, V_INV_POW=0.5,
                 M_POW=0, V_POW=0),
    "fp32": dict(M_KIND=0, V_KIND=0, M_SR=False, V_SR=False, M_LEVELS=2, V_LEVELS=2, M_INV_POW=0.5,
                 V_INV_POW=0.5, M_POW=0, V_POW=0),
    "bf16": dict(M_KIND=1, V_KIND=1, M_SR=False, V_SR=False, M_LEVELS=2, V_LEVELS=2, M_INV_POW=0.5,
                 V_INV_POW=0.5, M_POW=0, V_POW=0),
}
GROUPS = {
    "shared (LDS/STS)": re.compile(r"^(LDS|STS|LDSM)\b"),
    "barriers (BAR)": re.compile(r"^BAR\b"),
    "global loads (LDG)": re.compile(r"^LDG\b"),
    "global stores (STG)": re.compile(r"^STG\b"),
    "shuffles (SHFL)": re.compile(r"^SHFL\b"),
    "atomics/reductions (ATOM/RED)": re.compile(r"^(ATOM|ATOMG|RED|REDG)\b"),
    "MUFU (sqrt/rcp/ex2)": re.compile(r"^MUFU\b"),
    "branches (BRA)": re.compile(r"^BRA\b"),
}


def tool(name):
    return os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", name)


def compile_adam(arch: int, constexprs: dict, num_warps: int):
    names = list(adam_kernel.arg_names)
    sig = {n: ("constexpr" if n in constexprs else SCALARS.get(n, "*i64")) for n in names}
    src = triton.compiler.ASTSource(fn=adam_kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def sass(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        if "/*0000*/" not in out:
            out = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    return out


def opcodes(text: str):
    """(address, opcode, operands) of the SASS instructions (predicate and modifiers stripped;
    NOPs dropped)."""
    ops = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)*([^;]*)", line)
        if m and m.group(3) != "NOP":
            ops.append((int(m.group(1), 16), m.group(3), m.group(5)))
    return ops


def main_body(ops):
    """The instructions before the first called subroutine (the slow paths of correctly rounded
    division and square root, taken only for special operands): the code each element runs."""
    targets = [int(t, 16) for _, op, args in ops if op == "CALL" for t in re.findall(r"0x([0-9a-f]+)", args)]
    end = min(targets) if targets else float("inf")
    return [op for addr, op, _ in ops if addr < end]


def registers(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", out, re.S)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (0, 0, 0)


def stats(preset: str, nblk: int, warps: int, arch: int, extra=None):
    const = {**COMMON, **PRESETS[preset], "NBLK": nblk, **(extra or {})}
    kernel = compile_adam(arch, const, warps)
    text = sass(kernel)
    every = opcodes(text)
    ops = main_body(every)
    per_elem = len(ops) * 32 * warps / (nblk * 256)
    counts = collections.Counter(ops)
    groups = {g: sum(c for op, c in counts.items() if rx.match(op)) for g, rx in GROUPS.items()}
    return dict(total=len(every), main=len(ops), per_elem=per_elem, groups=groups, counts=counts,
                regs=registers(kernel), sass=text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--presets", default="4bit,8bit")
    ap.add_argument("--shape", default="2x2", help="tiles x warps (fused_launch.NBLK x NUM_WARPS)")
    ap.add_argument("--dump", default=None, help="write each kernel's SASS to DIR/adam_<preset>.sass")
    ap.add_argument("--top", type=int, default=0, help="also list the N most frequent opcodes")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a constexpr (e.g. CHECK_FINITE=0, ITERS=2); repeatable")
    args = ap.parse_args()
    nblk, warps = (int(x) for x in args.shape.split("x"))
    print(f"static SASS counts (not timings), sm_{args.arch}, triton {triton.__version__}, "
          f"{nblk} tiles x {warps} warps per program ({nblk * 256} elements, {32 * warps} threads)")
    extra = {k: int(v) for k, v in (kv.split("=") for kv in args.set)}
    rows = [(p, stats(p, nblk, warps, args.arch, extra)) for p in args.presets.split(",")]
    head = ["preset", "SASS instrs (all)", "main body", "main per element", "regs"] + list(GROUPS)
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for p, s in rows:
        cells = [p, str(s["total"]), str(s["main"]), f"{s['per_elem']:.1f}", str(s["regs"][0])] + \
            [str(v) for v in s["groups"].values()]
        print("| " + " | ".join(cells) + " |")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"adam_{p}.sass"), "w") as f:
                f.write(s["sass"])
    for p, s in rows:
        if args.top:  # main body
            print(p, ", ".join(f"{op} {c}" for op, c in s["counts"].most_common(args.top)))


if __name__ == "__main__":
    main()
