"""Lightning Fabric: ``fabric.setup(model, oc.wrap(opt))`` keeps a working VirtualOptimizer inside Fabric's
optimizer shell; accumulation under ``fabric.no_backward_sync`` with gradient release equals the run
without release bit for bit when ``set_step_boundary`` marks the windows (and a forgotten mark raises);
``fabric.save``/``fabric.load`` resume a 2-process DDP run bit for bit (fabric_ddp_job.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
import lightning as L  # noqa: E402

import optstate_core as oc  # noqa: E402
from lightning_helpers import N_IN, N_OUT, regression_data  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ACCUMULATE = 2


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(N_IN, 64), torch.nn.GELU(), torch.nn.Linear(64, N_OUT))


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def batches(n_micro: int, batch: int = 8):
    x, y = regression_data(n=n_micro * batch).tensors
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n_micro * batch, batch)]


def same(a, b) -> bool:
    """Nested state_dicts equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def fabric_loop(fabric, model, opt, data, accumulate=ACCUMULATE, mark=True) -> None:
    """What a Fabric user writes for accumulation (docs/lightning.md#fabric)."""
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accumulate == 0
        if mark:
            opt.set_step_boundary(last)
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y) / accumulate)
        if last:
            opt.step()
            opt.zero_grad()


def test_the_virtual_optimizer_survives_fabric_setup():
    """Fabric's shell is a dynamic subclass of (its wrapper, VirtualOptimizer): the optimizer API goes to
    our wrapper, oc.unwrap finds the wrapper itself, and training (with fabric.clip_gradients and a
    scheduler built on the shell) equals the same loop without Fabric, also across a state_dict round trip."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    vopt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                   oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False))
    fmodel, fopt = fabric.setup(model, vopt)
    assert type(fopt).__name__ == "FabricVirtualOptimizer" and isinstance(fopt, oc.VirtualOptimizer)
    assert fopt.optimizer is vopt and oc.unwrap(fopt) is vopt
    assert fopt.param_groups is vopt.param_groups
    sched = torch.optim.lr_scheduler.StepLR(fopt, step_size=2, gamma=0.5)

    data = batches(8)
    for x, y in data[:4]:
        fopt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(fmodel(x), y))
        fabric.clip_gradients(fmodel, fopt, max_norm=0.5)
        fopt.step()
        sched.step()
    assert fopt.step_count == vopt.step_count == 4 and fopt.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    assert vopt.memory_report()["by_codec"].keys() == {"int8"}
    fopt.set_step_boundary(False)  # reaches the wrapper's engine through the shell
    assert not vopt.step_boundary
    fopt.set_step_boundary(True)

    saved = fopt.state_dict()  # Fabric's state_dict goes through its strategy to the wrapper's
    assert same(saved, vopt.state_dict()) and "optstate" in saved

    # the same four steps without Fabric, then both continue from a state_dict round trip
    plain_model = net()
    plain = oc.wrap(torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1),
                    oc.make_policy("8bit", min_int8_elements=0, whole_blocks_1d=False))
    plain_sched = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    for x, y in data[:4]:
        plain.zero_grad()
        torch.nn.functional.mse_loss(plain_model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5)
        plain.step()
        plain_sched.step()
    assert torch.equal(flat(model), flat(plain_model))
    fopt.load_state_dict(saved)
    plain.load_state_dict(plain.state_dict())
    for x, y in data[4:]:
        fopt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(fmodel(x), y))
        fopt.step()
        plain.zero_grad()
        torch.nn.functional.mse_loss(plain_model(x), y).backward()
        plain.step()
    assert vopt.step_count == 8 and torch.equal(flat(model), flat(plain_model))


def _accumulated_run(release: bool, mark: bool = True):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    opt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), "fp32",
                  release_gradients=release, max_grad_norm=0.5)
    model, opt = fabric.setup(model, opt)
    fabric_loop(fabric, model, opt, batches(4 * ACCUMULATE), mark=mark)
    return model, oc.unwrap(opt)


def test_accumulation_with_gradient_release_equals_it_without_release():
    """fp32 state, 2 micro-batches per step, clipping: gradients released (and clipped by their exact
    global norm) in the window's last backward give the parameters of step() after backward, bit for
    bit; the window's first backward leaves its gradients alone."""
    model, opt = _accumulated_run(release=False)
    released_model, released = _accumulated_run(release=True)
    assert released.release_gradients and not opt.release_gradients
    assert opt.step_count == released.step_count == 4
    assert all(p.grad is None for p in released_model.parameters())
    assert torch.equal(flat(model), flat(released_model))
    assert torch.equal(opt.last_grad_norm, released.last_grad_norm) and float(opt.last_grad_norm) > 0.5  # clipped


def test_release_without_boundary_marks_raises_on_the_second_backward():
    """Nothing tells the optimizer where windows end (Fabric has no signal for it): the second backward
    would update the parameters a second time. It raises instead, naming set_step_boundary."""
    with pytest.raises(RuntimeError, match=r"second backward before step\(\).*set_step_boundary\(False\)"):
        _accumulated_run(release=True, mark=False)


@pytest.mark.timeout(240)
def test_ddp_fabric_save_and_load_resume_bit_for_bit(tmp_path):
    """2 CPU processes (gloo), 2 micro-batches per step under no_backward_sync: 3 steps, fabric.save, 2
    more; a fresh Fabric, model and optimizer (other initial weights) fabric.load the checkpoint and train
    the same 2 steps: the same parameters bit for bit, on both ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "integrations")]))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    job = subprocess.run([sys.executable, str(HERE / "fabric_ddp_job.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=230)
    assert job.returncode == 0, job.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert r["wrapper"] == {"class": "FabricVirtualOptimizer", "is_virtual": True, "unwrapped_is_inner": True}
        assert r["step_count"] == 5 and r["bits_per_param"] < 20  # int8 moments (+ block scales)
        assert torch.equal(r["straight"], r["resumed"])
    assert torch.equal(ranks[0]["straight"], ranks[1]["straight"])  # DDP kept the ranks identical
