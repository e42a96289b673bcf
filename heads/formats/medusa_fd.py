"""Medusa-1 heads as FasterDecoding/Medusa publishes them (e.g. FasterDecoding/medusa-vicuna-7b-v1.3).

The checkpoint is `config.json` (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`: the target)
and `medusa_lm_head.safetensors` (what their training script writes) or `medusa_lm_head.pt` (what their loaders
read), the state dict of their `medusa_head` ModuleList: head i is `Sequential(ResBlock, ..., Linear)`, so
`{i}.{j}.linear.weight`/`.bias` for residual block j and `{i}.{num_layers}.weight` for the head's own lm_head
[V, D] without bias (a `medusa_head.` prefix is accepted too).

What their code computes, and our `MedusaModel` with these weights: from the target's last hidden state (after the
final norm), head i applies x + SiLU(W x + b) per block, then its lm_head, predicting the token i + 2 places on.
Their heads repeat one ResBlock module `num_layers` times, so every block of a head holds the same weights; a
checkpoint whose blocks differ is refused. Their loaders build the heads their config counts but published
configs undercount; the heads in the file are what is loaded, with a warning when the config disagrees.
"""

from __future__ import annotations

import re
import warnings

import torch

from ..medusa import MedusaConfig, MedusaModel
from .common import (
    check_config,
    check_fits,
    fields_for_target,
    finish,
    load_strict,
    named,
    read_tensors,
    resolve_file,
)

NAME = "medusa_fd"
DESCRIPTION = "Medusa-1, FasterDecoding's format (medusa_num_heads config, medusa_lm_head.safetensors or .pt)"
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# config.json's keys read here and what each must be ("?": may be absent or null)
CONFIG = {"medusa_num_heads": "size?", "medusa_num_layers": "size?", "base_model_name_or_path": "name?"}


def detect(config: dict, files: frozenset[str]) -> bool:
    return "medusa_num_heads" in config and any(f in files for f in WEIGHT_FILES)


def target_name(config: dict) -> str | None:
    return config.get("base_model_name_or_path")


def load(path_or_id, config: dict, target=None, **hub_kwargs) -> MedusaModel:
    what = f"Medusa checkpoint {path_or_id} (FasterDecoding's format)"
    check_config(what, config, CONFIG)
    name = next(f for f in WEIGHT_FILES if resolve_file(path_or_id, f, **hub_kwargs) is not None)
    tensors = {k.removeprefix("medusa_head."): v for k, v in read_tensors(path_or_id, name, **hub_kwargs).items()}
    num_layers = config.get("medusa_num_layers") or 1
    heads = sorted({int(m.group(1)) for k in tensors if (m := re.fullmatch(r"(\d+)\.\d+\..*", k))})
    if not heads or heads != list(range(len(heads))):
        raise ValueError(f"{what}: expected heads 0..K-1 keyed '<head>.<block>.linear.weight', found keys "
                         f"{sorted(tensors)[:6]}")
    if config.get("medusa_num_heads") != len(heads):
        warnings.warn(f"{what}: its config says {config.get('medusa_num_heads')} heads, its weights hold "
                      f"{len(heads)}; loading the {len(heads)} in the weights", stacklevel=3)
    head = tensors.get(f"0.{num_layers}.weight")
    if head is None or head.dim() != 2:
        raise ValueError(f"{what}: no lm_head '0.{num_layers}.weight' after {num_layers} residual block(s) "
                         "(medusa_num_layers)")
    vocab, hidden = head.shape
    check_fits(what, target, hidden_size=hidden, vocab_size=vocab)
    state = {}
    for i in heads:
        first = None
        for j in range(num_layers):
            w, b = tensors.pop(f"{i}.{j}.linear.weight", None), tensors.pop(f"{i}.{j}.linear.bias", None)
            if w is None or b is None:
                continue  # reported as missing below
            if first is not None and not (torch.equal(w, first[0]) and torch.equal(b, first[1])):
                raise ValueError(f"{what}: head {i}'s residual blocks differ, but Medusa's code applies one block "
                                 f"{num_layers} times (its heads repeat one module); the file was not written by it")
            first = first or (w, b)
            state[f"heads.{i}.blocks.{j}.weight"], state[f"heads.{i}.blocks.{j}.bias"] = w, b
        lm_head = tensors.pop(f"{i}.{num_layers}.weight", None)
        if lm_head is not None:
            state[f"heads.{i}.lm_head.weight"] = lm_head
    state.update(tensors)  # anything left is unexpected
    fields = fields_for_target(what, {"base_model_name_or_path": config.get("base_model_name_or_path"),
                                      "target_hidden_size": hidden, "target_vocab_size": vocab}, target)
    with named(what):
        model = MedusaModel(MedusaConfig(num_heads=len(heads), num_layers=num_layers, share_lm_head=False,
                                         projection_bias=False, **fields))
    return finish(load_strict(model, state, what), target)
