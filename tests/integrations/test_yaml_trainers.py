"""docs/yaml-trainers.md's Axolotl and LLaMA-Factory YAML blocks, through the seam each tool calls:
read from the doc (so the doc and the test cannot drift), mapped onto TrainingArguments the way the
tool maps them, in a fresh interpreter whose only optstate code is the .pth hook; then a tiny Llama
trains 2 steps. Neither tool is installed here: what they do with the keys is written down below."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")

import optstate_hf_names  # noqa: E402
from test_hf_autoregister import HEAVY, fresh_env, run_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "yaml-trainers.md"


def yaml_block(heading: str) -> str:
    """The first fenced yaml block after ``## heading`` in the doc."""
    text = DOC.read_text()
    start = text.index(f"\n## {heading}\n")
    match = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M).search(text, start)
    assert match is not None, f"no yaml block under ## {heading} in {DOC}"
    return match.group(1)


# What the tools do with the keys (read in their sources; not their code):
# - Axolotl 0.19.0, core/builders/base.py (_configure_optimizer): an `optimizer` outside its own list
#   becomes TrainingArguments(optim=...); a mapping `optim_args` becomes "key=value" pairs joined by
#   commas (a string is passed as it is); micro_batch_size is per_device_train_batch_size. The modules of
#   `plugins:` (dotted path to a class) are imported in every process before the config is validated.
# - LLaMA-Factory 0.9.5, hparams/parser.py: every key goes to HfArgumentParser over its argument classes,
#   transformers' Seq2SeqTrainingArguments among them (parse_dict); the others are LLaMA-Factory's own.
SEAM = """
    import json, math, sys
    heavy_at_start = [m for m in {heavy!r} if m in sys.modules]
    import yaml
    out, blocks = sys.argv[1], json.loads(sys.argv[2])
    # both runs: CPU, 2 optimizer steps, no saving or reporting; the tools' models and data are not used
    run = dict(output_dir=out, max_steps=2, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
               logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)


    def axolotl_training_args():
        cfg = yaml.safe_load(blocks["axolotl"])
        for plugin in cfg.get("plugins") or []:
            import importlib
            module, _, cls = plugin.rpartition(".")
            getattr(importlib.import_module(module), cls)
        kwargs = dict(optim=cfg["optimizer"], learning_rate=float(cfg["learning_rate"]),
                      weight_decay=float(cfg.get("weight_decay", 0.0)),
                      per_device_train_batch_size=cfg["micro_batch_size"],
                      gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1))
        optim_args = cfg.get("optim_args")
        if isinstance(optim_args, dict):
            optim_args = ",".join(f"{{k}}={{v}}" for k, v in optim_args.items())
        if optim_args:
            kwargs["optim_args"] = optim_args
        from transformers import TrainingArguments
        return TrainingArguments(**kwargs, **run)


    def llamafactory_training_args():
        cfg = yaml.safe_load(blocks["llamafactory"])
        from transformers import HfArgumentParser, Seq2SeqTrainingArguments
        (args,) = HfArgumentParser(Seq2SeqTrainingArguments).parse_dict({{**cfg, **run}}, allow_extra_keys=True)
        return args


    import torch
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer
    import optstate_core as oc

    results = {{"heavy_at_start": heavy_at_start}}
    for tool, build in (("axolotl", axolotl_training_args), ("llamafactory", llamafactory_training_args)):
        args = build()
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        g = torch.Generator().manual_seed(0)
        rows = [{{"input_ids": ids, "labels": ids.clone()}} for ids in torch.randint(0, 64, (32, 16), generator=g)]
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        opt = oc.unwrap(trainer.optimizer)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        results[tool] = {{"optim": str(args.optim.value if hasattr(args.optim, "value") else args.optim),
                         "optim_args": args.optim_args, "virtual": opt is not None,
                         "steps": None if opt is None else opt.step_count,
                         "codecs": None if opt is None else sorted(opt.memory_report()["by_codec"]),
                         "losses": losses, "finite": all(math.isfinite(x) for x in losses)}}
    print(json.dumps(results))
"""


@pytest.mark.timeout(240)
def test_the_documented_yaml_configs_train_with_optstate(tmp_path):
    blocks = {"axolotl": yaml_block("Axolotl"), "llamafactory": yaml_block("LLaMA-Factory")}
    out = run_script(tmp_path, SEAM.format(heavy=HEAVY), fresh_env(tmp_path), str(tmp_path / "out"),
                     json.dumps(blocks))
    result = json.loads(out.strip().splitlines()[-1])
    assert result["heavy_at_start"] == []
    documented = {tool: yaml.safe_load(text) for tool, text in blocks.items()}
    assert result["axolotl"]["optim"] == documented["axolotl"]["optimizer"]
    assert result["llamafactory"]["optim"] == documented["llamafactory"]["optim"]
    axolotl_args = documented["axolotl"]["optim_args"]
    expected_args = {"axolotl": ",".join(f"{k}={v}" for k, v in axolotl_args.items()),
                     "llamafactory": documented["llamafactory"]["optim_args"]}
    for tool in blocks:
        run = result[tool]
        assert run["optim"] in optstate_hf_names.OPTIM_NAMES
        assert run["virtual"] and run["steps"] == 2 and len(run["losses"]) == 2 and run["finite"], (tool, run)
        assert run["optim_args"] == expected_args[tool], (tool, run)
        if "min_int8_elements=0" in expected_args[tool]:  # it reached the optimizer: the tiny model's tensors
            # (all under 4096 elements) are compressed, but for its 1-D norms of 32 (not whole 256-blocks: fp32)
            assert run["codecs"][0] == "fp32" and run["codecs"][1:] in (["int4"], ["int8"]), (tool, run)


# Substrings of the optimizer name that Axolotl's config validation tests (axolotl 0.19.0,
# utils/schemas/validation.py and utils/schemas/config.py), written down as facts:
AXOLOTL_REFUSES_WITH_FSDP1_OFFLOAD = "8bit"  # with fsdp_config.offload_params and fsdp_version != 2
AXOLOTL_REFUSES_ON_ASCEND_NPU = "bit"
AXOLOTL_OTHER_SUBSTRINGS = ("adopt",)  # a torch-version check
AXOLOTL_PREFIXES = ("flash_",)  # its flash optimizers' DeepSpeed/FSDP checks
# names refused by exact match: with FSDP2 and with tensor parallelism
AXOLOTL_EXACT = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit")


def test_axolotl_name_checks_and_the_doc_agree():
    names = set(optstate_hf_names.OPTIM_NAMES)
    assert not any(s in n for n in names for s in AXOLOTL_OTHER_SUBSTRINGS)
    assert not any(n.startswith(AXOLOTL_PREFIXES) for n in names) and not names & set(AXOLOTL_EXACT)
    doc = DOC.read_text()
    # the doc's examples of names refused with FSDP1 offload do contain the substring
    assert AXOLOTL_REFUSES_WITH_FSDP1_OFFLOAD in "optstate_adamw_8bit" and "`optstate_adamw_bf16w_8bit`" in doc
    # the names the doc offers for Ascend NPUs contain no "bit", and they are registered names
    npu = ["optstate_adamw", "optstate_adamw_offload"]
    assert all(f"`{n}`" in doc and n in names and AXOLOTL_REFUSES_ON_ASCEND_NPU not in n for n in npu)
    # the Axolotl block's name passes every check but the NPU one (it says 8bit on purpose)
    name = yaml.safe_load(yaml_block("Axolotl"))["optimizer"]
    assert name in names and not name.startswith(AXOLOTL_PREFIXES) and name not in AXOLOTL_EXACT
