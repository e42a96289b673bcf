"""The training config: defaults documented once, YAML overrides, type-checked key=value, clear errors."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from train.config import TrainConfig, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TRAINING_CONFIGS = ["smollm2_medusa.yaml", "smollm2_eagle.yaml", "smollm2_eagle3.yaml", "llama3_8b_eagle3_gpu.yaml"]


def test_every_field_has_an_inline_comment():
    source = inspect.getsource(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        line = next(ln for ln in source.splitlines() if ln.strip().startswith(f"{f.name}:"))
        assert "  # " in line, f"field {f.name} has no inline comment"


@pytest.mark.parametrize("name", TRAINING_CONFIGS)
def test_shipped_configs_load_and_hold_overrides_only(name):
    config = load_config(CONFIGS / name)
    raw = yaml.safe_load((CONFIGS / name).read_text())
    defaults = TrainConfig(data="x")
    # target and drafter may repeat a default: they say what the file is for.
    same = [k for k, v in raw.items() if k not in ("target", "drafter") and getattr(defaults, k) == v]
    assert not same, f"{name} repeats defaults: {same}"
    assert config.drafter in ("medusa", "eagle", "eagle3")


@pytest.mark.parametrize("name", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_deepspeed_accelerate_configs(name):
    raw = yaml.safe_load((CONFIGS / name).read_text())
    assert raw["distributed_type"] == "DEEPSPEED"
    assert raw["deepspeed_config"]["zero_stage"] == int(name[-6])


def test_yaml_then_cli_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("drafter: medusa\ndata: d.jsonl\nlr: 0.01\n")
    config = load_config(path, ["lr=2e-3", "max_steps=7", "group_by_length=false", "drafter_options={num_heads: 2}"])
    assert (config.drafter, config.lr, config.max_steps, config.group_by_length) == ("medusa", 2e-3, 7, False)
    assert config.drafter_options == {"num_heads": 2}


def test_unknown_key_names_close_matches(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: d.jsonl\nlearning_rate: 0.1\nbatchsize: 3\n")
    with pytest.raises(ValueError, match=r"unknown config key 'learning_rate'"):
        load_config(path)
    with pytest.raises(ValueError, match=r"'batch_size'"):
        load_config(None, ["data=d.jsonl", "batchsize=3"])


@pytest.mark.parametrize("override, match", [
    ("max_steps=ten", "expects int"),
    ("lr=fast", "expects float"),
    ("resume=maybe", "expects bool"),
    ("max_steps=1.5", "expects int"),
])
def test_overrides_are_type_checked(override, match):
    with pytest.raises(TypeError, match=match):
        load_config(None, ["data=d.jsonl", override])


@pytest.mark.parametrize("override, match", [
    ("drafter=hydra", "drafter"),
    ("loss=mse", "loss"),
    ("features=maybe", "features"),
    ("data=", "data"),
    ("lora_r=4", "medusa"),
    ("batch_size=0", "batch_size"),
])
def test_invalid_values(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, ["data=d.jsonl", override])


def test_missing_config_file():
    with pytest.raises(ValueError, match="does not exist"):
        load_config("nope.yaml")


def test_auto_mixed_precision_is_bf16_only_where_the_hardware_multiplies_bf16(monkeypatch):
    from train import train_heads

    monkeypatch.setattr(train_heads.torch.cuda, "is_available", lambda: False)
    for cpu_has_bf16, want in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(train_heads, "cpu_multiplies_bf16", lambda has=cpu_has_bf16: has)
        assert train_heads.resolve_mixed_precision("auto") == want
    for setting in ("no", "bf16", "fp16"):  # as asked
        assert train_heads.resolve_mixed_precision(setting) == setting
    monkeypatch.setattr(train_heads.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train_heads.torch.cuda, "is_bf16_supported", lambda: False)
    assert train_heads.resolve_mixed_precision("auto") == "no"
