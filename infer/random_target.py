"""Targets of real models' shapes with random weights, built on the device: a benchmark that downloads nothing.

A GPU's decoding speed at batch 1 is set by the model's shape (bytes of weights read per forward, layers, kernel
launches), not by what its weights learned, so a random-weight target times the engine as the real one would.
What it cannot give is the real model's acceptance: the oracle drafter (infer/drafters/oracle.py) sets that.

    target = build_random_target("llama3-8b", device="cuda", dtype=torch.bfloat16)

`SHAPES` holds the configs (the published models' shapes); the weights are allocated on the device directly
and initialised there, tied where the real model ties its embeddings. A shape whose weights do not fit the
device is refused, with its size, before anything is allocated.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

# name -> (model_type, config fields): the published models' shapes
SHAPES: dict[str, tuple[str, dict]] = {
    # a CPU dry run's target: the same code paths in seconds
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                           tie_word_embeddings=True)),
    "llama3-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1000000.0)),
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)),
    "llama3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3-32b": ("qwen3", dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1000000.0)),
}
# The share of the device's free memory the weights may take: the rest holds the KV cache, activations, a
# drafter and the compiled graphs' buffers.
WEIGHT_SHARE = 0.9


def shape_config(name: str) -> PretrainedConfig:
    """The config of shape `name`; an unknown name is a ValueError listing the shapes."""
    if name not in SHAPES:
        raise ValueError(f"unknown random target shape {name!r}; the shapes are: {', '.join(SHAPES)}")
    model_type, fields = SHAPES[name]
    return AutoConfig.for_model(model_type, **fields)


def parameter_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in `dtype`, tied ones counted once: built on the meta device, which
    allocates nothing."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if config.tie_word_embeddings:
        model.tie_weights()
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device: torch.device) -> int:
    """What the device can still allocate: a GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:  # counts reclaimable page cache, which SC_AVPHYS_PAGES leaves out
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_device(device: torch.device) -> None:
    """A CUDA device this machine has, said plainly before anything loads."""
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "run on a machine with a GPU, or pass device='cpu' (the 'tiny' shape is a CPU dry run)")


def build_random_target(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        seed: int = 0):
    """A causal LM of shape `name` (see SHAPES) with random weights, built on `device` in `dtype`, in eval mode,
    never stopping at an eos token (a random model's eos would end runs at random lengths)."""
    device = torch.device(device)
    check_device(device)
    config = shape_config(name)
    size, free = parameter_bytes(config, dtype), free_memory_bytes(device)
    if size > WEIGHT_SHARE * free:
        raise ValueError(f"random target {name!r} has {size / 1e9:.1f} GB of weights in "
                         f"{str(dtype).replace('torch.', '')}, more than {WEIGHT_SHARE:.0%} of the "
                         f"{free / 1e9:.1f} GB free on {device} (the rest holds the KV cache and activations); "
                         f"choose a smaller shape: {', '.join(SHAPES)}")
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocated in `dtype` from the start: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(before)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
