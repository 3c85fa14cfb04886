"""Worker of test_accelerate_fsdp2.py: Accelerate's FSDP2 plugin on 2 CPU processes (gloo).

Trains an MLP sharded by ``prepare(model, wrap(AdamW))`` with gradient accumulation and
``accelerator.clip_grad_norm_``, saves with ``accelerator.save_state`` (sharded DCP checkpoint) half
way, continues (mode ``full``); mode ``resume`` builds a fresh model and optimizer, ``load_state`` and
continues from there. Rank 0 writes a JSON summary; a single-process run on all ranks' data is the
reference. ``python accelerate_fsdp2_worker.py MODE OUT_DIR [cuda]`` (cuda: 2 GPUs, NCCL).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "integrations"), os.path.dirname(HERE)]

from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

import optstate_accelerate as osa  # noqa: E402
import optstate_core as oc  # noqa: E402
from helpers import batch, flat_params, mlp  # noqa: E402
from job_exit import end_rank  # noqa: E402

ACCUM, WINDOWS, SAVE_AT, LR, CLIP = 2, 6, 3, 1e-2, 0.3


def build():
    model = mlp(0, width=128)
    return model, oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
                          oc.make_policy("8bit", min_int8_elements=256))


def data(rank, i):
    return batch(1000 + 100 * rank + i, n=16)


def train_windows(accelerator, model, optimizer, first, last, rank, norms):
    for i in range(ACCUM * first, ACCUM * last):
        x, y = (t.to(accelerator.device) for t in data(rank, i))
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()


def full_params(model):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).float().cpu()
                      for p in model.parameters()])


def main(mode, out_dir, device="cpu"):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=device == "cpu", gradient_accumulation_steps=ACCUM, fsdp_plugin=plugin)
    rank, world = accelerator.process_index, accelerator.num_processes
    assert world == 2
    if device == "cpu":
        assert torch.distributed.get_backend() == "gloo"
        switch_to_fsdp(accelerator, plugin)
    assert accelerator.is_fsdp2, accelerator.distributed_type
    run(accelerator, mode, out_dir, rank, world)


def switch_to_fsdp(accelerator, plugin):
    # Accelerate picks FSDP only for accelerator devices (AcceleratorState.__init__); on CPU it
    # stays MULTI_CPU and ignores the plugin. Switch the shared state to FSDP after construction,
    # so that prepare / clip_grad_norm_ / save_state / load_state take their FSDP2 code paths.
    # (AcceleratorState() copies PartialState's shared dict on every construction: set both.)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def run(accelerator, mode, out_dir, rank, world):
    if mode == "release":
        return run_release(accelerator, out_dir, rank, world)
    model, vopt = build()
    model, optimizer = accelerator.prepare(model, vopt)
    osa.attach(accelerator, optimizer)
    result = {"sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}
    ckpt_dir = os.path.join(out_dir, "ckpt")
    norms = []
    if mode == "full":
        train_windows(accelerator, model, optimizer, 0, SAVE_AT, rank, norms)
        accelerator.save_state(ckpt_dir)
    else:
        accelerator.load_state(ckpt_dir)
        result["loaded_step"] = vopt.step_count
    train_windows(accelerator, model, optimizer, SAVE_AT, WINDOWS, rank, norms)
    params = full_params(model)
    torch.save({"params": params, "step": vopt.step_count,
                "state": {k: getattr(v, "_local_tensor", v).cpu() for k, v in oc_tensors(vopt.state_dict())}},
               os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    gathered = accelerator.gather(torch.tensor([[vopt.memory_report()["state_bytes"], vopt.step_count]],
                                               dtype=torch.float64, device=accelerator.device)).cpu()  # NCCL: on the GPU
    result.update(state_bytes_per_rank=gathered[:, 0].tolist(), steps=gathered[:, 1].tolist(), norms=norms)

    if mode == "full":
        # one process: each window's gradient is the mean over ranks and micro-batches, clipped to CLIP
        ref_model, ref = build()
        ref_norms = []
        for w in range(WINDOWS):
            for r in range(world):
                for k in range(ACCUM):
                    x, y = data(r, w * ACCUM + k)
                    (F.cross_entropy(ref_model(x), y) / (ACCUM * world)).backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), CLIP)))
            ref.step()
            ref.zero_grad()
        result.update(state_bytes_single=ref.memory_report()["state_bytes"], ref_norms=ref_norms,
                      max_diff_from_reference=float((flat_params(ref_model) - params).abs().max()),
                      moved=float((params - flat_params(build()[0])).abs().max()))
    if accelerator.is_main_process:
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run_release(accelerator, out_dir, rank, world):
    """Gradient release under FSDP2's prepare, which swaps the parameters after wrap(): attach()
    moves the hooks to the DTensor shards, so every gradient is applied and freed in backward."""
    model = mlp(0, width=128)
    vopt = oc.wrap(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
                   oc.make_policy("8bit", min_int8_elements=256), release_gradients=True)
    model, optimizer = accelerator.prepare(model, vopt)
    osa.attach(accelerator, optimizer)
    released, left = [], []
    for i in range(ACCUM * WINDOWS):
        x, y = (t.to(accelerator.device) for t in data(rank, i))
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                released.append(vopt._engine.clip_release.released)
                left.append(sum(p.grad is not None for p in model.parameters()))
            optimizer.step()
            optimizer.zero_grad()
    params = full_params(model)
    result = {"params": len(list(model.parameters())), "released": released, "grads_left": left,
              "group_size": vopt._engine.clip_release.group.size(), "steps": vopt.step_count}
    if accelerator.is_main_process:
        ref_model = mlp(0, width=128)  # one process on all ranks' data, no release
        ref = oc.wrap(torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.01),
                      oc.make_policy("8bit", min_int8_elements=256))
        for w in range(WINDOWS):
            for r in range(world):
                for k in range(ACCUM):
                    x, y = data(r, w * ACCUM + k)
                    (F.cross_entropy(ref_model(x), y) / (ACCUM * world)).backward()
            ref.step()
            ref.zero_grad()
        result.update(max_diff_from_reference=float((flat_params(ref_model) - params).abs().max()),
                      moved=float((params - flat_params(mlp(0, width=128))).abs().max()))
        with open(os.path.join(out_dir, "release.json"), "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def oc_tensors(tree, prefix=""):
    """(path, tensor) for every tensor in a nested state dict."""
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in oc_tensors(v, f"{prefix}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [kv for i, v in enumerate(tree) for kv in oc_tensors(v, f"{prefix}/{i}")]
    return []


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_rank()  # job_exit.py: no interpreter teardown after gloo
