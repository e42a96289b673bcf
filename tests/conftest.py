"""Tiny random-config targets for every architecture we claim, built in milliseconds on CPU."""

from __future__ import annotations

import pytest
import torch
import transformers

# Tiny models gain nothing from threads, and several test processes on a small machine oversubscribe
# the cores badly (seen: 100x slower). Real-model tests raise this for themselves.
torch.set_num_threads(1)

VOCAB = 96

# model_type -> config overrides on top of the shared tiny shape.
ARCHITECTURES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "mistral": {"sliding_window": 4096},
    "gemma2": {"head_dim": 8, "sliding_window": 16},
    "gemma3_text": {"head_dim": 8, "sliding_window": 16},
    "phi3": {"pad_token_id": 0},
    "gpt2": {},
    "gpt_neox": {},
}

_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
_GPT2_SHAPE = dict(n_embd=32, n_layer=4, n_head=4, n_positions=256)
_NEOX_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   max_position_embeddings=256)


def tiny_config(model_type: str, vocab_size: int = VOCAB, **overrides) -> transformers.PretrainedConfig:
    if model_type == "gpt2":
        shape = dict(_GPT2_SHAPE)
    elif model_type == "gpt_neox":
        shape = dict(_NEOX_SHAPE)
    else:
        shape = dict(_SHAPE)
    shape.update(ARCHITECTURES[model_type])
    shape.update(overrides)
    shape.setdefault("bos_token_id", 1)
    shape.setdefault("eos_token_id", 2)
    shape.setdefault("pad_token_id", 0)
    return transformers.AutoConfig.for_model(model_type, vocab_size=vocab_size, **shape)


# Architectures transformers runs only with eager attention (gemma2: softcapping).
EAGER_ONLY = {"gemma2"}


def left_padded_prompts(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch, 7] over the tiny models' vocabulary and their attention mask: the second prompt, where
    there is one, is left-padded by 3."""
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids[:batch], mask[:batch]


def greedy_reference(target, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation, no eos: what speculative greedy output must equal."""
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=None, pad_token_id=0)


def tiny_model(model_type: str = "llama", seed: int = 0, attn_implementation: str | None = None,
               init_std: float = 0.5, **overrides) -> transformers.PreTrainedModel:
    """A random causal LM; `init_std` is large so next-token distributions are peaked and varied
    (with the default 0.02 a random model's logits are nearly flat and argmax ties make greedy
    comparisons meaningless)."""
    if attn_implementation is None:
        attn_implementation = "eager" if model_type in EAGER_ONLY else "sdpa"
    torch.manual_seed(seed)
    config = tiny_config(model_type, initializer_range=init_std, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param


def perturbed_copy(model, scale: float = 0.05, seed: int = 7):
    """A draft model that mostly agrees with `model` (high acceptance, but not always): a copy with
    every weight moved by `scale` times its tensor's standard deviation."""
    draft = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().nan_to_num(0))
    return draft



def on_gguf_grid(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` [N, K] rounded onto a GGUF grid in groups of 32 inputs, with fp16 scales (and offsets) as GGUF
    stores them, dequantized to fp32 as transformers does: "q4_1", q * d + m with q in 0..15 (the embedded SmolLM2's
    layers); "q8_0", q * d with q in -127..127 (its tied embedding and LM head)."""
    groups = weight.detach().float().reshape(weight.shape[0], -1, 32)
    if kind == "q8_0":
        scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
        grid = (groups / scale).round().clamp(-127, 127) * scale
    elif kind == "q4_1":
        low = groups.amin(-1, keepdim=True).half().float()
        scale = ((groups.amax(-1, keepdim=True) - low) / 15).half().float()
        grid = ((groups - low) / scale).round().clamp(0, 15) * scale + low
    else:
        raise ValueError(f"kind: 'q4_1' or 'q8_0', got {kind!r}")
    return grid.reshape(weight.shape)

@pytest.fixture(scope="module")
def smollm2():
    """The real embedded target (SmolLM2-135M-Instruct) and its tokenizer, padding on the left."""
    import os

    from infer.loading import resolve_target

    threads = torch.get_num_threads()
    # the one-thread pin above is for the tiny models; the real target shares the cores with the other workers
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    model, tokenizer = resolve_target("smollm2-135m-instruct")
    tokenizer.padding_side = "left"
    yield model, tokenizer
    torch.set_num_threads(threads)


def chat(tokenizer, texts: list[str]):
    """A left-padded batch of one-turn chat prompts."""
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                              add_generation_prompt=True) for t in texts]
    return tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)


def pytest_collection_modifyitems(config, items):
    """A test on the real SmolLM2 target is `slow` whether or not its author marked it: `make test` (the fast
    tier) leaves it to `make test-slow`, which CI runs too."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        # vLLM servers and workers hold several GB each (weights, a 4 GB KV cache, worker processes): two at once
        # beside the test workers overrun a 24 GB machine, whose OOM killer then takes one vLLM worker down. Under
        # `--dist loadgroup` (make test-slow) every vLLM test runs on one xdist worker, one after another.
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group("vllm"))
