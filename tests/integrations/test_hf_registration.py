"""optstate_hf: optim names, the handler, optim_args parsing, the fallback."""
import json
import pickle

import pytest
import torch

pytest.importorskip("transformers")

import optstate_core as oc  # noqa: E402
import optstate_hf  # noqa: E402
from hf_testlib import make_trainer, one_thread, tiny_dataset, tiny_model, training_args  # noqa: E402,F401
from transformers import HfArgumentParser, Trainer, TrainingArguments  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: the names registered before they were generated from the preset table: they must stay valid
HAND_LIST = {"optstate_adamw": "default", "optstate_adamw_8bit": "8bit", "optstate_adamw_4bit": "4bit",
             "optstate_adamw_offload": "offload", "optstate_adamw_bf16w_8bit": "bf16w-8bit",
             "optstate_adamw_bf16w_4bit": "bf16w-4bit", "optstate_adamw_bf16w_8bit_lean": "bf16w-8bit-lean",
             "optstate_adamw_bf16w_4bit_lean": "bf16w-4bit-lean",
             "optstate_adamw_bf16w_8bit_lean_hostcorr": "bf16w-8bit-lean-hostcorr",
             "optstate_adamw_bf16w_4bit_lean_hostcorr": "bf16w-4bit-lean-hostcorr",
             "optstate_adamw_bf16w_8bit_lean_offload": "bf16w-8bit-lean-offload",
             "optstate_adamw_bf16w_4bit_lean_offload": "bf16w-4bit-lean-offload"}
#: one name per preset of the core's table: "optstate_adamw" + "_" + the preset with "-" as "_"
NAMES = {"optstate_adamw" + ("" if preset == "default" else "_" + preset.replace("-", "_")): preset
         for preset in oc.PRESETS}
#: every AdamW name exists for lion-pytorch's Lion and schedulefree's AdamWScheduleFree too
NAMES.update({family + name[len("optstate_adamw"):]: preset for name, preset in list(NAMES.items())
              for family in ("optstate_lion", "optstate_schedule_free_adamw")})
#: AdamW's names + "_stream": the preset + "-stream" (stream_weights=True), but for schedule-free's -it24 presets
NAMES.update({name + "_stream": preset + "-stream" for name, preset in list(NAMES.items())
              if name.startswith("optstate_adamw") and not preset.endswith("-it24")})
PRESET_NAMES = sorted(NAMES)  # the names of the table's presets
NAMES["optstate_adamw_auto"] = "auto"  # the preset chosen per model (tests/integrations/test_hf_auto.py)


def test_names_map_to_core_presets():
    assert optstate_hf.OPTIM_NAMES == NAMES
    streamed = {p + "-stream" for p in oc.PRESETS if not p.endswith("-it24")}
    assert set(NAMES.values()) == set(oc.PRESETS) | streamed | {"auto"}
    assert {"optstate_adamw_stream", "optstate_adamw_bf16w_4bit_lean_stream",
            "optstate_adamw_bf16w_4bit_lean_offload_stream"} <= NAMES.keys()
    assert len(NAMES) == 3 * len(oc.PRESETS) + len(streamed) + 1
    assert HAND_LIST.items() <= NAMES.items()
    assert {"optstate_adamw_8bit_it24", "optstate_schedule_free_adamw_4bit_it24"} <= NAMES.keys()
    assert optstate_hf.is_registered()


def test_the_hooks_preset_names_are_the_core_table():
    """The .pth hook registers names before optstate_core can be imported, from its own tuple of the
    table's preset names: a preset added to the table must be added there too."""
    import optstate_hf_names

    assert list(optstate_hf_names.PRESET_NAMES) == list(oc.PRESETS)
    assert optstate_hf_names.OPTIM_NAMES == optstate_hf.OPTIM_NAMES
    assert optstate_hf_names.STREAM == oc.presets.STREAM_SUFFIX


@pytest.mark.parametrize("preset", sorted(oc.PRESETS))
def test_every_preset_has_a_name_that_builds_its_policy(tmp_path, preset):
    name = next(n for n, p in NAMES.items() if p == preset and n.startswith("optstate_adamw"))
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args(tmp_path, optim=name, optim_args=None))
    opt = cls([torch.nn.Parameter(torch.zeros(64, 64))], **kwargs)
    expected = oc.make_policy(preset)
    assert opt.policy.describe() == expected.describe()
    assert vars(opt.policy).keys() == vars(expected).keys()
    for key, value in vars(expected).items():
        if not key.startswith("_"):
            assert repr(getattr(opt.policy, key)) == repr(value), key


@pytest.mark.parametrize("name", sorted(NAMES))
def test_name_is_valid_and_serializes(tmp_path, name):
    args = TrainingArguments(str(tmp_path), optim=name, optim_args="state=int4", report_to=[])
    assert args.optim == name and isinstance(args.optim, OptimizerNames)
    assert args.to_dict()["optim"] == name
    assert json.loads(args.to_json_string())["optim"] == name
    assert pickle.loads(pickle.dumps(args)).optim is args.optim
    (parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", name, "--report_to", "none"])
    assert parsed.optim == name


def test_register_is_idempotent():
    members = list(OptimizerNames)
    optstate_hf.register()
    assert list(OptimizerNames) == members
    assert OptimizerNames("optstate_adamw") is OptimizerNames.OPTSTATE_ADAMW


def test_unknown_name_still_rejected(tmp_path):
    with pytest.raises(ValueError, match="optstate_adamw_2bit"):
        TrainingArguments(str(tmp_path), optim="optstate_adamw_2bit", report_to=[])


def test_transformers_without_the_dispatch_hook_gets_a_clear_error(monkeypatch):
    """A Trainer whose get_optimizer_cls_and_kwargs is no longer the static (args, model) method:
    register() names the hook and the fallback, and changes nothing."""
    members = list(OptimizerNames)
    wrapped = Trainer.__dict__["get_optimizer_cls_and_kwargs"]
    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", lambda self, args: None)
    with pytest.raises(optstate_hf.RegistrationError, match="get_optimizer_cls_and_kwargs.*optimizer_cls_and_kwargs"):
        optstate_hf.register()
    assert not optstate_hf.is_registered()
    assert list(OptimizerNames) == members
    monkeypatch.delattr(Trainer, "get_optimizer_cls_and_kwargs")
    with pytest.raises(optstate_hf.RegistrationError, match="NoneType"):
        optstate_hf.register()
    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", wrapped, raising=False)
    assert optstate_hf.is_registered()


def test_register_wraps_the_dispatch_once_and_passes_other_names_through(tmp_path):
    hook = Trainer.__dict__["get_optimizer_cls_and_kwargs"]
    original = hook.__func__.optstate_original
    assert not hasattr(original, "optstate_original")
    optstate_hf.register()
    assert Trainer.__dict__["get_optimizer_cls_and_kwargs"] is hook
    args = training_args(tmp_path, optim="adamw_torch", optim_args=None, learning_rate=3e-3)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert (cls, kwargs) == original(args)
    assert cls is torch.optim.AdamW and kwargs["lr"] == 3e-3


def test_trainer_subclasses_inherit_the_dispatch(tmp_path):
    class MyTrainer(Trainer):
        pass

    cls, kwargs = MyTrainer.get_optimizer_cls_and_kwargs(training_args(tmp_path, optim="optstate_adamw_4bit"))
    assert cls is optstate_hf.OptStateAdamW and kwargs["preset"] == "4bit"


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_handler_builds_preset_with_trainer_hyperparameters(tmp_path, name):
    args = training_args(tmp_path, optim=name, optim_args=None, learning_rate=2e-3, adam_beta1=0.8,
                         adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.05)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    family = {"optstate_lion": optstate_hf.OptStateLion, "optstate_schedule_free_adamw": optstate_hf.OptStateScheduleFreeAdamW}
    expected_cls = next((c for prefix, c in family.items() if name.startswith(prefix)), optstate_hf.OptStateAdamW)
    assert cls is expected_cls and issubclass(cls, torch.optim.Optimizer)
    assert (kwargs["lr"], kwargs["betas"], kwargs["weight_decay"]) == (2e-3, (0.8, 0.95), 0.05)
    assert kwargs.get("eps", 1e-6) == 1e-6 and ("eps" in kwargs) == (cls is not optstate_hf.OptStateLion)
    assert kwargs["preset"] == NAMES[name]
    if cls is not optstate_hf.OptStateAdamW:
        pytest.importorskip("lion_pytorch" if cls is optstate_hf.OptStateLion else "schedulefree")
    base, stream = oc.presets.split_stream(NAMES[name])  # a _stream name: the base's policy, streaming wanted
    expected = oc.make_policy(base)
    opt = cls([torch.nn.Parameter(torch.zeros(4))], **kwargs)
    assert opt.options.stream_weights == stream == name.endswith("_stream") and (opt.release_gradients or not stream)
    policy = opt.policy
    assert type(policy) is oc.WarmupPolicy
    assert policy.momentum_codec.name == expected.momentum_codec.name
    assert policy.variance_codec.name == expected.variance_codec.name
    assert policy.device_resident == expected.device_resident


def test_trainer_keeps_decay_grouping(tmp_path):
    trainer = make_trainer(tmp_path, weight_decay=0.07, learning_rate=1e-3, adam_beta1=0.85)
    opt = trainer.create_optimizer()
    assert isinstance(opt, oc.VirtualOptimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay = set(trainer.get_decay_parameter_names(trainer.model)) & set(names.values())  # lm_head is tied
    (g_decay, g_no) = opt.param_groups
    assert opt.param_groups is opt.optimizer.param_groups
    assert {names[id(p)] for p in g_decay["params"]} == decay
    assert g_decay["weight_decay"] == 0.07 and g_no["weight_decay"] == 0.0
    assert {names[id(p)] for p in g_no["params"]} == set(names.values()) - decay
    assert any("bias" in n or "ln" in n for n in (names[id(p)] for p in g_no["params"]))
    for g in opt.param_groups:
        assert g["lr"] == 1e-3 and g["betas"] == (0.85, 0.999)


def test_optim_args_are_typed():
    parsed = optstate_hf.parse_optim_args(
        "state=int4, momentum=int8,variance=bf16,offload=host,warmup_steps=7,adaptive=TRUE,patience=3,tol=0.01,"
        "min_int8_elements=0,chunk_bytes=1MB,chunk_size=4,stochastic_rounding=yes,seed=11")
    assert parsed.as_dict() == {"state": "int4", "momentum": "int8", "variance": "bf16", "offload": "host",
                                "warmup_steps": 7, "adaptive": True, "patience": 3, "tol": 0.01,
                                "min_int8_elements": 0, "chunk_bytes": "1MB", "chunk_size": 4,
                                "stochastic_rounding": True, "seed": 11}
    assert parsed.wrap_options() == {"chunk_bytes": "1MB", "chunk_size": 4, "seed": 11}
    policy = parsed.policy("default")
    assert isinstance(policy, oc.AdaptiveWarmupPolicy)
    assert (policy.warmup_steps, policy.patience, policy.tol, policy.min_int8_elements) == (7, 3, 0.01, 0)
    assert policy.momentum_codec.name == "int8" and policy.variance_codec.name == "bf16"
    assert policy.momentum_codec.stochastic_rounding and policy.variance_codec.stochastic_rounding
    assert policy.device_resident is False
    assert optstate_hf.parse_optim_args({"chunk_bytes": "4096"}).get("chunk_bytes") == 4096
    typed = optstate_hf.parse_optim_args({"state": "INT8", "warmup_steps": 3, "adaptive": True, "chunk_bytes": 2048})
    assert typed.as_dict() == {"state": "int8", "warmup_steps": 3, "adaptive": True, "chunk_bytes": 2048}
    # offload=none undoes the offload preset; state overrides the preset's codecs
    local = optstate_hf.parse_optim_args("offload=none,state=fp16").policy("offload")
    assert local.device_resident is None and local.variance_codec.name == "fp16"


@pytest.mark.parametrize("text, needle", [
    ("colour=red", "unknown key 'colour'"),
    ("state=int3", "state='int3' must be one of int8, int4, bf16, fp16, fp32"),
    ("offload=disk", "offload='disk' must be one of none, host"),
    ("warmup_steps=-1", "warmup_steps='-1' must be >= 0"),
    ("warmup_steps=1.5", "warmup_steps='1.5' must be an integer"),
    ("adaptive=maybe", "adaptive='maybe' must be true or false"),
    ("adaptive=true,warmup_steps=10,tol=2", "tol='2' must be in"),
    ("chunk_bytes=lots", "chunk_bytes='lots' must be a positive byte count"),
    ("chunk_bytes=0", "must be positive"),
    ("patience=3", "patience only apply with adaptive=true"),
    ("adaptive=true", "needs warmup_steps > 0"),
    ("state", "expected key=value"),
    ("seed=1,seed=2", "given twice"),
])
def test_bad_optim_args_list_valid_keys(text, needle):
    with pytest.raises(ValueError) as info:
        optstate_hf.parse_optim_args(text)
    message = str(info.value)
    assert needle in message
    assert "Valid keys: state, momentum, variance, offload" in message and "prefetch_during_backward" in message


def test_bad_optim_args_fail_at_optimizer_creation(tmp_path):
    trainer = make_trainer(tmp_path, optim_args="state=int8,colour=red")
    with pytest.raises(ValueError, match="unknown key 'colour'"):
        trainer.create_optimizer()
    assert trainer.optimizer is None


def test_bad_preset_rejected():
    with pytest.raises(ValueError, match="preset must be one of"):
        optstate_hf.OptStateAdamW([torch.nn.Parameter(torch.zeros(3))], preset="2bit")


def test_fallback_optimizer_cls_and_kwargs(tmp_path):
    args = training_args(tmp_path, optim="adamw_torch", optim_args=None, learning_rate=5e-3, max_steps=2)
    cls_kwargs = optstate_hf.optimizer_cls_and_kwargs(args, preset="4bit", optim_args="min_int8_elements=0")
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=tiny_dataset(16),
                      optimizer_cls_and_kwargs=cls_kwargs, callbacks=[optstate_hf.OptStateCallback()])
    trainer.train()
    opt = optstate_hf.find_virtual_optimizer(trainer.optimizer)
    assert opt is not None and opt.step_count == 2
    # min_int8_elements=0: every state int4 but the 1-D ones not a whole number of blocks (fp32 on any mesh)
    assert opt.memory_report()["by_codec"].keys() == {"int4", "fp32"}
    assert all(v.codec.name == "int4" for p, st in opt.state.items() if p.dim() == 2
               for k, v in st.items() if k.startswith("exp_avg"))
    assert opt.param_groups[0]["lr"] == 5e-3 and len(opt.param_groups) == 2


def test_release_bucket_bytes_reaches_the_optimizer():
    for text, want in (("0", 0), ("64MiB", 64 * 2**20)):
        parsed = optstate_hf.parse_optim_args(f"release_gradients=true,release_bucket_bytes={text}")
        opt = oc.wrap(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 4))]), "8bit", **parsed.wrap_options())
        assert opt._engine.clip_release.bucket_bytes == want
    with pytest.raises(ValueError, match="release_bucket_bytes='lots'"):
        optstate_hf.parse_optim_args("release_bucket_bytes=lots")
