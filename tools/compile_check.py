"""Compile the kernels ahead of time for a CUDA target without a GPU (catches compile errors
before spending device time): python tools/compile_check.py [--arch 90]."""
import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget

from optstate_core.step.kernels.adam import adam_kernel, advance_steps_kernel, bias_corrections_kernel
from optstate_core.step.kernels.lion import lion_kernel
from optstate_core.step.kernels.schedule_free import schedule_free_adamw_kernel
from optstate_core.step.kernels.sgd import sgd_kernel

parser = argparse.ArgumentParser()
parser.add_argument("--arch", type=int, default=90)
parser.add_argument("--all", action="store_true", help="every constexpr combination (slow)")
args = parser.parse_args()
target = GPUTarget("cuda", args.arch, 32)
PTR = "*i64"


def compile_kernel(fn, signature, constexprs, num_warps=4):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=target, options={"num_warps": num_warps})


def resources(kernel) -> str:
    """Registers / spills from cuobjdump on the cubin (no GPU needed)."""
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", out, re.S)
    return f"{m.group(1)} regs, stack {m.group(2)}, local {m.group(4)}" if m else out.strip()[:200]


def sig(fn, types):
    names = [a for a in fn.arg_names]
    return {n: types.get(n, PTR) for n in names}


adam_scalars = {"STEP": "*i64", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "ln_beta1": "fp32", "ln_beta2": "fp32",
                "one_minus_beta1": "fp32", "one_minus_beta2": "fp32",
                "eps": "fp32", "weight_decay": "fp32", "lr_ptr": "*fp32", "CORR": "*fp32", "m_levels": "*fp32", "m_mids": "*fp32",
                "m_lut": "*fp32", "v_levels": "*fp32", "v_mids": "*fp32", "v_lut": "*fp32", "FLAGS": "*i32",
                "PROG_START": "*i32", "N_TENSORS": "i32", "C": "i32"}
n = 0
kinds = [(2, 2), (3, 3), (1, 1), (2, 0), (3, 2)]
for (mk, vk), aligned, first, check, fast in itertools.product(kinds, [True, False], [False, True], [True, False],
                                                                [False, True]):
    if not args.all and (first or not check) and (mk, vk) != (2, 2):
        continue
    const = dict(TPOW2=256, IDX32=aligned, P_KIND=0, M_KIND=mk, V_KIND=vk, M_SR=mk == 2, V_SR=mk in (2, 3), P_SR=False, M_LEVELS=15, V_LEVELS=16,
                 M_INV_POW=0.5, V_INV_POW=0.25,
                 AMSGRAD=False, DECOUPLED=True, MAXIMIZE=False, FIRST=first, CHECK_FINITE=check, LR_TENSOR=False,
                 NBLK=4, ALIGNED=aligned, FAST_MATH=fast, M_POW=2 if mk == 3 else 0, V_POW=4 if vk == 3 else 0, ITERS=4, MASTER=0)
    # per gradient dtype (bf16 with master weights): each rounds gradient release's clipping its own way
    for p_kind in (0, 1, 2) if (mk, vk, first) == (2, 2, False) else (0,):
        const.update(P_KIND=p_kind, MASTER=8 if p_kind == 1 else 0)
        s = sig(adam_kernel, dict(adam_scalars, C=PTR if const["MASTER"] else "i32"))
        for c in const:
            s[c] = "constexpr"
        k = compile_kernel(adam_kernel, s, const)
        n += 1
        print(f"adam m={mk} v={vk} aligned={aligned} first={first} check={check} fast={fast} p_kind={p_kind}: "
              f"{resources(k)}")
compile_kernel(advance_steps_kernel, sig(advance_steps_kernel, {}), {})
for lr_tensor in (False, True):
    s = sig(bias_corrections_kernel, {"CORR": "*fp32", "lr_ptr": "*fp32", "lr": "fp32", "ln_beta1": "fp32",
                                      "ln_beta2": "fp32"})
    const = {"LR_TENSOR": lr_tensor, "ADVANCE": True, "STEP_ONLY": False}
    s.update({k: "constexpr" for k in const})
    compile_kernel(bias_corrections_kernel, s, const)
for aligned in (True, False):
    s = sig(sgd_kernel, {"STEP": "*i64", "lr": "fp32", "momentum": "fp32", "dampening": "fp32", "weight_decay": "fp32",
                         "lr_ptr": "*fp32", "m_levels": "*fp32", "m_mids": "*fp32", "m_lut": "*fp32",
                         "FLAGS": "*i32", "PROG_START": "*i32", "N_TENSORS": "i32"})
    c = dict(TPOW2=256, P_KIND=0, M_KIND=2, M_SR=False, M_LEVELS=2, M_INV_POW=0.5, NESTEROV=True, MAXIMIZE=False, FIRST=False,
             CHECK_FINITE=True, LR_TENSOR=False, NBLK=4, ALIGNED=aligned, M_POW=0)
    s.update({k: "constexpr" for k in c})
    k = compile_kernel(sgd_kernel, s, c)
    print(f"sgd aligned={aligned}: {resources(k)}")
one_state = {"STEP": "*i64", "FLAGS": "*i32", "PROG_START": "*i32", "N_TENSORS": "i32", "m_levels": "*fp32",
             "m_mids": "*fp32", "m_lut": "*fp32", "v_levels": "*fp32", "v_mids": "*fp32", "v_lut": "*fp32"}
for m_kind, first, p_kind in ((2, False, 0), (3, False, 0), (1, True, 1), (2, True, 0)):
    s = sig(lion_kernel, dict(one_state, **{k: "fp32" for k in ("decay", "lr", "beta1", "beta2", "one_minus_beta1",
                                                                "one_minus_beta2")}))
    c = dict(TPOW2=256, P_KIND=p_kind, M_KIND=m_kind, M_SR=m_kind == 2, M_LEVELS=15, M_INV_POW=0.5, FIRST=first,
             CHECK_FINITE=True, NBLK=4, ALIGNED=True, IDX32=True, M_POW=2 if m_kind == 3 else 0)
    s.update({k: "constexpr" for k in c})
    k = compile_kernel(lion_kernel, s, c, num_warps=2)
    n += 1
    print(f"lion m={m_kind} first={first} p_kind={p_kind}: {resources(k)}")
for z_kind, v_kind, first, small in ((0, 2, False, True), (4, 2, False, False), (4, 3, True, False), (1, 1, False, True)):
    s = sig(schedule_free_adamw_kernel, dict(one_state, **{k: "fp32" for k in (
        "lr", "ckp1", "y_coef", "bias_correction2", "eps", "beta2", "one_minus_beta2", "decay")}))
    c = dict(TPOW2=256, P_KIND=0, Z_KIND=z_kind, V_KIND=v_kind, V_SR=v_kind in (2, 3), V_LEVELS=16, V_INV_POW=0.25,
             DECAY=True, SMALL_WEIGHT=small, FIRST=first, CHECK_FINITE=True, NBLK=4, ALIGNED=True, IDX32=True,
             V_POW=4 if v_kind == 3 else 0)
    s.update({k: "constexpr" for k in c})
    k = compile_kernel(schedule_free_adamw_kernel, s, c, num_warps=2)
    n += 1
    print(f"schedule-free z={z_kind} v={v_kind} first={first}: {resources(k)}")
print(f"compiled {n + 5} kernels for sm_{args.arch}")
