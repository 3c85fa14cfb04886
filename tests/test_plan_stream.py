"""``optstate plan --stream-weights``: the weight-streaming plan's GPU, host and PCIe bytes against hand
counts from the shapes, its invariants, argument checks and the command line."""
import math

import pytest

from optstate_core.apps import cli, plan, plan_stream
from optstate_core.apps.model_shapes import checkpointed_activation_bytes, config_shapes
from optstate_core.tuning import Tuning

# Llama-style, 4 layers, grouped-query attention, untied lm_head
TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
PRESET = plan_stream.DEFAULT_PRESET
BARE = dict(margin=0.0, staging_bytes=0, release_bucket_bytes=0)  # no ring, margin or bucket beyond the largest grad


def _plan(memory, **kw):
    """A plan of TINY at 2 x 32 tokens with the bare options, ``kw`` overriding."""
    return plan_stream.stream_plan(config_shapes(TINY), TINY, memory, 2, 32, **{**BARE, **kw})


def _pcie(p):
    return sum(p.pcie_in.values()) + sum(p.pcie_out.values())


def _layer_params(shapes, i=0):
    return sum(math.prod(s) for name, s in shapes if f".layers.{i}." in name)


def test_gpu_bytes_fit_the_memory_given():
    for memory in range(1_000_000, 2_000_000, 25_000):
        for cap in (0, plan_stream.HOST_ACTIVATIONS_CAP):
            try:
                p = _plan(memory, host_activations_cap=cap)
            except ValueError as e:
                assert "--gpu-memory" in str(e)
                continue
            assert p.gpu_total <= memory, (memory, p.gpu)
            assert 0 <= p.resident_layers <= p.layers == 4


def test_more_memory_keeps_more_layers_and_moves_fewer_bytes():
    plans = [_plan(m) for m in range(1_130_000, 2_000_000, 10_000)]
    assert plans[0].resident_layers < plans[-1].resident_layers == 4
    for small, large in zip(plans, plans[1:]):
        assert large.resident_layers >= small.resident_layers
        assert _pcie(large) <= _pcie(small)


def test_all_resident_equals_the_unstreamed_plans_weights():
    shapes = config_shapes(TINY)
    p = _plan(10**9)
    assert p.resident_layers == p.layers and p.streamed_layers == 0
    assert p.pcie_in["weights (forward, recompute + backward)"] == p.pcie_out["weights (updated bf16)"] == 0
    assert p.host["streamed weights (bf16)"] == 0
    row = {r.name: r for r in plan.make_plan(shapes, 10**9, "adamw", [PRESET], "bf16", "bf16",
                                             release_gradients=True).rows}[PRESET]
    assert p.gpu["resident layers' weights"] + p.gpu["embeddings + lm_head (resident)"] == row.weights
    assert p.gpu["state on GPU"] == row.state.device and p.gpu["window of streamed layers"] == 0
    assert _pcie(p) == 0 and "staging ring + staged state" not in p.gpu


def test_pcie_bytes_match_a_hand_count():
    shapes, batch, seq, window = config_shapes(TINY), 2, 32, 2
    n = sum(math.prod(s) for _, s in shapes)
    layers, layer = TINY["num_hidden_layers"], _layer_params(shapes)
    assert all(_layer_params(shapes, i) == layer for i in range(layers))
    root = n - layers * layer
    largest = max(math.prod(s) for _, s in shapes)
    state = plan.state_bytes(shapes, PRESET).total  # the preset's moments and master correction, all of them
    checkpoints = batch * seq * layers * TINY["hidden_size"] * 2  # each layer's saved bf16 input
    working = checkpointed_activation_bytes(TINY, batch, seq, fused_loss=True) - checkpoints
    ring = min(state, (largest + Tuning.from_env().stage_ahead * 0) * state // n)  # staged ahead: the largest parameter's batch
    largest_layer = max(math.prod(s) for name, s in shapes if ".layers." in name)
    # root weights; a layer's largest bf16 gradient beside its recompute; the embeddings' or lm_head's
    # larger one only beyond that (they come at the ends of backward); activations
    beyond = max(0, (largest - largest_layer) * 2 - working)
    base = root * 2 + largest_layer * 2 + beyond + working + checkpoints
    memory = base + ring + (1 + window) * layer * 2  # one resident layer and the window: no room for state
    p = plan_stream.stream_plan(shapes, TINY, memory, batch, seq, window=window, host_activations_cap=0, **BARE)
    assert (p.resident_layers, p.checkpoints_on_host, p.gpu["state on GPU"]) == (1, False, 0)
    streamed = (layers - 1) * layer * 2
    assert sum(p.pcie_in.values()) == 2 * streamed + state
    assert sum(p.pcie_out.values()) == streamed + state
    assert p.pinned == streamed + state and p.gpu_total == memory
    # a layer's bytes more, less the checkpoints' but three layers' (the last two never move, one is
    # prefetched): with them in host memory one layer more fits, and the window's two slots then hold
    # the last two: all four stay (streaming two through a window of two saves nothing)
    kept, moved = checkpoints * 3 // layers, checkpoints * 2 // layers
    more = memory + layer * 2 - checkpoints + kept
    q = plan_stream.stream_plan(shapes, TINY, more, batch, seq, window=window, host_activations_cap=2**30, **BARE)
    assert (q.resident_layers, q.checkpoints_on_host, q.gpu["state on GPU"]) == (4, True, 0)
    assert q.gpu["window of streamed layers"] == 0
    streamed = 0
    assert sum(q.pcie_in.values()) == 2 * streamed + state + moved
    assert sum(q.pcie_out.values()) == streamed + state + moved
    assert q.pinned == streamed + state + moved and q.gpu_total == more


def test_times_and_tokens():
    p = _plan(1_150_000)
    assert p.streamed_layers > 0
    moved_in, moved_out = sum(p.pcie_in.values()), sum(p.pcie_out.values())
    both = min(moved_in, moved_out)
    assert p.copy_seconds() == pytest.approx(both / p.duplex + (max(moved_in, moved_out) - both) / p.one_way)
    assert p.compute_seconds() == pytest.approx(8 * p.n_params * 64 / (p.tflops * 1e12))
    hide = p.tokens_to_hide()
    assert p.compute_seconds(hide) >= p.copy_seconds() > p.compute_seconds(hide - 1)
    assert p.tokens_per_s() == pytest.approx(64 / max(p.compute_seconds(), p.copy_seconds()))


def test_several_gpus_shard_the_weights():
    layer = _layer_params(config_shapes(TINY))
    one, two = _plan(1_700_000), _plan(1_700_000, gpus=2)
    assert two.gpu_total <= 1_700_000 and _pcie(two) < _pcie(one)
    assert two.gpu["resident layers' weights"] == two.resident_layers * -(-layer // 2) * 2  # each rank's shard
    assert "FSDP2 gathered weights and gradients" in two.gpu and "FSDP2 gathered weights and gradients" not in one.gpu


@pytest.mark.parametrize("kw, arg", [(dict(window=-1), "--window"), (dict(window=0), "--window"),
                                     (dict(gpus=0), "--gpus"), (dict(tflops=0), "--stream-tflops"),
                                     (dict(preset="8bit"), "--stream-preset"), (dict(duplex=-1.0), "--stream-duplex")])
def test_bad_arguments_name_the_option(kw, arg):
    with pytest.raises(ValueError, match=arg):
        _plan(10**9, **kw)


def test_memory_too_small_for_the_window():
    with pytest.raises(ValueError, match="--gpu-memory"):
        _plan(1000)
    with pytest.raises(ValueError, match="--gpu-memory"):
        _plan(0)


def test_70b_invariants():
    from optstate_core.apps.llama import NAMED_SHAPES
    cfg = NAMED_SHAPES["70b"].hf_config()
    shapes = config_shapes(cfg)
    big, small = (plan_stream.stream_plan(shapes, cfg, m, 1, 4096) for m in (139 * 2**30, 24 * 10**9))
    for p, memory in ((big, 139 * 2**30), (small, 24 * 10**9)):
        assert p.gpu_total <= memory and p.n_params == NAMED_SHAPES["70b"].params
        assert sum(p.pcie_in.values()) >= sum(p.pcie_out.values()) > 0
        assert p.tokens_per_s() <= p.tokens / p.compute_seconds()
        assert p.rss == p.pinned + plan_stream.HOST_OVERHEAD
    assert 0 < small.resident_layers < big.resident_layers < 80
    assert _pcie(big) < _pcie(small)


def test_cli(capsys):
    assert cli.main(["plan", "--model", "tiny", "--gpu-memory", "1GB", "--stream-weights", "--batch", "1x64"]) == 0
    out = capsys.readouterr().out
    assert "## Weight streaming (planner estimate)" in out and "| 2 of 2 |" in out
    assert cli.main(["plan", "--model", "tiny", "--gpu-memory", "1GB", "--batch", "1x64"]) == 0
    assert "Weight streaming" not in capsys.readouterr().out  # the plan without the flag is unchanged
    with pytest.raises(SystemExit):
        cli.main(["plan", "--params", "1B", "--stream-weights"])
    assert "--stream-weights needs" in capsys.readouterr().err


def test_405b_shape():
    from optstate_core.apps.llama import NAMED_SHAPES
    shape = NAMED_SHAPES["405b"]  # Llama-3.1-405B: hidden 16384, 126 layers, ffn 53248, 128/8 heads
    assert shape.params == sum(math.prod(s) for _, s in config_shapes(shape.hf_config())) == 405_853_388_800


def test_a_run_as_set_up_resident_layers_and_state_budget_as_given():
    """--resident-layers and --state-budget plan the run as it is set up, not the greedy choice: the
    release batch lowered to a layer (what stream_weights does), the state on the GPU within the budget."""
    greedy = _plan(10**9)
    fixed = _plan(10**9, resident_layers=0, state_budget=0, release_bucket_bytes=2**30)
    assert greedy.resident_layers == 4 and fixed.resident_layers == 0 and fixed.gpu["state on GPU"] == 0
    layer = _layer_params(config_shapes(TINY)) * 2
    largest_layer = max(math.prod(s) for name, s in config_shapes(TINY) if ".layers." in name) * 2
    assert fixed.gpu["release bucket (bf16 gradients)"] == layer + largest_layer
    assert fixed.host["streamed weights (bf16)"] == 4 * layer


def test_offloaded_activations_plan_the_checkpoints_in_host_memory_but_three_layers():
    """--offload-activations (wrap(offload_activations=True)): the layer inputs in pinned host memory
    and across PCIe each way, but the last two layers' (never moved) and the one prefetched."""
    one = 2 * 32 * TINY["hidden_size"] * 2  # a layer's input: 2 x 32 tokens, bf16
    kept = _plan(10**9, resident_layers=0, state_budget=0)
    out = _plan(10**9, resident_layers=0, state_budget=0, offload_activations=True)
    assert kept.gpu["layer checkpoints"] == 4 * one and out.gpu["layer checkpoints"] == 3 * one
    assert out.host["checkpoints"] == out.pcie_in["checkpoints"] == out.pcie_out["checkpoints"] == 2 * one
    assert "checkpoints" not in kept.host and out.checkpoints_on_host and not kept.checkpoints_on_host
    assert sum(kept.gpu.values()) - sum(out.gpu.values()) == one
    with pytest.raises(ValueError, match="--gpu-memory"):
        _plan(10**5, offload_activations=True)


def test_cli_offload_activations(capsys):
    cli.main(["plan", "--model", "8b", "--gpu-memory", "12GB", "--batch", "1x16384", "--stream-weights",
              "--resident-layers", "0", "--offload-activations"])
    text = capsys.readouterr().out
    assert "layer checkpoints in pinned host memory" in text
