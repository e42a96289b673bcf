"""What every importer of a foreign checkpoint shares: finding its files, reading its tensors, checking it fits the
target, and loading the mapped weights strictly."""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import cached_file

from ..base import DrafterConfig, DrafterModel, text_config

# The weight files the formats here are published with; which of them a checkpoint holds is part of what
# tells one format from another (EAGLE's authors publish pytorch_model.bin, SpecForge writes model.safetensors).
CANDIDATE_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt",
                   "mask_embedding.pt")


def resolve_file(path_or_id, name: str, **hub_kwargs) -> str | None:
    """The local path of `name` in a folder or hub repo (downloaded to the cache), or None if it has none."""
    if os.path.isdir(os.path.join(os.fspath(path_or_id), hub_kwargs.get("subfolder", ""))):
        path = os.path.join(os.fspath(path_or_id), hub_kwargs.get("subfolder", ""), name)
        return path if os.path.isfile(path) else None
    return cached_file(path_or_id, name, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub_kwargs)


def files_of(path_or_id, **hub_kwargs) -> frozenset[str]:
    """Which of `CANDIDATE_FILES` the checkpoint holds."""
    return frozenset(n for n in CANDIDATE_FILES if resolve_file(path_or_id, n, **hub_kwargs) is not None)


def read_tensors(path_or_id, name: str, **hub_kwargs) -> dict[str, torch.Tensor]:
    """The tensors of weight file `name`: safetensors as they are; `.pt`/`.bin` files (what EAGLE's authors and
    Medusa publish) through torch's weights-only unpickler, which builds tensors and plain containers and
    refuses anything else, so a pickle cannot run code here."""
    path = resolve_file(path_or_id, name, **hub_kwargs)
    if path is None:
        raise FileNotFoundError(f"{path_or_id} has no {name}")
    try:
        if name.endswith(".safetensors"):
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}. Re-download the checkpoint") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors (name -> tensor)")
    return state


def target_fields(target) -> dict:
    """The drafter config's `target_*` fields of a target model or config; none without one."""
    return DrafterConfig.target_fields(target) if target is not None else {}


def check_fits(what: str, target, **sizes) -> None:
    """Raise before anything is built when the checkpoint's sizes (`hidden_size=`, `vocab_size=`,
    `num_hidden_layers=`: what the checkpoint says) differ from the target's, naming each."""
    if target is None:
        return
    config = text_config(target)
    names = {"hidden_size": "hidden size", "vocab_size": "vocabulary size", "num_hidden_layers": "layer count"}
    problems = [f"{names[k]}: checkpoint {v}, target {getattr(config, k)}" for k, v in sizes.items()
                if v is not None and v != getattr(config, k)]
    if problems:
        raise ValueError(f"{what} does not fit the target ({getattr(config, '_name_or_path', '') or config.model_type})"
                         ":\n  - " + "\n  - ".join(problems) + "\nIt was trained for another model; use its target, "
                         "or one with the same sizes and tokenizer")


def check_embedding(what: str, tensors: dict, key: str, target) -> None:
    """A checkpoint that carries its own copy of the input embedding must carry the target's: we embed with the
    target's, and a different table means another target or tokenizer (or an embedding trained further)."""
    if key not in tensors or not isinstance(target, PreTrainedModel):
        return
    theirs = tensors[key]
    ours = target.get_input_embeddings().weight.detach()
    if tuple(theirs.shape) != tuple(ours.shape):
        raise ValueError(f"{what}: its {key} is {tuple(theirs.shape)}, the target's input embedding "
                         f"{tuple(ours.shape)}: the drafter was trained for another target or tokenizer")
    rounded = ours.to(device=theirs.device, dtype=theirs.dtype)
    if not torch.equal(rounded, theirs):
        diff = (rounded.float() - theirs.float()).abs()
        rows = int((diff.amax(dim=1) > 0).sum())
        raise ValueError(f"{what}: its {key} differs from the target's input embedding in {rows} of "
                         f"{theirs.shape[0]} rows (largest difference {float(diff.max()):.3g}): the drafter was "
                         "trained for another target or tokenizer, or with its embedding trained; selfspec "
                         "embeds with the target's own")


def check_vocab_map(what: str, d2t: torch.Tensor, t2d: torch.Tensor | None, draft_vocab: int, vocab: int) -> None:
    """EAGLE-3's draft vocabulary: target id = draft id + d2t[draft id], each a distinct id of the target's
    vocabulary, and t2d[i] true exactly for those ids."""
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise ValueError(f"{what}: d2t must be an integer tensor of shape [{draft_vocab}] (draft_vocab_size), got "
                         f"{d2t.dtype} {tuple(d2t.shape)}")
    ids = torch.arange(draft_vocab) + d2t.long().cpu()
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise ValueError(f"{what}: d2t maps draft ids to target ids outside the target's vocabulary 0..{vocab - 1} "
                         f"(e.g. {bad[:3].tolist()}): the drafter was built for a larger vocabulary or another "
                         "tokenizer")
    if ids.unique().numel() != draft_vocab:
        raise ValueError(f"{what}: d2t maps several draft ids to one target id; the map is damaged")
    if t2d is None:
        return
    if tuple(t2d.shape) != (vocab,):
        raise ValueError(f"{what}: t2d has shape {tuple(t2d.shape)}, the target's vocabulary is [{vocab}]: the "
                         "drafter was built for another vocabulary")
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[ids] = True
    if not torch.equal(marked, t2d.bool().cpu()):
        raise ValueError(f"{what}: t2d and d2t disagree ({int(t2d.bool().sum())} target ids marked, d2t reaches "
                         f"{draft_vocab}, {int((marked != t2d.bool().cpu()).sum())} differ); the map is damaged")


def load_strict(model: DrafterModel, state: dict[str, torch.Tensor], what: str) -> DrafterModel:
    """Load `state` into `model`: every key present and expected, every shape equal, or an error naming them."""
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)}, drafter {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        parts = [f"missing {missing}" if missing else "", f"unexpected {unexpected}" if unexpected else "",
                 f"shapes differ: {'; '.join(shapes)}" if shapes else ""]
        raise ValueError(f"{what} does not map onto the drafter: " + ", ".join(p for p in parts if p))
    model.load_state_dict(state, strict=True)
    return model.eval()


def finish(model: DrafterModel, target, dtype=None) -> DrafterModel:
    """Check the drafter against the target (a model or config) it was loaded for, and cast it if asked."""
    if isinstance(target, (PreTrainedModel, PretrainedConfig)):
        model.check_target(target)
    if dtype is not None and dtype != "auto":
        model.to(dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model
