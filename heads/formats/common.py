"""What every importer of a foreign checkpoint shares: finding its files, reading its tensors, checking it fits the
target, and loading the mapped weights strictly."""

from __future__ import annotations

import contextlib
import os
import pickle
import re

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import cached_file

from ..base import DrafterConfig, DrafterModel, text_config
from ..folders import file_record

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
    if name.endswith(".safetensors"):
        try:
            state = load_file(path)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"cannot read {path}: {err}. The file is corrupt or truncated: re-download the "
                             "checkpoint") from err
    else:
        state = read_pickled(path)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors (name -> tensor) but a {type(state).__name__}: it "
                         "was not written as a checkpoint of this format; re-download the checkpoint")
    return state


# What torch's weights-only unpickler raises on a file that is not a pickle of tensors: damaged bytes come out as
# any of these, depending on where the damage falls.
_UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
               AttributeError, UnicodeDecodeError)


def read_pickled(path):
    """What a `.pt`/`.bin` file holds, through torch's weights-only unpickler (tensors and plain containers only, so
    a pickle cannot run code here). A file it cannot read is reported as corrupt or as not a file of tensors; torch's
    own advice to load with `weights_only=False` (which runs whatever the file holds) is not passed on."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (PermissionError, FileNotFoundError) as err:
        raise OSError(f"cannot read {path}: {err.strerror or err}") from err
    except (*_UNREADABLE, OSError) as err:  # torch reports some damaged archives as an OSError (EINVAL)
        found = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(\n\n|$)", str(err), re.S)
        detail = (found.group(1) if found else str(err).split(". ")[0]) or type(err).__name__
        size = os.path.getsize(path)
        raise ValueError(f"cannot read {path} ({size} bytes): it is corrupt or truncated, or not a file of tensors "
                         f"(torch's safe loader says: {detail}). selfspec reads pickled weights only as tensors and "
                         "plain containers, never running code from the file: re-download the checkpoint") from None


# What a config value must be (in words, for the error) and the test for it; bools are not numbers here.
def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


KINDS = {
    "size": ("a whole number >= 1", lambda v: _whole(v) and v >= 1),
    "id": ("a whole number >= 0", lambda v: _whole(v) and v >= 0),
    "ids": ("a list of whole numbers >= 0", lambda v: isinstance(v, list) and all(_whole(i) and i >= 0 for i in v)),
    "number": ("a number", lambda v: (_whole(v) or isinstance(v, float)) and not isinstance(v, bool)),
    "name": ("a string", lambda v: isinstance(v, str)),
    "flag": ("true or false", lambda v: isinstance(v, bool)),
    "table": ("an object ({...})", lambda v: isinstance(v, dict)),
}


def check_config(what: str, config: dict, spec: dict[str, str], section: str = "config.json") -> None:
    """Refuse a config whose keys in `spec` (key -> a kind of KINDS; "kind?" where the key may be absent or null)
    are missing or of another kind, naming the key, the file and the fix, before any value is used."""
    for key, kind in spec.items():
        words, ok = KINDS[kind.rstrip("?")]
        value = config.get(key)
        if value is None and kind.endswith("?"):
            continue
        if value is None:
            raise ValueError(f"{what}: {section} has no {key!r} ({words}), which this format always writes: the "
                             "file is incomplete or was edited; re-download the checkpoint")
        if not ok(value):
            raise ValueError(f"{what}: {section}'s {key!r} must be {words}, got {value!r:.60}: the file was edited "
                             "or damaged; re-download the checkpoint")


def selfspec_fields(what: str, config: dict) -> dict:
    """The `selfspec` block an export of ours adds to a format's config (drafter config fields the format does not
    record: the target's layer count, the tree, provenance), without its record of the files; {} in a checkpoint
    trained elsewhere."""
    block = config.get("selfspec")
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise ValueError(f"{what}: config.json's 'selfspec' must be an object, got {block!r:.60}: the file was edited "
                         "or damaged; export the drafter again")
    return {k: v for k, v in block.items() if k != "files"}


def check_export_files(what: str, path_or_id, config: dict, needs: tuple[str, ...], **hub_kwargs) -> None:
    """An export of ours (a config with a `selfspec` block) must hold every file it was written with, each the one
    written then: its config records their sizes and sha256 (older exports record none; then `needs`, what the format
    always writes, must be there). A folder whose config and weights come from two exports, or with a file missing,
    would otherwise load as some other drafter, or with the target's embedding for DFlash's mask vector."""
    block = config.get("selfspec")
    if not isinstance(block, dict):
        return
    files = block.get("files") if isinstance(block.get("files"), dict) else dict.fromkeys(needs)
    paths = {name: resolve_file(path_or_id, name, **hub_kwargs) for name in files}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        raise ValueError(f"{what} is an export of selfspec's without its {' and '.join(missing)}: the export was "
                         "interrupted or copied in part; export the drafter again (heads.export, scripts/export.py)")
    differ = [name for name, record in files.items() if record is not None and file_record(paths[name]) != record]
    if differ:
        raise ValueError(f"{what}: its {' and '.join(differ)} {'is' if len(differ) == 1 else 'are'} not the file"
                         f"{'' if len(differ) == 1 else 's'} this export wrote (size or sha256 differ from what "
                         "config.json records): the folder mixes files of two exports, or was damaged; export the "
                         "drafter again")


# The target fields a drafter config records, as error messages call them.
TARGET_FIELD_NAMES = {"target_model_type": "architecture (model_type)", "target_hidden_size": "hidden size",
                      "target_vocab_size": "vocabulary size", "target_num_layers": "layer count"}


def fields_for_target(what: str, recorded: dict, target) -> dict:
    """Drafter config fields for a checkpoint that records `recorded` (what its format says of the target, and our
    exports' `selfspec` block), completed from `target` (a model or config) where it records nothing. A recorded
    field the target contradicts is refused by name: the drafter was trained for another target, and taking the
    target's value would hide that."""
    fields = dict(recorded)
    if target is None:
        return fields
    theirs = DrafterConfig.target_fields(target)
    problems = [f"{words}: checkpoint {recorded[k]!r}, target {theirs[k]!r}"
                for k, words in TARGET_FIELD_NAMES.items() if recorded.get(k) is not None and recorded[k] != theirs[k]]
    if problems:
        given = theirs["base_model_name_or_path"] or theirs["target_model_type"]
        trained_for = recorded.get("base_model_name_or_path") or "another model"
        raise ValueError(f"{what} does not fit the target ({given}):\n  - " + "\n  - ".join(problems)
                         + f"\nIt was trained for {trained_for}: load it with the target it was trained for, or train "
                         "a drafter for this one")
    fields.update({k: v for k, v in theirs.items() if fields.get(k) is None and v is not None})
    return fields


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


@contextlib.contextmanager
def named(what: str):
    """The drafter's own config checks (a block size, feature layers the target lacks, ...) raised while building
    from a checkpoint, named with the checkpoint they came from."""
    try:
        yield
    except (ValueError, StrictDataclassError) as err:  # the latter: transformers' own config checks
        raise ValueError(f"{what}: {err}") from None
    except TypeError as err:
        raise TypeError(f"{what}: {err}") from None


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
