"""``optstate plan``: shapes from configs, state bytes per preset against hand computation and
against what the optimizer really holds, and the command line."""
import json
import math

import pytest
import torch

import optstate_core as oc
from optstate_core.apps import cli, plan
from optstate_core.schedule import release

# Llama-style, grouped-query attention (2 KV heads of 16), untied lm_head.
TINY_LLAMA = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "tie_word_embeddings": False}
# By hand: embed and lm_head [1000, 64]; per layer q, o [64, 64], k, v [32, 64], gate, up [128, 64],
# down [64, 128], 2 norms [64]; final norm [64].
N_PARAMS = 2 * 64000 + 2 * (2 * 4096 + 2 * 2048 + 3 * 8192 + 2 * 64) + 64  # 202048
FP32_STATE = 2 * 4 * N_PARAMS  # two fp32 states
# Tensors under 4096 elements stay uncompressed: k, v (2048 elements) and the norms.
SMALL = 2 * (2 * 2048 + 2 * 64) + 64  # elements per state
# One state, int8 (blocks of 256 along rows, a 4-byte scale per block): rows * cols + rows * ceil(cols/256) * 4,
# for embed and lm_head; per layer q, o; gate, up; down; then the small tensors in fp32
INT8_STATE = 2 * (1000 * 64 + 1000 * 4) + 2 * (
    2 * (64 * 64 + 64 * 4) + 2 * (128 * 64 + 128 * 4) + (64 * 128 + 64 * 4)) + 4 * SMALL
# 4-bit: two codes per byte, a 4-byte scale per block of 128: rows * cols / 2 + rows * ceil(cols/128) * 4
INT4_STATE = 2 * (1000 * 32 + 1000 * 4) + 2 * (
    2 * (64 * 32 + 64 * 4) + 2 * (128 * 32 + 128 * 4) + (64 * 64 + 64 * 4)) + 4 * SMALL


def test_hand_computed_numbers():
    assert (N_PARAMS, INT8_STATE, INT4_STATE) == (202048, 239168, 142400)  # the arithmetic above
    shapes = plan.config_shapes(TINY_LLAMA)
    assert sum(math.prod(s) for _, s in shapes) == N_PARAMS
    gpu = 2_000_000
    p = plan.make_plan(shapes, gpu, "adamw", ["8bit", "4bit", "offload"], staging_bytes=0)
    rows = {r.name: r for r in p.rows}
    assert p.weights == p.grads == 4 * N_PARAMS
    assert (rows["torch adamw"].state.device, rows["torch adamw"].state.host) == (FP32_STATE, 0)
    assert (rows["8bit"].state.device, rows["8bit"].state.host) == (2 * INT8_STATE, 0)
    assert (rows["4bit"].state.device, rows["4bit"].state.host) == (2 * INT4_STATE, 0)
    assert (rows["offload"].state.device, rows["offload"].state.host) == (0, 2 * INT8_STATE)
    assert rows["8bit"].total_gpu == 8 * N_PARAMS + 2 * INT8_STATE == 2_094_720
    assert rows["4bit"].total_gpu == 8 * N_PARAMS + 2 * INT4_STATE == 1_901_184
    assert [r.name for r in p.rows if r.fits] == ["4bit", "offload"]
    assert rows["8bit"].bits_per_param == pytest.approx(8 * 2 * INT8_STATE / N_PARAMS)
    ringed = {r.name: r for r in plan.make_plan(shapes, gpu, "adamw", ["8bit", "offload"]).rows}
    assert ringed["offload"].total_gpu == rows["offload"].total_gpu + plan.STAGING_BYTES  # the staging ring
    assert ringed["8bit"].total_gpu == rows["8bit"].total_gpu and ringed["offload"].pcie_bytes == 2 * INT8_STATE


def test_activations_dtypes_and_one_state_optimizers():
    shapes = plan.config_shapes(TINY_LLAMA)
    p = plan.make_plan(shapes, 10**9, "sgd", ["8bit"], weights_dtype="bf16", grads_dtype="fp32", activations=12345)
    torch_row, int8_row = p.rows
    assert p.weights == 2 * N_PARAMS and p.grads == 4 * N_PARAMS
    assert torch_row.state.device == 2 * N_PARAMS  # one bf16 momentum buffer
    assert torch_row.total_gpu == 2 * N_PARAMS + 4 * N_PARAMS + 2 * N_PARAMS + 12345
    assert int8_row.state.device == INT8_STATE - 2 * SMALL  # one int8 momentum buffer; small tensors in bf16


@pytest.mark.parametrize("preset", ["fp32", "bf16", "8bit", "4bit", "offload"])
def test_plan_matches_what_the_optimizer_holds(preset):
    shapes = plan.config_shapes(TINY_LLAMA)
    expected = plan.state_bytes(shapes, preset)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for _, s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = oc.wrap(torch.optim.AdamW(params), preset)
    opt.step()
    report = opt.memory_report()
    assert (report["device_bytes"], report["host_bytes"]) == (expected.device, expected.host)


@pytest.mark.parametrize("model_type,kwargs", [
    ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=32)),
    ("mistral", dict(num_key_value_heads=1)),
    ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    ("gpt2", None),
])
def test_config_shapes_match_transformers(model_type, kwargs):
    transformers = pytest.importorskip("transformers")
    if model_type == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
    else:
        cfg = transformers.AutoConfig.for_model(model_type, vocab_size=1000, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert dict(plan.config_shapes(cfg.to_dict())) == real


@pytest.mark.parametrize("text,n", [("7B", 7 * 10**9), ("125M", 125 * 10**6), ("1.5b", 1_500_000_000),
                                    ("6738415616", 6738415616), ("2e3", 2000), ("3K", 3000)])
def test_parse_count(text, n):
    assert plan.parse_count(text) == n


@pytest.mark.parametrize("text", ["", "7X", "-1B", "0", "B"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError, match="--params"):
        plan.parse_count(text)


def test_approximate_shapes_keep_the_count():
    for n in (7 * 10**9, 4096 * 3 + 5, 100):
        shapes = plan.approximate_shapes(n)
        assert sum(math.prod(s) for _, s in shapes) == n
    # 7B as 417 [4096, 4096] matrices, one [4096, 952] and a 1-D remainder of 1536 elements (int8: a
    # byte per element + 4 bytes per block of 256 along a row; the remainder fp32: under 4096 elements)
    shapes = plan.approximate_shapes(7 * 10**9)
    assert [s for _, s in shapes[-3:]] == [(4096, 4096), (4096, 952), (1536,)] and len(shapes) == 419
    assert 417 * 4096 * 4096 + 4096 * 952 + 1536 == 7 * 10**9
    st = plan.state_bytes(shapes, "8bit")
    assert st.device == 2 * (417 * (4096 * 4096 + 4096 * 16 * 4) + 4096 * 952 + 4096 * 4 * 4 + 1536 * 4)


def _fits(line: str) -> str:
    """The "fits" cell of a plan table row."""
    return line.split("|")[9].strip()


def test_cli_plan_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    assert cli.main(["plan", "--config", str(path), "--gpu-memory", "2000000", "--presets", "8bit,4bit"]) == 0
    out = capsys.readouterr().out
    assert f"{N_PARAMS:,} parameters" in out
    lines = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert _fits(lines["8bit"]) == "no" and _fits(lines["4bit"]) == "yes"
    assert f"{2 * INT4_STATE / 2**30:.2f} GiB" in lines["4bit"]
    assert "fits: 4bit" in out


def test_cli_plan_params(capsys):
    assert cli.main(["plan", "--params", "7B", "--gpu-memory", "80GB", "--activations", "5GB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"torch adamw", "fp32", "bf16", "8bit", "4bit", "offload"}
    # 7B fp32: weights + grads 56 GB + 5 GB activations; AdamW state 56 GB does not fit in 80 GB, int8 (14.2 GB) does
    assert _fits(rows["torch adamw"]) == "no" and _fits(rows["8bit"]) == "yes"


@pytest.mark.parametrize("argv,message", [
    (["plan"], "--params"),
    (["plan", "--params", "7Q"], "--params"),
    (["plan", "--params", "7B", "--gpu-memory", "lots"], "--gpu-memory"),
    (["plan", "--params", "7B", "--activations", "-3GB"], "--activations"),
    (["plan", "--params", "7B", "--presets", "9bit"], "--presets"),
    (["plan", "--config", "/nonexistent/config.json"], "--config"),
])
def test_cli_plan_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_config_missing_keys(tmp_path):
    with pytest.raises(ValueError, match="intermediate_size"):
        plan.config_shapes({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                            "num_attention_heads": 2})


LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}


def test_plan_an_8b_model_on_a_24gb_card(tmp_path, capsys):
    """The issue's question: Llama-3-8B, 24 GB, bf16 weights and gradients, 4 GB of activations,
    release. Rows that stream moments and correction fit (the ring and the batches staged ahead
    counted); release counts one batch of gradients for every preset; with 2 GB more a gpu_budget
    row keeps what room is left resident; the hint never asks for what was given."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    argv = ["plan", "--config", str(path), "--gpu-memory", "24GB", "--weights-dtype", "bf16", "--grads-dtype", "bf16",
            "--activations", "4GB", "--release-gradients"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert rows["bf16w-4bit-lean-offload"][9].strip() == "yes" and rows["bf16w-4bit-lean"][9].strip() == "no"
    assert "pick: bf16w-4bit-lean-offload" in out and "release_gradients=True" in out
    presets = ["8bit", "bf16w-4bit-lean", "bf16w-4bit-lean-offload"]
    p = plan.make_plan(plan.config_shapes(LLAMA3_8B), 24 * 10**9, "adamw", presets,
                       "bf16", "bf16", 4 * 10**9, release_gradients=True)
    n, embed = p.n_params, 128256 * 4096
    by = {r.name: r for r in p.rows}
    assert by["8bit"].grads == by["bf16w-4bit-lean-offload"].grads == plan.RELEASE_BUCKET_BYTES + 2 * embed
    assert by["torch adamw"].grads == 2 * n  # the unwrapped optimizer releases nothing
    off = by["bf16w-4bit-lean-offload"]
    ahead = (embed + release.DEFAULT_STAGE_AHEAD * plan.RELEASE_BUCKET_BYTES // 2) * off.state.host // n  # the lm_head batch + 2
    assert off.state.device == 0 and off.total_gpu == 2 * n + off.grads + 4 * 10**9 + plan.STAGING_BYTES + ahead
    assert off.pcie_bytes == off.state.host > 2 * n  # 4-bit moments + 1-byte correction + scales
    assert not any(r.gpu_budget for r in p.rows)  # under 1 GiB of room: no budget row
    p = plan.make_plan(plan.config_shapes(LLAMA3_8B), 26 * 10**9, "adamw", presets,
                       "bf16", "bf16", 4 * 10**9, release_gradients=True)
    budgeted = p.best()
    assert budgeted.gpu_budget is not None and 0 < budgeted.state.device <= budgeted.gpu_budget
    assert budgeted.state.device + budgeted.state.host == by["bf16w-4bit-lean-offload"].state.total
    assert budgeted.total_gpu <= 26 * 10**9 * (1 - plan.BUDGET_MARGIN) + 1


def test_plan_hints_name_only_what_was_not_given(capsys):
    assert cli.main(["plan", "--params", "70B", "--gpu-memory", "24GB", "--weights-dtype", "bf16",
                     "--release-gradients"]) == 0
    out = capsys.readouterr().out
    hint = next(line for line in out.splitlines() if line.startswith("nothing fits"))
    assert "bf16 weights" not in hint and "--release-gradients" not in hint and "FSDP2" in hint
    assert cli.main(["plan", "--params", "70B", "--gpu-memory", "24GB", "--activations", "2GB"]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nothing fits"))
    assert "bf16 weights" in hint and "--release-gradients" in hint and "fewer activations" in hint


def test_plan_params_release_frees_all_but_a_batch():
    """--params approximates a large model as layer-sized matrices, so release keeps one batch of
    gradients alive (with one huge matrix it used to free nothing)."""
    shapes = plan.approximate_shapes(8 * 10**9)
    p = plan.make_plan(shapes, 80 * 10**9, "adamw", ["bf16w-4bit-lean"], "bf16", release_gradients=True)
    lean = p.rows[1]
    assert lean.grads == plan.RELEASE_BUCKET_BYTES + 2 * 4096 * 4096 and lean.fits
    with pytest.raises(ValueError, match="--pcie-gbps"):
        plan.make_plan(shapes, 10**9, pcie_bytes_per_s=0)


def test_plan_fsdp2_per_gpu():
    """--gpus N: weights, gradients and state per rank, plus FSDP2's gathered units (the root for
    the whole step, the largest layer twice) and the unsharded gradients of the larger of the two."""
    shapes = plan.config_shapes(TINY_LLAMA)
    units = plan.fsdp_units(shapes)
    layer = 2 * 4096 + 2 * 2048 + 3 * 8192 + 2 * 64
    assert units == {"model.layers.0": layer, "model.layers.1": layer, "root": 2 * 64000 + 64}
    one = {r.name: r for r in plan.make_plan(shapes, 10**9, "adamw", ["4bit"], "bf16", release_gradients=False).rows}
    two = {r.name: r for r in plan.make_plan(shapes, 10**9, "adamw", ["4bit"], "bf16", gpus=2).rows}
    root = 2 * 64000 + 64
    assert two["4bit"].state.device == -(-one["4bit"].state.device // 2)
    assert two["4bit"].weights == N_PARAMS + (root + 2 * layer) * 2 + root * 2  # bf16: half the weights, buffers
    assert two["4bit"].grads == N_PARAMS  # half of the bf16 gradients
    assert two["4bit"].bits_per_param == one["4bit"].bits_per_param  # the state per parameter is unchanged
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="--gpus"):
            plan.make_plan(shapes, 10**9, gpus=bad)
    assert [u for u in plan.fsdp_units(plan.approximate_shapes(3 * 4096 * 4096)).values()] == [4096 * 4096] * 3


def test_cli_plan_70b_on_four_gpus(tmp_path, capsys):
    config = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert cli.main(["plan", "--config", str(path), "--gpu-memory", "80GB", "--weights-dtype", "bf16",
                     "--activations", "6GB", "--release-gradients", "--gpus", "4",
                     "--presets", "bf16w-4bit-lean,bf16w-4bit-lean-offload"]) == 0
    out = capsys.readouterr().out
    assert "70,553,706,496 parameters" in out and "FSDP2 over 4 GPUs" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert _fits(rows["bf16w-4bit-lean-offload"]) == "yes" and _fits(rows["bf16w-4bit-lean"]) == "no"
    with pytest.raises(SystemExit):
        cli.main(["plan", "--config", str(path), "--gpus", "0"])
    assert "--gpus" in capsys.readouterr().err


def test_plan_estimates_activations_from_a_batch(tmp_path, capsys):
    """--batch BxS with a Llama --config: saved layer inputs, one recomputed layer, the logits."""
    tokens = 2 * 128
    want = tokens * (2 * 64 * 2 + (10 * 64 + 8 * 128) * 2 + 10 * 1000)
    assert plan.checkpointed_activation_bytes(TINY_LLAMA, 2, 128) == want
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    assert cli.main(["plan", "--config", str(path), "--batch", "2x128", "--presets", "8bit"]) == 0
    assert f"activations {want / 2**30:.2f} GiB per GPU" in capsys.readouterr().out
    assert plan.parse_batch("4X2048") == (4, 2048)
    for argv, message in ((["--batch", "2x0"], "--batch must be"), (["--batch", "2x8", "--activations", "1GB"], "not both")):
        with pytest.raises(SystemExit):
            cli.main(["plan", "--config", str(path), *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--params", "1B", "--batch", "1x8"])
    assert "--batch needs --config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--activations instead"):
        plan.checkpointed_activation_bytes({"model_type": "gpt2", "n_embd": 64}, 1, 8)


def test_plan_pick_keeps_masters_for_bf16_weights():
    """With bf16 weights the pick prefers a row with fp32 masters (AdamW's trajectory) over one that
    updates the bf16 weights directly, even when that one holds less in host memory."""
    shapes = plan.config_shapes(TINY_LLAMA)
    bf16 = plan.make_plan(shapes, 10**9, "adamw", ["4bit", "bf16w-4bit-lean-offload"], "bf16")
    assert bf16.best().name == "bf16w-4bit-lean-offload"
    fp32 = plan.make_plan(shapes, 10**9, "adamw", ["4bit", "bf16w-4bit-lean-offload"], "fp32")
    assert fp32.best().name == "4bit"  # no host state, and fp32 weights are their own masters


def test_named_models_plan_as_their_config_json(tmp_path, capsys):
    """``--model 8b`` is Llama-3-8B's config.json: the same table and recipe, word for word after the source."""
    from optstate_core.apps.llama import NAMED_SHAPES
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NAMED_SHAPES["8b"].hf_config()))
    common = ["plan", "--gpu-memory", "24GB", "--weights-dtype", "bf16", "--release-gradients", "--batch", "1x2048"]
    outputs = []
    for source in (["--model", "8b"], ["--config", str(path), "--recipe"]):  # --model prints the recipe
        assert cli.main(common + source) == 0
        outputs.append(capsys.readouterr().out.split("\n", 1)[1])
    assert outputs[0] == outputs[1]
    assert NAMED_SHAPES["8b"].params == 8_030_261_248  # Llama-3-8B


def test_a_70b_model_on_one_4_gpu_node(capsys):
    """Llama-3-70B shapes, bf16 weights, released gradients, 1x4096 per GPU on 4 x 80 GB: the
    offloaded and budgeted lean presets fit, resident state does not."""
    from optstate_core.apps.llama import NAMED_SHAPES
    assert NAMED_SHAPES["70b"].params == 70_553_706_496
    assert cli.main(["plan", "--model", "70b", "--gpu-memory", "80GB", "--gpus", "4", "--weights-dtype", "bf16",
                     "--grads-dtype", "bf16", "--release-gradients", "--batch", "1x4096",
                     "--presets", "bf16w-4bit-lean,bf16w-4bit-lean-offload"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert _fits(rows["bf16w-4bit-lean"]) == "no" and _fits(rows["bf16w-4bit-lean-offload"]) == "yes"
    assert any(name.startswith("bf16w-4bit-lean + gpu_budget=") and _fits(row) == "yes" for name, row in rows.items())


# -- the one-GPU recipe (issue 39) --------------------------------------------------------------
def test_fused_loss_replaces_the_logits_term():
    """fused_loss=True: the 10*b*s*V logits term becomes the chunked loss's slice of logits (fp32 and
    bf16), its fp32 gradient accumulator of the hidden states and the per-token statistics."""
    from optstate_core.apps.chunked_loss import SLICE_BYTES
    b, s, h, i, layers, vocab = 2, 128, 64, 128, 2, 1000
    tokens = b * s
    saved, recomputed = tokens * layers * h * 2, tokens * (10 * h + 8 * i) * 2
    rows = min(vocab, max(128, SLICE_BYTES // (6 * tokens) // 128 * 128))  # 1000: the whole vocabulary
    assert rows == 1000
    assert plan.checkpointed_activation_bytes(TINY_LLAMA, b, s) == saved + recomputed + 10 * tokens * vocab  # unchanged
    from optstate_core.apps.model_shapes import FUSED_LOSS_RECOMPUTED
    assert plan.checkpointed_activation_bytes(TINY_LLAMA, b, s, fused_loss=True) == \
        saved + int(FUSED_LOSS_RECOMPUTED * recomputed) + 6 * tokens * rows + 4 * tokens * h + 16 * tokens
    # Llama-3-8B at 1x2048: slices of 21760 rows (21845 rounded down to 128s) instead of 128256
    from optstate_core.apps.llama import NAMED_SHAPES
    cfg = NAMED_SHAPES["8b"].hf_config()
    saved = plan.checkpointed_activation_bytes(cfg, 1, 2048) - plan.checkpointed_activation_bytes(cfg, 1, 2048, True)
    recomputed = 2048 * (10 * 4096 + 8 * 14336) * 2
    assert saved == 2048 * (10 * 128256 - 6 * 21760 - 4 * 4096 - 16) + recomputed - int(0.15 * recomputed)


def _recipe_lines(out: str):
    """The recipe's micro-batch rows {micro-batch: cells} and its text after the table."""
    text = out[out.index("## Recipe"):]
    table = {int(line.split("|")[1]): [c.strip() for c in line.split("|")[2:-1]]
             for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    return table, text


def _largest(text: str, label: str) -> int:
    return int(next(line for line in text.splitlines() if line.startswith(label)).rsplit(":", 1)[1])


def _expected(gpu: int):
    """What the plan itself computes at micro-batch 1 with the fused loss: the first candidate that fits."""
    from optstate_core.apps import recipe
    from optstate_core.apps.llama import NAMED_SHAPES
    cfg = NAMED_SHAPES["8b"].hf_config()
    act = plan.checkpointed_activation_bytes(cfg, 1, 2048, fused_loss=True)
    p = plan.make_plan(plan.config_shapes(cfg), gpu, "adamw",
                       ["bf16w-4bit-lean", "bf16w-4bit-lean-hostcorr", "bf16w-4bit-lean-offload"],
                       "bf16", "bf16", act, release_gradients=True)
    budget = next((r for r in p.rows if r.gpu_budget is not None), None)
    by = {r.name: r for r in p.rows}
    order = [("bf16w-4bit-lean", by["bf16w-4bit-lean"]), ("bf16w-4bit-lean-hostcorr", by["bf16w-4bit-lean-hostcorr"]),
             (recipe.BUDGET, budget), ("bf16w-4bit-lean-offload", by["bf16w-4bit-lean-offload"])]
    return next((name, row) for name, row in order if row is not None and row.fits)


def test_recipe_8b_on_24gb_streams_state_and_the_fused_loss_fits_more(capsys):
    from optstate_core.apps import recipe
    from optstate_core.apps.llama import NAMED_SHAPES
    assert cli.main(["plan", "--model", "8b", "--gpu-memory", "24GB"]) == 0
    table, text = _recipe_lines(capsys.readouterr().out)
    r = recipe.recipe(NAMED_SHAPES["8b"].hf_config(), 24 * 10**9)
    name, first = _expected(24 * 10**9)
    assert first.state.host > 0 and (first.gpu_budget is not None or name.endswith("-offload"))
    assert f"preset: {r.preset} (" in text and r.preset in recipe.CANDIDATES
    assert r.row(1).state.host > 0  # resident and -hostcorr do not fit 24 GB: state streams
    fused, plain = _largest(text, "largest micro-batch with the fused"), _largest(text, "with the plain loss")
    assert fused == r.largest(True) and plain == r.largest(False) and fused > plain
    assert table[1][5] == "yes" and table[1][4] == plan.gib(r.row(1).total_gpu)
    row = r.row(fused)
    assert f"PCIe per step, each way: {plan.gib(row.pcie_bytes)}, {row.pcie_bytes / plan.PCIE_BYTES_PER_S:.2f} s" in text
    assert f"run: python examples/finetune_8b_24gb.py --gpu-memory 24GB --preset {r.preset.split(' + ')[0]} " \
        f"--micro-batch {fused}" in text
    last = max(table)  # the table stops at the first micro-batch (1, 2, 4, ...) that fits neither way
    assert last == 2 * fused and table[last][2] == table[last][5] == "no"
    # tokens/s against resident: compute = (8 * params + 2 * hidden * vocab) * tokens / 470e12; step = max(compute, copy)
    compute = (8 * 8_030_261_248 + 2 * 4096 * 128256) * 2048 / 470e12
    step = max(compute, r.row(1).pcie_bytes / plan.PCIE_BYTES_PER_S)
    assert f"expected at micro-batch 1: {2048 / step:,.0f} tokens/s, {compute / step:.2f}x the " \
        f"{2048 / compute:,.0f} tokens/s" in text
    assert compute / step < 1  # the copies outlast compute at micro-batch 1
    # the choice: no other candidate that fits at micro-batch 1 expects more tokens/s (beyond the 1% tie)
    best = recipe.throughput(r, fused)[0]
    for candidate in recipe.CANDIDATES:
        if candidate == r.preset or recipe.candidate_row(r.first, candidate) is None or \
                not recipe.candidate_row(r.first, candidate).fits:
            continue
        other = recipe.replace(r, preset=candidate, micro_batches=recipe._micro_batches(
            plan.config_shapes(NAMED_SHAPES["8b"].hf_config()), NAMED_SHAPES["8b"].hf_config(), 24 * 10**9, 2048,
            candidate, plan.PCIE_BYTES_PER_S))
        assert recipe.throughput(other, other.largest(True))[0] <= best * (1 + recipe.TIE)


def test_recipe_8b_on_80gb_is_resident(capsys):
    assert cli.main(["plan", "--model", "8b", "--gpu-memory", "80GB"]) == 0
    table, text = _recipe_lines(capsys.readouterr().out)
    assert _expected(80 * 10**9)[0] == "bf16w-4bit-lean"
    assert "preset: bf16w-4bit-lean (" in text and "PCIe per step, each way: 0 (all state resident)" in text
    assert _largest(text, "largest micro-batch with the fused") > _largest(text, "with the plain loss") >= 1
    assert "1.00x the" in text and "--preset bf16w-4bit-lean --micro-batch" in text


def test_recipe_8b_on_32gb_follows_the_plan(capsys):
    from optstate_core.apps import recipe
    from optstate_core.apps.llama import NAMED_SHAPES
    name, row = _expected(32 * 10**9)
    assert cli.main(["plan", "--model", "8b", "--gpu-memory", "32GB"]) == 0
    table, text = _recipe_lines(capsys.readouterr().out)
    assert f"preset: {name} (" in text and name != "bf16w-4bit-lean"  # resident does not fit 32 GB
    r = recipe.recipe(NAMED_SHAPES["8b"].hf_config(), 32 * 10**9)
    assert r.preset == name and r.row(1).total_gpu == row.total_gpu
    for m in r.micro_batches:  # every cell is the plan's own row at that micro-batch's activations
        assert table[m.size][2] == ("yes" if m.fits(False) else "no")
        assert table[m.size][5] == ("yes" if m.fits(True) else "no")
        assert m.rows[True].total_gpu - m.rows[False].total_gpu == m.activations[True] - m.activations[False]
    assert _largest(text, "largest micro-batch with the fused") == r.largest(True) >= r.largest(False)
    big = r.row(r.largest(True))
    assert f"PCIe per step, each way: {plan.gib(big.pcie_bytes)}" in text


def test_recipe_when_nothing_fits(capsys):
    assert cli.main(["plan", "--model", "70b", "--gpu-memory", "24GB"]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if line.startswith("nothing fits at micro-batch 1"))
    assert "needs" in line and "FSDP2" in line and "run: python" not in text


@pytest.mark.parametrize("argv,message", [
    (["--model", "8b", "--tflops", "0"], "--tflops"),
    (["--model", "8b", "--seq", "0"], "--seq"),
    (["--params", "8B", "--recipe"], "--recipe"),
    (["--model", "8b", "--recipe", "--gpus", "2"], "--recipe"),
])
def test_recipe_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match=message):
        cli.main(["--verbose", "plan", *argv])


def test_recipe_only_with_a_model_or_asked_for(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    assert cli.main(["plan", "--config", str(path), "--presets", "8bit"]) == 0
    assert "## Recipe" not in capsys.readouterr().out
    assert cli.main(["plan", "--config", str(path), "--recipe", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "## Recipe" in out and "sequences of 64 tokens" in out and "micro-batch 32" in out


def test_preset_for_one_micro_batch_moves_the_fewest_bytes():
    """``preset_for`` (what examples/finetune_8b_24gb.py runs by default): of the candidates that fit
    at that micro-batch, the fewest bytes over PCIe per step; at 24 GB, micro-batch 1, that is
    resident state up to a budget (less than streaming it all); none at micro-batch 8 there; all
    resident on 80 GB; bad micro-batches refused by name."""
    from optstate_core.apps import recipe
    from optstate_core.apps.llama import NAMED_SHAPES
    cfg = NAMED_SHAPES["8b"].hf_config()
    for size in (1, 4):
        preset, budget = recipe.preset_for(cfg, 24 * 10**9, size)
        _, p = recipe._plan(plan.config_shapes(cfg), cfg, 24 * 10**9, size, 2048, True,
                            [c for c in recipe.CANDIDATES if c != recipe.BUDGET], plan.PCIE_BYTES_PER_S)
        rows = [recipe.candidate_row(p, c) for c in recipe.CANDIDATES]
        fitting = [r for r in rows if r is not None and r.fits]
        chosen = min(fitting, key=lambda r: r.pcie_bytes)
        assert (preset, budget) == ("bf16w-4bit-lean", chosen.gpu_budget) and budget is not None
        assert chosen.pcie_bytes < recipe.candidate_row(p, "bf16w-4bit-lean-offload").pcie_bytes
        assert chosen.total_gpu <= 24 * 10**9 * (1 - plan.BUDGET_MARGIN) + 1
    assert recipe.preset_for(cfg, 24 * 10**9, 1)[1] > recipe.preset_for(cfg, 24 * 10**9, 4)[1]  # less activation
    assert recipe.preset_for(cfg, 24 * 10**9, 8) == (None, None)
    assert recipe.preset_for(cfg, 80 * 10**9, 4) == ("bf16w-4bit-lean", None)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="micro_batch must be a positive integer"):
            recipe.preset_for(cfg, 24 * 10**9, bad)
