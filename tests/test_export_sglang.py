"""EAGLE-3 exported for SGLang (heads.export.export_sglang), checked against SGLang's own loader code.

SGLang has no CPU build here, so nothing runs SGLang. What is checked instead, from SGLang's source
(python/sglang/srt/models/llama_eagle3.py, `LlamaForCausalLMEagle3`, and the EAGLE-3 capture code in
model_runner.py / llama.py / qwen3.py, `set_eagle3_layers_to_capture`):

- the parameters SGLang builds for the exported config (names and shapes, `SGLANG_PARAMS` below) and its
  `load_weights` name mapping (q/k/v and gate/up fused, a `model.` prefix added, `d2t` made into
  `hot_token_id`, `t2d` skipped, any other unknown name skipped silently): every tensor we write lands on a
  parameter of the right shape, and every parameter but the shared embedding is loaded;
- SGLang's forward, written here from that file in plain torch (`sglang_forward`), run on the loaded weights:
  its hidden states, logits and a 3-token greedy draft chain equal our drafter's on fixed inputs;
- re-reading the export (heads.load, through heads.formats' SpecForge reader) gives back identical weights.

Not checked: SGLang's kernels, CUDA graphs, tree drafting and the target side (which layers a given target
class captures beyond the shared `layers_to_capture` convention).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from safetensors.torch import load_file
from transformers import DynamicCache

import heads
from heads.export import export, export_sglang, import_sglang

ROOT = Path(__file__).resolve().parent.parent
FEATURES = [3, 1, 2]  # out of order on purpose: SGLang concatenates captured layers in ascending order
_TARGETS: dict = {}


def target_for(arch: str):
    if arch not in _TARGETS:
        _TARGETS[arch] = tiny_model(arch)
    return _TARGETS[arch]


def trained_looking(drafter, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return drafter


def sglang_params(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters SGLang's LlamaForCausalLMEagle3 creates for `config` (one layer, untied lm_head)."""
    d, heads_, kv, hd = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    ffn, target_d = config["intermediate_size"], config.get("target_hidden_size", d)
    params = {
        "model.embed_tokens.weight": (config["vocab_size"], d),
        "model.fc.weight": (d, 3 * target_d),
        "model.midlayer.self_attn.qkv_proj.weight": ((heads_ + 2 * kv) * hd, 2 * d),
        "model.midlayer.self_attn.o_proj.weight": (d, heads_ * hd),
        "model.midlayer.mlp.gate_up_proj.weight": (2 * ffn, d),
        "model.midlayer.mlp.down_proj.weight": (d, ffn),
        "model.midlayer.input_layernorm.weight": (d,),
        "model.midlayer.hidden_norm.weight": (d,),
        "model.midlayer.post_attention_layernorm.weight": (d,),
        "model.norm.weight": (d,),
        "lm_head.weight": (config["draft_vocab_size"], d),
    }
    if config.get("bias"):
        params["model.fc.bias"] = (d,)
    # its Llama attention reads `bias` too (models/llama.py: attention_bias = config.attention_bias or config.bias,
    # bias_o_proj = attention_bias); llama_eagle3.py rebuilds qkv_proj without a bias but keeps o_proj's
    if config.get("bias") or config.get("attention_bias"):
        params["model.midlayer.self_attn.o_proj.bias"] = (d,)
    return params


STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def sglang_load(config: dict, tensors: dict[str, torch.Tensor]):
    """SGLang's load_weights over our tensors: (loaded parameters, hot_token_id, names it skipped)."""
    params = sglang_params(config)
    shards: dict[str, dict] = {}
    loaded, hot, skipped = {}, None, []
    for name, w in tensors.items():
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for fused, part, shard in STACKED:
            if part in name:
                key = name.replace(part, fused)
                key = key if key in params else f"model.{key}"
                if key in params:
                    shards.setdefault(key, {})[shard] = w
                else:
                    skipped.append(name)
                break
        else:
            key = name if name in params else f"model.{name}"
            if key in params:
                loaded[key] = w
            else:
                skipped.append(name)
    for key, parts in shards.items():
        order = ["q", "k", "v"] if "qkv" in key else [0, 1]
        if set(parts) == set(order):
            loaded[key] = torch.cat([parts[s] for s in order], dim=0)
    return loaded, hot, skipped


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    # x: [T, H, hd]; rotate-half ("neox") layout, as SGLang's get_rope for Llama
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions[:, None].float() * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def sglang_forward(w: dict, config: dict, embed_weight, ids, h):
    """SGLang's LlamaForCausalLMEagle3 over one sequence (full causal recompute): ids [T], h [T, D] (the fc output
    or the draft's own fed-back hidden state) -> (aux hidden [T, D], draft logits [T, Vd])."""
    d, heads_, kv, hd = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    eps, t = config["rms_norm_eps"], ids.shape[0]
    p = "model.midlayer."
    embeds = embed_weight[ids]  # SGLang shares the target's embedding weight (set_embed): no model-side scaling
    residual = h
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"], eps), rms(h, w[p + "hidden_norm.weight"], eps)], -1)
    q, k, v = (x @ w[p + "self_attn.qkv_proj.weight"].T).split([heads_ * hd, kv * hd, kv * hd], -1)
    positions = torch.arange(t)
    q = rope(q.view(t, heads_, hd), positions, config["rope_theta"])
    k = rope(k.view(t, kv, hd), positions, config["rope_theta"]).repeat_interleave(heads_ // kv, 1)
    v = v.view(t, kv, hd).repeat_interleave(heads_ // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads_ * hd)
    attn = attn @ w[p + "self_attn.o_proj.weight"].T
    residual = attn + residual  # post_attention_layernorm(hidden, residual): add, then norm
    gate, up = (rms(residual, w[p + "post_attention_layernorm.weight"], eps) @ w[p + "mlp.gate_up_proj.weight"].T
                ).chunk(2, -1)
    out = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    aux = out + residual  # norm(hidden, residual): add, then norm; the sum is what the next draft step reads
    return aux, rms(aux, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


ARCHS = ["llama", "qwen3", "gemma3_text", "phi3", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_sglang_loads_every_tensor_and_computes_our_drafts(arch, tmp_path):
    target = target_for(arch)
    drafter = trained_looking(heads.build("eagle3", target, feature_layers=FEATURES, draft_vocab_size=64))
    d2t, t2d = heads.build_vocab_map(torch.arange(96).flip(0) % 7, 64)  # a non-trivial draft vocabulary
    drafter.set_vocab_map(d2t, t2d)
    export_sglang(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False and config["bias"] is False
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] == 96 and config["target_hidden_size"] == 32
    assert config["hidden_act"] == "silu" and config["attention_bias"] is False
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert config["rope_theta"] == drafter.config.layer_config["rope_parameters"]["rope_theta"]
    tensors = load_file(tmp_path / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool

    loaded, hot, skipped = sglang_load(config, tensors)
    assert skipped == []
    expected = sglang_params(config)
    assert sorted(loaded) == sorted(set(expected) - {"model.embed_tokens.weight"})
    assert {k: tuple(v.shape) for k, v in loaded.items()} == {k: expected[k] for k in loaded}
    assert torch.equal(hot, torch.arange(64) + d2t)

    # the same function: a prompt's features, then a greedy chain of 3 drafts fed back as SGLang does
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = target(ids, output_hidden_states=True).hidden_states
        fused = drafter.fuse_features(tuple(features[i] for i in drafter.feature_layers))
        cache = DynamicCache()
        ours_h, ours_logits = drafter(ids, fused, past_key_values=cache, fused=True)
        seq_ids, seq_h = ids[0], fused[0] @ drafter.fc.weight.T
        their_h, their_logits = sglang_forward(loaded, config, target.get_input_embeddings().weight, seq_ids, seq_h)
        torch.testing.assert_close(their_h, ours_h[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(their_logits, ours_logits[0], rtol=1e-4, atol=1e-5)
        our_chain, their_chain = [], []
        our_token, their_token = ours_logits[0, -1].argmax(), their_logits[-1].argmax()
        our_last, their_last = ours_h[0, -1], their_h[-1]
        for _ in range(3):  # each draft goes in at the next position with the previous step's hidden state
            our_id, their_id = drafter.draft_to_target(our_token), hot[their_token]
            our_chain.append(int(our_id))
            their_chain.append(int(their_id))
            h, logits = drafter(our_id.view(1, 1), our_last.view(1, 1, -1), past_key_values=cache, fused=False)
            our_last, our_token = h[0, -1], logits[0, -1].argmax()
            seq_ids, seq_h = torch.cat([seq_ids, their_id.view(1)]), torch.cat([seq_h, their_last.view(1, -1)])
            their_h, their_logits = sglang_forward(loaded, config, target.get_input_embeddings().weight, seq_ids,
                                                   seq_h)
            their_last, their_token = their_h[-1], their_logits[-1].argmax()
            torch.testing.assert_close(their_logits[-1], logits[0, -1], rtol=1e-4, atol=1e-5)
    assert their_chain == our_chain


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_reimport_gives_identical_weights(arch, tmp_path):
    """Read back by heads.load, through heads.formats' SpecForge reader (the import side of issue #51)."""
    target = target_for(arch)
    drafter = trained_looking(heads.build("eagle3", target, feature_layers=[1, 2, 3]))
    export(drafter, tmp_path, format="sglang")
    assert heads.imported_format(tmp_path).name == "specforge"
    again = heads.load(tmp_path, target=target)
    assert torch.equal(import_sglang(tmp_path, target=target).fc.weight, again.fc.weight)
    ours, theirs = drafter.state_dict(), again.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    assert list(again.config.feature_layers) == [1, 2, 3]


def test_reimport_of_layers_given_out_of_order_drafts_the_same(tmp_path):
    """SGLang concatenates captured layers in ascending order, so the export reorders fc's column blocks; the
    re-import reads the layers ascending with the blocks as written: the same weights, permuted, and the same
    drafts."""
    target = target_for("qwen3")
    drafter = trained_looking(heads.build("eagle3", target, feature_layers=FEATURES))
    export(drafter, tmp_path, format="sglang")
    again = heads.load(tmp_path, target=target).attach(target)
    assert list(again.config.feature_layers) == [1, 2, 3]
    d = 32
    blocks = dict(zip(FEATURES, drafter.fc.weight.split(d, dim=1), strict=True))
    assert torch.equal(again.fc.weight, torch.cat([blocks[i] for i in (1, 2, 3)], dim=1))
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        ours = drafter.attach(target)(ids, drafter.fuse_features(tuple(hidden[i] for i in drafter.feature_layers)))
        theirs = again(ids, again.fuse_features(tuple(hidden[i] for i in again.feature_layers)))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the same sums in another order


@pytest.mark.parametrize(("arch", "options", "message"), [
    ("qwen3", {"layer_style": "target"}, r"q_norm.*layer_style='llama'"),
    ("gemma2", {"layer_style": "target"}, "no 'project' input mode"),
    ("qwen2", {"layer_style": "target"}, "have no bias"),
    ("llama", {"num_layers": 2}, "num_layers=2"),
    ("llama", {"norm_before_residual": True}, "norm_before_residual=True"),
    ("llama", {"feature_layers": [1, 2]}, "reads exactly 3 target layers"),
    ("llama", {"feature_layers": [0, 1, 2]}, r"outside that range: \[0\]"),
    ("llama", {"feature_layers": [1, 2, 4]}, r"outside that range: \[4\]"),
    ("llama", {"feature_layers": [1, 2, 2]}, "repeated layers"),
    ("llama", {"fc_bias": True}, r"also reads as attention_bias .* fc_bias=True"),
    ("llama", {"norm_before_fc": True}, r"speculators' options .*norm_before_fc=True"),
    ("llama", {"norm_output": True}, r"speculators' options .*norm_output=True"),
    ("llama", {"layer_windows": [4]}, r"speculators' options .*layer_windows=\[4\]"),
])
def test_what_sglang_computes_differently_is_refused(arch, options, message, tmp_path):
    options = {"feature_layers": FEATURES, **options}
    with pytest.raises(ValueError, match=message):
        export_sglang(heads.build("eagle3", target_for(arch).config, **options), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_export_by_format_name():
    config = target_for("llama").config
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export(heads.build("eagle3", config), "unused", format="onnx")
    with pytest.raises(ValueError, match="drafter kind 'medusa' does not export to 'sglang'"):
        export(heads.build("medusa", config), "unused", format="sglang")
    with pytest.raises(ValueError, match="drafter kind 'eagle' does not export to 'speculators'; its formats: none"):
        export(heads.build("eagle", config), "unused", format="speculators")


def test_export_script_writes_the_sglang_format(tmp_path):
    drafter = heads.build("eagle3", target_for("qwen3").config, feature_layers=FEATURES)
    drafter.save_pretrained(tmp_path / "drafter")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), str(tmp_path / "drafter"),
                          str(tmp_path / "sglang"), "--format", "sglang"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "sglang" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
