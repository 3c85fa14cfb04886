"""Worker of test_hf_fsdp2.py: the HF Trainer with FSDP2 (``fsdp="full_shard"``, ``fsdp_config``
version 2) and ``optim="optstate_adamw_8bit"`` on 2 processes, started by ``accelerate launch``.

``python hf_fsdp2_worker.py PHASE OUT_DIR [cuda]``: PHASE ``full`` trains 6 steps (accumulation 2,
``max_grad_norm``), saving a sharded checkpoint at step 3; ``resume`` continues from it; ``release``
trains as ``full`` with gradient release (and counts what backward released); ``release_auto`` as
``release`` without passing ``OptStateCallback`` (the Trainer gets it from the optim name). Each rank
writes OUT_DIR/<phase>_rank<r>.pt (full parameters, its local optimizer state, state bytes, grad norms).

On CPU Accelerate ignores the FSDP plugin (it picks FSDP only for accelerator devices, see
docs/distributed.md), so there the Trainer's Accelerator state is switched to FSDP right after the
Trainer builds it; the Trainer's own FSDP2 prepare, clipping and checkpointing then run on gloo.
With ``cuda`` (2 GPUs, NCCL) nothing is switched.
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "integrations"), HERE, os.path.dirname(HERE)]

import optstate_hf  # noqa: E402
from hf_testlib import tiny_dataset, tiny_model, training_args  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from job_exit import end_rank  # noqa: E402
from helpers import local_tensors  # noqa: E402

SAVE_AT, STEPS = 3, 6


def fsdp_overrides(device: str) -> dict:
    """What the test and the single-process reference share, plus the FSDP2 settings."""
    return dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS, max_grad_norm=0.5,
                optim="optstate_adamw_8bit", optim_args="min_int8_elements=256", learning_rate=3e-3,
                use_cpu=device == "cpu", fsdp="full_shard",
                fsdp_config={"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                             "transformer_layer_cls_to_wrap": ["GPT2Block"]})


class CpuFsdpTrainer(Trainer):
    """The Trainer with its Accelerator switched to FSDP after construction (CPU only)."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        assert self.accelerator.distributed_type == DistributedType.MULTI_CPU, self.accelerator.distributed_type
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


class ReleaseCounter(TrainerCallback):
    """Phase ``release``: before each optimizer step, how many parameters backward released and how
    many gradients are left on the (sharded) parameters."""

    def __init__(self):
        self.released, self.left = [], []

    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        def count(opt, *unused):
            self.released.append(opt._engine.clip_release.released)
            self.left.append(sum(p.grad is not None for g in opt.param_groups for p in g["params"]))
        optstate_hf.find_virtual_optimizer(optimizer).register_step_pre_hook(count)


def main(phase: str, out_dir: str, device: str = "cpu") -> None:
    cls = CpuFsdpTrainer if device == "cpu" else Trainer
    overrides = fsdp_overrides(device)
    counter = ReleaseCounter()
    callbacks = [] if phase == "release_auto" else [optstate_hf.OptStateCallback()]
    if phase in ("release", "release_auto"):  # gradient release: FSDP2's prepare swaps the parameters after wrap()
        overrides["optim_args"] += ",release_gradients=true"
        callbacks.append(counter)
    args = training_args(out_dir, save_strategy="steps", save_steps=SAVE_AT, **overrides)
    trainer = cls(model=tiny_model(), args=args, train_dataset=tiny_dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_AT}") if phase == "resume" else None)
    rank = trainer.accelerator.process_index
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    model = trainer.model_wrapped if hasattr(trainer, "model_wrapped") else trainer.model
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().reshape(-1)
                        for p in model.parameters()])
    torch.save({"params": params, "state": local_tensors(opt.state_dict()), "step_count": opt.step_count,
                "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
                "state_bytes": opt.memory_report()["state_bytes"],
                "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                "released": counter.released, "grads_left": counter.left,
                "n_params": sum(1 for _ in model.parameters()),
                "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks]},
               os.path.join(out_dir, f"{phase}_rank{rank}.pt"))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_rank()  # job_exit.py: no interpreter teardown after gloo
