"""Tiny drafter checkpoints written the way other projects write theirs, for the tiny Llama target.

Each writer produces the files, config fields and weight names its project's own code writes (read from their
source; see heads/formats/<format>.py for what each one holds), filled with random weights, and returns the weights
under the project's own names so a test can compute with them independently of selfspec's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import tiny_model
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

TARGET_LAYERS = 8  # EAGLE-3's default layers (2, L//2, L-3) must be distinct: a 4-layer target has only two
FORMATS = ["eagle_authors", "eagle1_authors", "specforge", "speculators", "medusa_fd", "dflash_zlab"]


def target_model(**overrides):
    return tiny_model("llama", **{"num_hidden_layers": TARGET_LAYERS, **overrides})


def _randn(g, *shape, scale=0.3):
    return torch.randn(*shape, generator=g) * scale


def _norm(g, d):
    return 1 + _randn(g, d, scale=0.1)


def draft_vocab_map(vocab: int, draft_vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's map for a random subset of target ids: d2t[i] = target id - i (ids ascending), t2d marks them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab), t2d


def llama_eagle3_weights(target, draft_vocab: int, prefix: str, seed: int, head_dim: int) -> dict[str, torch.Tensor]:
    """An EAGLE-3 Llama layer's weights: `fc`, `<prefix>self_attn.*` over 2D inputs, `<prefix>mlp.*`, the three
    layer norms (hidden_norm under `hidden_norm_key`), `norm`, `lm_head`, `d2t`, `t2d`."""
    c = target.config
    d, i, h, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = draft_vocab_map(c.vocab_size, draft_vocab, seed)
    return {
        "fc.weight": _randn(g, d, 3 * d, scale=0.15),
        f"{prefix}self_attn.q_proj.weight": _randn(g, h * head_dim, 2 * d),
        f"{prefix}self_attn.k_proj.weight": _randn(g, kv * head_dim, 2 * d),
        f"{prefix}self_attn.v_proj.weight": _randn(g, kv * head_dim, 2 * d),
        f"{prefix}self_attn.o_proj.weight": _randn(g, d, h * head_dim),
        f"{prefix}mlp.gate_proj.weight": _randn(g, i, d),
        f"{prefix}mlp.up_proj.weight": _randn(g, i, d),
        f"{prefix}mlp.down_proj.weight": _randn(g, d, i),
        f"{prefix}input_layernorm.weight": _norm(g, d),
        f"{prefix}hidden_norm.weight": _norm(g, d),
        f"{prefix}post_attention_layernorm.weight": _norm(g, d),
        "norm.weight": _norm(g, d),
        "lm_head.weight": _randn(g, draft_vocab, d, scale=1.0),
        "d2t": d2t, "t2d": t2d,
    }


def write_eagle_authors(folder, target, draft_vocab: int = 48, seed: int = 0) -> dict:
    """SafeAILab/EAGLE's EAGLE-3: their training's config.json (a Llama config with draft_vocab_size) and
    `pytorch_model.bin`, the half-precision state dict `save_16bit_model(exclude_frozen_parameters=True)` writes
    (no embedding: it is frozen)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = target.config
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
              "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "pad_token_id": 0,
              "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": c.vocab_size,
              "draft_vocab_size": draft_vocab}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: (v.half() if v.is_floating_point() else v)
               for k, v in llama_eagle3_weights(target, draft_vocab, "midlayer.", seed,
                                                c.hidden_size // c.num_attention_heads).items()}
    torch.save(weights, folder / "pytorch_model.bin")
    return {"config": config, "weights": weights, "layers": [2, 4, 5], "rope_theta": 10000.0, "eps": 1e-5,
            "prefix": "midlayer.", "hidden_norm": "midlayer.hidden_norm.weight", "norm_before_residual": False}


def write_eagle1_authors(folder, target, seed: int = 5, layout: str = "llama3") -> dict:
    """SafeAILab/EAGLE's EAGLE-1/2 drafter as its training writes it (eagle/train/main.py; the layer of
    eagle/model/cnets1.py at commit cb7e084): a one-layer Llama config and `pytorch_model.bin` with `fc` over
    [embedding, feature], `layers.0.*` without `input_layernorm`, and a copy of the target's `embed_tokens.weight`
    (saved in fp32). Layouts: "llama3" is yuhuili/EAGLE-LLaMA3-Instruct-8B's (config from eagle/train/
    EAGLE-LLaMA3-Instruct-8B: `bias: false`, rope_theta 500000, grouped KV heads), "vicuna" yuhuili/EAGLE-Vicuna-7B-
    v1.3's (no `bias` key, so fc has one; no rope_theta), "qwen2" their Qwen2 drafters' (`qkv_bias: true`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = target.config
    d, i, h, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": d, "initializer_range": 0.02, "intermediate_size": i, "max_position_embeddings": 2048,
              "model_type": "llama", "num_attention_heads": h, "num_hidden_layers": 1, "pad_token_id": 0,
              "rms_norm_eps": 1e-05 if layout == "llama3" else 1e-06, "tie_word_embeddings": False,
              "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": c.vocab_size}
    if layout == "llama3":
        config.update(num_key_value_heads=kv, rope_theta=500000.0, bias=False)
    if layout == "qwen2":
        config.update(num_key_value_heads=kv, rope_theta=1000000.0, qkv_bias=True)
    kv = config.get("num_key_value_heads", h)
    hd = d // h
    g = torch.Generator().manual_seed(seed)
    p = "layers.0."
    weights = {"embed_tokens.weight": target.get_input_embeddings().weight.detach().float().clone(),
               "fc.weight": _randn(g, d, 2 * d, scale=0.2),
               p + "self_attn.q_proj.weight": _randn(g, h * hd, d), p + "self_attn.k_proj.weight": _randn(g, kv * hd, d),
               p + "self_attn.v_proj.weight": _randn(g, kv * hd, d), p + "self_attn.o_proj.weight": _randn(g, d, h * hd),
               p + "mlp.gate_proj.weight": _randn(g, i, d), p + "mlp.up_proj.weight": _randn(g, i, d),
               p + "mlp.down_proj.weight": _randn(g, d, i), p + "post_attention_layernorm.weight": _norm(g, d)}
    if config.get("bias", True):
        weights["fc.bias"] = _randn(g, d, scale=0.1)
    if layout == "qwen2":
        weights.update({p + "self_attn.q_proj.bias": _randn(g, h * hd), p + "self_attn.k_proj.bias": _randn(g, kv * hd),
                        p + "self_attn.v_proj.bias": _randn(g, kv * hd)})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(weights, folder / "pytorch_model.bin")
    return {"config": config, "weights": weights, "rope_theta": config.get("rope_theta", 10000.0),
            "eps": config["rms_norm_eps"]}


def write_specforge(folder, target, draft_vocab: int = 48, seed: int = 1, aux_layer_ids=(4, 0, 2),
                    embedding: torch.Tensor | None = None, **config_extra) -> dict:
    """SpecForge's LlamaForCausalLMEagle3 as `save_pretrained` writes it (its to_hf export): the LlamaConfig with
    architectures, draft_vocab_size and eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's ids: the output of
    layer i), and a bfloat16 `model.safetensors` including the frozen `embed_tokens.weight`."""
    folder = Path(folder)
    c = target.config
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}} if aux_layer_ids else {}
    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, num_hidden_layers=1, vocab_size=c.vocab_size,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=500000.0, dtype="bfloat16",
                         draft_vocab_size=draft_vocab, **extra, **config_extra)
    config.save_pretrained(folder)
    weights = llama_eagle3_weights(target, draft_vocab, "midlayer.", seed, config.head_dim)
    weights["embed_tokens.weight"] = (embedding if embedding is not None
                                      else target.get_input_embeddings().weight.detach())
    weights = {k: (v.bfloat16() if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    layers = [i + 1 for i in aux_layer_ids] if aux_layer_ids else [2, 4, 5]
    return {"config": json.loads((folder / "config.json").read_text()), "weights": weights, "layers": layers,
            "rope_theta": 500000.0, "eps": 1e-6, "prefix": "midlayer.", "hidden_norm": "midlayer.hidden_norm.weight",
            "norm_before_residual": False}


def write_speculators(folder, target, draft_vocab: int = 48, seed: int = 2, verifier: str | None = None,
                      embedding: torch.Tensor | None = None, aux_layer_ids=(2, 4, 6), norm_before_fc: bool = False,
                      norm_output: bool = False, window: int | None = None) -> dict:
    """speculators' Eagle3Speculator as its `save_pretrained` writes it: the pydantic config (speculators_model_type,
    transformer_layer_config as a diff dict, speculators_config with the verifier) and `model.safetensors` with
    `layers.0.*` (hidden_norm inside the first layer) and the embedding (not among its keys ignored on save).
    norm_before_residual is true here, the residual being the normed hidden state. With `norm_before_fc` the file
    holds `input_norm.weight` over the 3D concatenated features; `window` makes the layer a sliding-window one
    (`layer_types`, `sliding_window`), as speculators 0.9.0's training does by default; a draft vocabulary of the
    whole vocabulary writes no d2t/t2d (`speculators/model.py`'s DraftVocabMixin saves none then)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = target.config
    sliding = {} if window is None else {"layer_types": ["sliding_attention"], "sliding_window": window,
                                         "use_sliding_window": True}
    layer = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        num_hidden_layers=1, vocab_size=c.vocab_size, max_position_embeddings=2048, rms_norm_eps=1e-5,
                        rope_theta=20000.0, **sliding).to_diff_dict()
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "norm_before_residual": True,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "norm_before_fc": norm_before_fc, "fc_norm": False, "norm_output": norm_output, "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = llama_eagle3_weights(target, draft_vocab, "layers.0.", seed, c.hidden_size // c.num_attention_heads)
    if norm_before_fc:
        weights["input_norm.weight"] = _norm(torch.Generator().manual_seed(seed + 100), 3 * c.hidden_size)
    if draft_vocab == c.vocab_size:
        del weights["d2t"], weights["t2d"]
    weights["embed_tokens.weight"] = (embedding if embedding is not None
                                      else target.get_input_embeddings().weight.detach()).clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return {"config": config, "weights": weights, "layers": list(aux_layer_ids), "rope_theta": 20000.0, "eps": 1e-5,
            "prefix": "layers.0.", "hidden_norm": "layers.0.hidden_norm.weight", "norm_before_residual": True,
            "norm_before_fc": norm_before_fc, "norm_output": norm_output, "window": window}


def write_speculators_defaults(folder, target, **changes) -> dict:
    """What speculators 0.9.0's `speculators train` writes with its defaults for EAGLE-3 (`train/config/schema.py`:
    norm_before_fc, norm_output and norm_before_residual on, every draft layer a sliding-window one, the layers
    listed as given), at reduced size: the window is 4 positions so that it cuts into the tests' prompts, the layers
    are listed out of order, and the draft vocabulary is the whole one (no d2t/t2d)."""
    options = {"norm_before_fc": True, "norm_output": True, "window": 4, "aux_layer_ids": (6, 2, 4),
               "draft_vocab": target.config.vocab_size, **changes}
    return write_speculators(folder, target, **options)


class _MedusaConfig(PretrainedConfig):
    """The fields of Medusa's MedusaConfig (a plain PretrainedConfig subclass), so save_pretrained writes what
    theirs writes."""

    def __init__(self, medusa_num_heads=4, medusa_num_layers=1, version="2",
                 base_model_name_or_path="lmsys/vicuna-7b-v1.3", **kwargs):
        super().__init__(**kwargs)
        self.medusa_num_heads = medusa_num_heads
        self.medusa_num_layers = medusa_num_layers
        self.version = version
        self.base_model_name_or_path = base_model_name_or_path


class _ResidualBlock(nn.Module):  # Medusa's layout: the Linear under `.linear`
    def __init__(self, d):
        super().__init__()
        self.linear = nn.Linear(d, d)


def write_medusa_fd(folder, target, num_heads: int = 3, num_layers: int = 1, seed: int = 3, pt: bool = False,
                    base_model: str = "lmsys/vicuna-7b-v1.3") -> dict:
    """FasterDecoding/Medusa: the MedusaConfig saved by its training script, and the state dict of its
    `medusa_head` ModuleList (head i = Sequential([ResBlock] * num_layers, Linear(D, V, bias=False)): one block
    module repeated) in `medusa_lm_head.safetensors`, or `medusa_lm_head.pt` (torch.save) as its loaders read."""
    folder = Path(folder)
    c = target.config
    _MedusaConfig(medusa_num_heads=num_heads, medusa_num_layers=num_layers,
                  base_model_name_or_path=base_model).save_pretrained(folder)
    torch.manual_seed(seed)
    medusa_head = nn.ModuleList(
        nn.Sequential(*([_ResidualBlock(c.hidden_size)] * num_layers), nn.Linear(c.hidden_size, c.vocab_size, bias=False))
        for _ in range(num_heads))
    with torch.no_grad():
        for p in medusa_head.parameters():
            p.normal_(0, 0.3)
    state = medusa_head.state_dict()
    if pt:
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "medusa_lm_head.safetensors")
    return {"config": json.loads((folder / "config.json").read_text()), "weights": state, "num_layers": num_layers}


def write_dflash_zlab(folder, target, block_size: int = 4, num_layers: int = 2, seed: int = 4,
                      target_layer_ids=(1, 5, 3), mask_token_id: int = 95) -> dict:
    """z-lab's DFlashDraftModel as `save_pretrained` writes it: its Qwen3Config with architectures, auto_map,
    block_size, num_target_layers and dflash_config {mask_token_id, target_layer_ids}, and `model.safetensors`
    (fc, hidden_norm, norm, layers.N.* with q/k norms; no embedding or lm_head)."""
    folder = Path(folder)
    c = target.config
    d, i, h, kv, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, 8
    dflash_config = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
    config = Qwen3Config(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                         hidden_size=d, intermediate_size=i, num_hidden_layers=num_layers, num_attention_heads=h,
                         num_key_value_heads=kv, head_dim=hd, vocab_size=c.vocab_size, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, block_size=block_size,
                         num_target_layers=c.num_hidden_layers, dflash_config=dflash_config, dtype="bfloat16")
    config.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    n_features = len(target_layer_ids) if target_layer_ids is not None else num_layers
    weights = {"fc.weight": _randn(g, d, n_features * d, scale=0.15), "hidden_norm.weight": _norm(g, d),
               "norm.weight": _norm(g, d)}
    for n in range(num_layers):
        p = f"layers.{n}."
        weights.update({
            p + "self_attn.q_proj.weight": _randn(g, h * hd, d), p + "self_attn.k_proj.weight": _randn(g, kv * hd, d),
            p + "self_attn.v_proj.weight": _randn(g, kv * hd, d), p + "self_attn.o_proj.weight": _randn(g, d, h * hd),
            p + "self_attn.q_norm.weight": _norm(g, hd), p + "self_attn.k_norm.weight": _norm(g, hd),
            p + "mlp.gate_proj.weight": _randn(g, i, d), p + "mlp.up_proj.weight": _randn(g, i, d),
            p + "mlp.down_proj.weight": _randn(g, d, i), p + "input_layernorm.weight": _norm(g, d),
            p + "post_attention_layernorm.weight": _norm(g, d)})
    weights = {k: v.bfloat16().contiguous() for k, v in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return {"config": json.loads((folder / "config.json").read_text()), "weights": weights}


WRITERS = {"eagle_authors": write_eagle_authors, "eagle1_authors": write_eagle1_authors,
           "specforge": write_specforge, "speculators": write_speculators,
           "medusa_fd": write_medusa_fd, "dflash_zlab": write_dflash_zlab}


# ---- published checkpoints' layouts: their config keys and tensor names, at the tiny target's sizes ------------------

LLAMA31_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                "rope_type": "llama3"}


def _edit_config(folder, **changes) -> None:
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))


def _drop_tensors(folder, name: str, *keys) -> None:
    from safetensors.torch import load_file

    path = Path(folder) / name
    state = load_file(path)
    for key in keys:
        state.pop(key, None)
    save_file(state, path, metadata={"format": "pt"})


def redhat_speculators_eagle3(folder, target):
    """RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3 (speculators 0.1-0.2 dev): norm_before_residual, Llama 3.1's
    llama3 RoPE scaling at theta 500000, head_dim and pretraining_tp in transformer_layer_config, no
    eagle_aux_hidden_state_layer_ids (vLLM's default layers then), no norm_before_fc/fc_norm/norm_output keys, bf16,
    no embed_tokens saved."""
    write_speculators(folder, target)
    c = target.config
    layer = {"head_dim": c.hidden_size // c.num_attention_heads, "pretraining_tp": 1, "rope_theta": 500000.0,
             "rope_scaling": LLAMA31_ROPE, "max_position_embeddings": 131072, "attention_bias": False,
             "mlp_bias": False, "model_type": "llama", "torch_dtype": "bfloat16"}
    _edit_config(folder, speculators_version="0.2.0.dev11", eagle_aux_hidden_state_layer_ids=None,
                 norm_before_fc=None, fc_norm=None, norm_output=None, embed_requires_grad=None,
                 auto_map={"": "eagle3.Eagle3SpeculatorConfig"}, has_no_defaults_at_init=False, torch_dtype="bfloat16",
                 transformer_layer_config=layer)
    _drop_tensors(folder, "model.safetensors", "embed_tokens.weight")


def yuhuili_eagle3_llama31(folder, target):
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: the EAGLE authors' EAGLE-3 config with Llama 3.1's RoPE (theta 500000,
    llama3 scaling) and pytorch_model.bin."""
    write_eagle_authors(folder, target)
    _edit_config(folder, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE, bos_token_id=128000, eos_token_id=128001)


def yuhuili_eagle_llama3(folder, target):
    """yuhuili/EAGLE-LLaMA3-Instruct-8B: EAGLE-1/2, `bias: false`, rope_theta 500000 (write_eagle1_authors' llama3)."""
    write_eagle1_authors(folder, target, layout="llama3")


def lmsys_specforge_eagle3(folder, target):
    """An lmsys SpecForge EAGLE-3 for Llama 3.1 (SpecForge's configs/llama3-8B-eagle3.json, as its to_hf export saves
    it): LlamaForCausalLMEagle3, no eagle_config (SGLang's default layers then), Llama 3.1's RoPE, model.safetensors
    without the embedding."""
    write_specforge(folder, target, aux_layer_ids=None)
    _edit_config(folder, rope_scaling=LLAMA31_ROPE, torch_dtype="float16", pad_token_id=0)
    _drop_tensors(folder, "model.safetensors", "embed_tokens.weight")


def fasterdecoding_medusa_vicuna(folder, target):
    """FasterDecoding/medusa-vicuna-7b-v1.3: five one-block heads in medusa_lm_head.pt, base_model_name_or_path
    lmsys/vicuna-7b-v1.3."""
    write_medusa_fd(folder, target, num_heads=5, num_layers=1, pt=True)


def zlab_dflash_qwen3(folder, target):
    """z-lab/Qwen3-8B-DFlash-b16: five Qwen3 layers, blocks of 16, dflash_config's target_layer_ids spread over the
    target (z-lab's rule for five drafter layers of an 8-layer target), layer_types all full attention."""
    write_dflash_zlab(folder, target, block_size=16, num_layers=5, target_layer_ids=(1, 2, 3, 4, 5), mask_token_id=95)
    _edit_config(folder, layer_types=["full_attention"] * 5, use_sliding_window=False, sliding_window=None,
                 max_window_layers=5)


PUBLISHED = {"RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3": (redhat_speculators_eagle3, "speculators"),
             "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": (yuhuili_eagle3_llama31, "eagle_authors"),
             "yuhuili/EAGLE-LLaMA3-Instruct-8B": (yuhuili_eagle_llama3, "eagle1_authors"),
             "lmsys SpecForge EAGLE-3 (Llama 3.1)": (lmsys_specforge_eagle3, "specforge"),
             "FasterDecoding/medusa-vicuna-7b-v1.3": (fasterdecoding_medusa_vicuna, "medusa_fd"),
             "z-lab/Qwen3-8B-DFlash-b16": (zlab_dflash_qwen3, "dflash_zlab")}
