"""tools/peers_gpu.py on the CPU (its runs need a GPU, FSDP2's one-rank NCCL group and DeepSpeed):
bad arguments refused by name; the FSDP2 peer's model, made from the meta device in host memory,
is build_model's (count, values, norms, rotary frequencies); the DeepSpeed config is the offload one."""
import os

import pytest
import torch

from helpers import load_tool

_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
tool = load_tool("peers_gpu")  # (sets the allocator setting stream_gpu.py sets: undone for the suite)
if _conf is None:
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def test_arguments_parse_with_the_loss_optional():
    args = tool.parse_args(["deepspeed-zero3-offload", "3b", "1", "2048", "6"])
    assert (args.peer, args.shape, args.micro_batch, args.seq, args.steps, args.loss) == \
        ("deepspeed-zero3-offload", "3b", 1, 2048, 6, "chunked")
    assert tool.parse_args(["fsdp2-cpuoffload", "tiny", "2", "16", "3", "plain"]).loss == "plain"


@pytest.mark.parametrize("argv, name", [
    (["fsdp2", "8b", "1", "2048", "6"], "PEER"),
    (["fsdp2-cpuoffload", "7b", "1", "2048", "6"], "SHAPE"),
    (["fsdp2-cpuoffload", "8b", "0", "2048", "6"], "MICRO_BATCH"),
    (["fsdp2-cpuoffload", "8b", "1", "x", "6"], "SEQ"),
    (["fsdp2-cpuoffload", "8b", "1", "2048", "2"], "STEPS"),
    (["fsdp2-cpuoffload", "8b", "1", "2048", "6", "liger"], "LOSS"),
])
def test_bad_arguments_are_refused_by_name(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        tool.parse_args(argv)
    assert e.value.code == 2 and f"argument {name}:" in capsys.readouterr().err


def test_the_meta_model_is_made_as_build_model_makes_it():
    """Drawn on the CPU (the GPU run draws on the GPU), in build_model's order from the same seed:
    the same tensors, N(0, 0.02) matrices, ones for norms, fp32 rotary frequencies."""
    from transformers import LlamaForCausalLM

    from optstate_core.apps.llama import NAMED_SHAPES, build_model

    shape = NAMED_SHAPES["tiny"]
    config = tool.hf_config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tool.materialise(model, config, "cpu", "cpu")
    reference = build_model(shape, "cpu")
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == shape.params
    for name, p in reference.named_parameters():
        assert torch.equal(params[name], p), name
        if p.dim() < 2:
            assert torch.all(p == 1), name
    embed = params["model.embed_tokens.weight"]
    assert abs(embed.mean().item()) < 1e-3 and abs(embed.std().item() - 0.02) < 1e-3
    for (name, buf), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        assert buf.dtype == torch.float32 and buf.device.type == "cpu" and torch.equal(buf, ref), name


def test_the_3b_shape_is_llama_3_2_3b_untied():
    from optstate_core.apps.llama import NAMED_SHAPES

    assert NAMED_SHAPES["3b"].params == 3_212_749_824 + 128256 * 3072  # Llama-3.2-3B's, plus its own lm_head


def test_the_deepspeed_config_offloads_parameters_and_optimizer():
    from optstate_core.apps.llama import NAMED_SHAPES

    ds = tool.ds_config(NAMED_SHAPES["8b"], 2)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and ds["bf16"]["enabled"] and ds["train_micro_batch_size_per_gpu"] == 2
    assert zero["offload_param"] == zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 1e-4
    assert ds["optimizer"]["params"]["weight_decay"] == 0.0
