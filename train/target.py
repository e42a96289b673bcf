"""Loading the frozen target and its tokenizer."""

from __future__ import annotations

import hashlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(name_or_path: str, dtype: str = "float32"):
    """(model, tokenizer) for a local folder, a hub id, or `smollm2-135m-instruct` (the embedded target)."""
    from infer.embedded import resolve_target

    model, tokenizer = resolve_target(name_or_path, dtype=DTYPES[dtype])
    model.eval().requires_grad_(False)
    return model, tokenizer


def target_fingerprint(model) -> str:
    """Identifies a target's weights cheaply: its config plus a few slices of its weights."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.state_dict().items())
    for name, tensor in (params[0], params[len(params) // 2], params[-1]):
        h.update(name.encode())
        h.update(tensor.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
