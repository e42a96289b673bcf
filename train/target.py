"""Loading the frozen target and its tokenizer."""

from __future__ import annotations

import hashlib
import json

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLED_VALUES = 1 << 16  # values of each weight tensor that `target_fingerprint` reads


def load_target(name_or_path: str, dtype: str = "float32"):
    """(model, tokenizer) for a local folder, a hub id, or `smollm2-135m-instruct` (the embedded target)."""
    from infer.loading import resolve_target

    model, tokenizer = resolve_target(name_or_path, dtype=DTYPES[dtype])
    model.eval().requires_grad_(False)
    return model, tokenizer


def target_fingerprint(model) -> str:
    """Identifies a target's weights: a sha256 over its config (not the folder it was read from) and, for
    every tensor of its state dict, the name, dtype, shape and the bytes of SAMPLED_VALUES evenly spaced values
    (all of a smaller tensor).

    A fine-tune, a merged adapter, another checkpoint or another quantization changes values throughout every
    tensor it touches, so it changes the fingerprint; a fixed number of values a tensor keeps the cost to a
    fraction of a second on any target, where hashing every byte would read the whole model again. The price:
    an edit of a few isolated values in a tensor larger than SAMPLED_VALUES can go unseen. Bytes, not
    arithmetic on them, so the same weights give the same fingerprint on any device.
    """
    config = json.loads(model.config.to_json_string(use_diff=False))
    # Where and by what it was read, and what save_pretrained fills in (the tensors' dtypes are hashed below).
    for bookkeeping in ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype"):
        config.pop(bookkeeping, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        if flat.numel() > SAMPLED_VALUES:
            picks = torch.arange(SAMPLED_VALUES, dtype=torch.int64) * (flat.numel() - 1) // (SAMPLED_VALUES - 1)
            flat = flat[picks.to(flat.device)]
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
