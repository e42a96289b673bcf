"""EAGLE drafters' layer style (issue #51): a Llama decoder layer at the target's sizes for every target, or the
target's own layer class; both keep greedy output identical to the target's, for every architecture."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHITECTURES, greedy_reference, left_padded_prompts, tiny_config, tiny_model

import heads
from heads.layers import arch_classes, layer_config_dict, llama_layer_config_dict
from infer import SelfSpecModel

ARCHS = list(ARCHITECTURES)
_TARGETS: dict = {}


def target_for(arch: str):
    if arch not in _TARGETS:
        _TARGETS[arch] = tiny_model(arch)
    return _TARGETS[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_layer_config_carries_the_targets_sizes_and_rope(arch):
    config = tiny_config(arch)
    lc = llama_layer_config_dict(config)
    assert lc["model_type"] == "llama" and lc["num_hidden_layers"] == 1
    if arch == "llama":  # a Llama target's own layer: the two styles coincide
        assert lc == layer_config_dict(config)
        return
    heads_ = config.num_attention_heads
    assert lc["hidden_size"] == config.hidden_size == 32 and lc["num_attention_heads"] == heads_
    assert lc["num_key_value_heads"] == (getattr(config, "num_key_value_heads", None) or heads_)
    assert lc["head_dim"] == (getattr(config, "head_dim", None) or 32 // heads_)
    assert lc["intermediate_size"] == (getattr(config, "intermediate_size", None) or 4 * 32)
    assert lc["max_position_embeddings"] == 256 and lc["hidden_act"] == "silu"
    rope = lc["rope_parameters"]
    theta = {"gemma3_text": 1e6, "gpt2": 10000.0}.get(arch) or config.rope_parameters["rope_theta"]
    assert rope == {"rope_type": "default", "rope_theta": theta}  # full-attention RoPE, no partial rotary factor
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or config.layer_norm_epsilon
    assert lc["rms_norm_eps"] == pytest.approx(eps)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("style", ["llama", "target"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_the_targets_with_either_layer_style(arch, style, kind):
    target = target_for(arch)
    torch.manual_seed(0)
    drafter = heads.build(kind, target, layer_style=style)
    layer = type(drafter.layers[0]).__name__
    if style == "llama":
        assert layer == "LlamaDecoderLayer"
        assert kind == "eagle" or drafter.config.input_mode == "widen"  # every target exports
    else:
        assert layer == arch_classes(arch).layer.__name__
    with torch.no_grad():  # a trained-looking drafter: weights away from their initial values
        g = torch.Generator().manual_seed(1)
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ids, mask = left_padded_prompts()
    expected = greedy_reference(target, ids, mask, 16)
    got = SelfSpecModel(target, drafter, tree={"depth": 3, "top_k": 3, "total_tokens": 8}).generate(
        ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(got, expected)


def test_default_is_llama_and_saved_drafters_keep_their_style(tmp_path):
    from heads.eagle.config import DEFAULT_LAYER_STYLE

    target = target_for("qwen3")
    drafter = heads.build("eagle3", target)
    assert DEFAULT_LAYER_STYLE == "llama" and drafter.config.layer_style == "llama"
    drafter.save_pretrained(tmp_path / "llama")
    assert heads.load(tmp_path / "llama").config.layer_style == "llama"
    own = heads.build("eagle3", target, layer_style="target")
    own.save_pretrained(tmp_path / "target")
    loaded = heads.load(tmp_path / "target")
    assert loaded.config.layer_style == "target" and type(loaded.layers[0]).__name__ == "Qwen3DecoderLayer"


@pytest.mark.parametrize(("style", "expected"), [("target", "Qwen3DecoderLayer"), ("llama", "LlamaDecoderLayer")])
def test_a_drafter_saved_before_layer_style_reads_it_from_its_layer_config(tmp_path, style, expected):
    heads.build("eagle3", target_for("qwen3"), layer_style=style).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    del config["layer_style"]
    path.write_text(json.dumps(config))
    loaded = heads.load(tmp_path)
    assert loaded.config.layer_style == style and type(loaded.layers[0]).__name__ == expected


def test_bad_layer_styles_are_named():
    config = target_for("qwen3").config
    with pytest.raises(ValueError, match=r"layer_style must be one of \('llama', 'target'\), got 'qwen'"):
        heads.build("eagle3", config, layer_style="qwen")
    qwen_layer = layer_config_dict(config)
    with pytest.raises(ValueError, match="layer_style='llama' needs a layer_config of model_type 'llama', got 'qwen3'"):
        heads.build("eagle", config, layer_style="llama", layer_config=qwen_layer)
    with pytest.raises(ValueError, match="layer_style='target' needs a layer_config of model_type 'qwen3', got 'llama'"):
        heads.build("eagle3", config, layer_style="target", layer_config=llama_layer_config_dict(config))


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gpt2"])
def test_llama_style_drafters_run_the_lean_cpu_forward(arch):
    """The lean forward (infer/cpu) reads Llama layers and Qwen3's: with the Llama style it serves targets of other
    architectures too (not Gemma's, whose scaled embedding module it does not read)."""
    from heads.eagle3.lean import why_not

    assert why_not(heads.build("eagle3", target_for(arch), layer_style="llama")) is None
    own_style = why_not(heads.build("eagle3", target_for(arch), layer_style="target"))
    assert own_style is None if arch == "qwen3" else own_style is not None


@pytest.mark.parametrize(("arch", "overrides"), [
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 64}}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("gemma3_text", {"num_hidden_layers": 6}),  # layer 6 is full attention: its RoPE (theta 1e6), not the sliding one's
    ("phi3", {}),
])
def test_the_llama_layer_rotates_as_the_targets_full_attention_layers(arch, overrides):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()
    drafter = heads.build("eagle3", target, layer_style="llama")
    x, positions = torch.zeros(1, 5, 32), torch.tensor([[0, 3, 17, 100, 200]])
    kwargs = {"layer_type": "full_attention"} if arch == "gemma3_text" else {}
    for ours, theirs in zip(drafter.rotary_emb(x, positions), target.model.rotary_emb(x, positions, **kwargs),
                            strict=True):
        torch.testing.assert_close(ours, theirs)
