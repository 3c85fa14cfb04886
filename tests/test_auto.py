"""Preset ``auto`` (optstate_core.apps.auto): its choice is the planner's for a grid of models, memories
and micro-batches, the loss path it assumes, the CPU default, the device's memory, and bad inputs."""
import logging
import types

import pytest
import torch

import optstate_core as oc
from optstate_core.apps import auto
from optstate_core.apps.chunked_loss import use_chunked_loss
from optstate_core.apps.llama import NAMED_SHAPES
from optstate_core.apps.model_shapes import checkpointed_activation_bytes, config_shapes
from optstate_core.apps.plan import make_plan
from optstate_core.apps.recipe import pick, preset_for

transformers = pytest.importorskip("transformers")

GB = 10**9
SEQ = 2048


def llama(shape: str, dtype=torch.bfloat16, device="meta", **config):
    """A transformers Llama of a named shape (``tiny32``: hidden 32, 2 layers, vocab 64), on ``device``."""
    if shape == "tiny32":
        fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    else:
        fields = {k: v for k, v in NAMED_SHAPES[shape].hf_config().items() if k != "model_type"}
    cfg = transformers.LlamaConfig(**fields, max_position_embeddings=SEQ, **config)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.fixture(scope="module")
def meta_models():
    return {shape: llama(shape) for shape in ("0.95b", "8b")}


@pytest.mark.parametrize("shape", ["0.95b", "8b"])
def test_bf16_choice_is_the_planners_for_a_grid(meta_models, shape):
    """bf16 parameters: what examples/finetune_8b_24gb.py --preset plan runs (recipe.preset_for, shapes from
    the config, not from the model), at every (memory, micro-batch, loss); nothing fitting raises."""
    model, config = meta_models[shape], NAMED_SHAPES[shape].hf_config()
    seen = set()
    for memory in (16, 24, 32, 80):
        for micro_batch in (1, 2, 4):
            for loss in ("plain", "fused"):
                want = preset_for(config, memory * GB, micro_batch, SEQ, fused_loss=loss == "fused")
                if want[0] is None:
                    with pytest.raises(ValueError, match="no preset fits"):
                        auto.choose(model, gpu_memory=f"{memory}GB", micro_batch=micro_batch, loss=loss)
                    continue
                choice = auto.choose(model, gpu_memory=f"{memory}GB", micro_batch=micro_batch, loss=loss)
                assert (choice.preset, choice.gpu_budget) == want, (memory, micro_batch, loss)
                assert choice.release_gradients and choice.seq_len == SEQ and choice.peak <= memory * GB
                seen.add((choice.preset, choice.gpu_budget is not None))
    if shape == "8b":  # the grid reaches every kind of row: resident, budget, host correction, all streamed
        assert {("bf16w-4bit-lean", False), ("bf16w-4bit-lean", True), ("bf16w-4bit-lean-hostcorr", False),
                ("bf16w-4bit-lean-offload", False)} <= seen


def test_fp32_choice_is_the_planners_rule_over_the_plain_candidates(meta_models):
    model = meta_models["0.95b"].float()
    try:
        config = NAMED_SHAPES["0.95b"].hf_config()
        # fp32 at 1 x 2048 with release: 8bit 7.34 GB, 4bit 6.41 GB, offload 6.08 GB
        for memory, micro_batch, want in ((80 * GB, 4, "8bit"), (7 * GB, 1, "4bit"), (6_200_000_000, 1, "offload")):
            activations = checkpointed_activation_bytes(config, micro_batch, SEQ)
            plan = make_plan(config_shapes(config), memory, "adamw", auto.PLAIN_CANDIDATES, "fp32", "fp32",
                             activations, release_gradients=True)
            choice = auto.choose(model, gpu_memory=memory, micro_batch=micro_batch)
            assert choice.preset == pick(plan, auto.PLAIN_CANDIDATES).name == want
            assert choice.peak == pick(plan, auto.PLAIN_CANDIDATES).total_gpu
    finally:
        model.to(torch.bfloat16)


def test_the_loss_path_auto_assumes(meta_models):
    """Plain (logits counted) unless the model has a fused loss or ``loss`` says so. liger-kernel's fused
    linear cross-entropy (found by its forward's module; its kernels need CUDA) is planned as the
    planner's no-logits option, the same as the chunked loss."""
    model, config = meta_models["8b"], NAMED_SHAPES["8b"].hf_config()
    plain = auto.choose(model, gpu_memory="24GB")
    assert plain.loss == "plain" and plain.activations == checkpointed_activation_bytes(config, 1, SEQ)
    fused = {loss: auto.choose(model, gpu_memory="24GB", loss=loss) for loss in ("fused", "chunked", "liger")}
    assert fused["liger"].activations == checkpointed_activation_bytes(config, 1, SEQ, fused_loss=True)
    assert {(c.preset, c.gpu_budget, c.peak) for c in fused.values()} == {
        (fused["liger"].preset, fused["liger"].gpu_budget, fused["liger"].peak)}
    assert (fused["liger"].preset, fused["liger"].gpu_budget) == preset_for(config, 24 * GB, 1, SEQ, True)

    def liger_forward(self, *args, **kwargs):  # stands for liger_kernel.transformers.model.llama.lce_forward
        raise AssertionError("not called")
    liger_forward.__module__ = "liger_kernel.transformers.model.llama"
    patched = llama("tiny32")
    patched.forward = types.MethodType(liger_forward, patched)
    assert auto.choose(patched, gpu_memory="1GB").loss == "liger"
    assert auto.choose(use_chunked_loss(llama("tiny32")), gpu_memory="1GB").loss == "chunked"


def test_cpu_has_no_cap_and_wrap_logs_one_line(caplog):
    model = llama("tiny32", torch.float32, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="optstate.auto"):
        wrapped = auto.wrap(opt, model, micro_batch=2, seq_len=16)
    assert isinstance(wrapped, oc.VirtualOptimizer) and not wrapped.release_gradients
    assert wrapped.policy.describe() == oc.make_policy("8bit").describe()
    (record,) = [r for r in caplog.records if r.name == "optstate.auto"]
    line = record.getMessage()
    assert line.startswith("optstate auto: 8bit, release_gradients=False") and "expected peak" in line
    assert "cpu: no memory cap" in line and "loss plain" in line
    bf16 = llama("tiny32", torch.bfloat16, "cpu")
    choice = auto.choose(bf16)
    assert (choice.preset, choice.gpu_budget, choice.release_gradients) == ("bf16w-4bit-lean", None, False)
    loss = bf16(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss
    loss.backward()
    step = auto.wrap(torch.optim.AdamW(bf16.parameters(), lr=1e-3), bf16)
    step.step()
    assert step.step_count == 1 and step.policy.describe() == oc.make_policy("bf16w-4bit-lean").describe()


def test_a_capped_device_releases_and_counts_frozen_weights():
    model = llama("tiny32", torch.float32, "cpu")
    model.model.embed_tokens.weight.requires_grad_(False)
    choice = auto.choose(model, gpu_memory="1GB", micro_batch=2, seq_len=16)
    assert choice.release_gradients and choice.preset == "8bit" and choice.gpu_memory == GB
    assert any("frozen parameters" in n for n in choice.notes)
    opt = auto.wrap(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), model, gpu_memory="1GB",
                    max_grad_norm=1.0)
    assert opt.release_gradients and opt.max_grad_norm == 1.0


def test_the_cuda_memory_is_free_plus_this_process_reserve(monkeypatch):
    model = llama("8b")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * GB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.3)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    choice = auto.choose(model, device="cuda", loss="fused")
    assert choice.gpu_memory == 24 * GB  # min(80 GB x 0.3, 20 free + 4 reserved)
    assert (choice.preset, choice.gpu_budget) == preset_for(NAMED_SHAPES["8b"].hf_config(), 24 * GB, 1, SEQ, True)
    assert any("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True" in n
               for n in choice.notes)  # CUDA has started: the line says what to set
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="gpu_memory: preset 'auto' plans for one GPU"):
        auto.choose(model, device="cuda")


def test_allocator_settings_are_set_only_before_cuda_starts():
    environ, notes = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, []
    auto._apply_allocator_settings(notes, environ, cuda_started=True)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"} and notes == []
    auto._apply_allocator_settings(notes, environ, cuda_started=False)
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == ("max_split_size_mb:512,expandable_segments:True,"
                                                  "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    assert len(notes) == 1 and auto._allocator_settings(environ) == []
    notes = []
    auto._allocator_notes(torch.device("cuda"), False, notes, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert notes == []  # without host state only expandable segments matter


@pytest.mark.parametrize("call, match", [
    (lambda opt, m: auto.wrap(opt), "model: preset 'auto' plans from the model"),
    (lambda opt, m: auto.wrap(opt, m, micro_batch=0), "micro_batch must be a positive integer"),
    (lambda opt, m: auto.wrap(opt, m, seq_len="long"), "seq_len must be a positive integer"),
    (lambda opt, m: auto.wrap(opt, m, loss="fast"), "loss must be one of plain, fused, chunked, liger"),
    (lambda opt, m: auto.wrap(opt, m, gpu_memory="lots"), "gpu_memory must be a byte count"),
    (lambda opt, m: auto.wrap(opt, m, gpu_budget="1GB"), "gpu_budget: preset 'auto' chooses it"),
    (lambda opt, m: auto.wrap(opt, m, release_gradients="yes"), "release_gradients must be None, True or False"),
    (lambda opt, m: auto.wrap(opt, m, gpu_memory="1MB"), "model: no preset fits"),
    (lambda opt, m: auto.wrap(opt, torch.nn.Linear(2, 2)), "not the model's"),
    (lambda opt, m: auto.wrap(opt, m, gpu_memory="1GB", activations="x"), "activations must be a byte count"),
    (lambda opt, m: oc.wrap(opt, "auto"), r"optstate_core\.apps\.auto\.wrap\(optimizer, model\)"),
])
def test_bad_inputs_name_the_argument_and_leave_the_optimizer_untouched(call, match):
    model = llama("tiny32", torch.float32, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=match):
        call(opt, model)
    assert [dict(g) for g in opt.param_groups] == groups and not opt.state
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    assert oc.wrap(opt, "8bit").optimizer is opt  # still a plain optimizer, wrappable


def test_models_without_an_activation_estimate_need_activations_on_a_capped_device():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="activations: preset 'auto' estimates activations for Llama-family"):
        auto.wrap(opt, model, gpu_memory="1GB")
    assert auto.choose(model).activations == 0  # no cap: not needed, and the line says they are not counted
    choice = auto.choose(model, gpu_memory="1GB", activations="100MB")
    assert (choice.preset, choice.activations, choice.release_gradients) == ("8bit", 10**8, True)
    with pytest.raises(ValueError, match="optimizer: preset 'auto' plans for AdamW or Adam"):
        auto.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
