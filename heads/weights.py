"""The drafter's weights file: its name, and the check that it is a whole, unpickled safetensors file."""

from __future__ import annotations

import json
import os

from safetensors import SafetensorError, safe_open
from transformers.utils import cached_file

WEIGHTS_NAME = "model.safetensors"


def check_weights_file(path_or_id, **hub_kwargs) -> str:
    """Resolve the drafter's `model.safetensors` and read its header; raise a clear error otherwise."""
    try:
        weights = cached_file(path_or_id, WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False,
                              **hub_kwargs)
    except OSError as err:
        raise OSError(f"cannot resolve {WEIGHTS_NAME} for drafter {path_or_id!r}: {err}") from err
    if weights is None:
        pickled = [n for n in ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json")
                   if os.path.isdir(path_or_id) and os.path.exists(os.path.join(path_or_id, n))]
        if pickled:
            raise ValueError(f"{path_or_id} holds only pickled weights ({', '.join(pickled)}); drafters load "
                             f"safetensors only. Convert it: load it yourself and save_pretrained() it.")
        raise OSError(f"no {WEIGHTS_NAME} found for drafter {path_or_id!r}")
    try:
        with safe_open(weights, framework="pt") as f:
            for key in f.keys():
                f.get_slice(key)  # touches the header entry of every tensor
        size = os.path.getsize(weights)
        with open(weights, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_len + end != size:
            raise SafetensorError(f"file is {size} bytes, header describes {8 + header_len + end}")
    except (SafetensorError, ValueError, KeyError, OSError) as err:
        raise ValueError(f"corrupt or truncated safetensors file {weights}: {err}. Re-save or re-download "
                         "the drafter.") from err
    return weights
