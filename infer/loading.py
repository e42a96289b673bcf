"""Loading a target: (model, tokenizer) for the embedded target's short name, a local folder or a hub id, and
the checks that tell a missing local folder from a hub id before transformers reads it as one.

    model, tokenizer = resolve_target("smollm2-135m-instruct")   # the embedded target (infer.embedded)
    model, tokenizer = resolve_target("path/to/hf_folder")       # any local folder ...
    model, tokenizer = resolve_target("org/model-id")            # ... or hub id
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .embedded import EMBEDDED_NAME, embedded_folder

# What a target may be, for errors about one that cannot be found.
TARGET_FIX = (f"give a folder holding the target (config.json and weights, as save_pretrained writes), a hub id "
              f"(owner/name), or {EMBEDDED_NAME!r}")


def looks_local(name_or_path: str | os.PathLike) -> bool:
    """Whether `name_or_path` can only mean a local path, never a hub id (`name` or `owner/name`): a path
    object, or a string that starts with `/`, `./`, `../` or `~`, or holds more than one slash (or a backslash
    on Windows). So transformers' "not a valid model identifier" never answers a missing folder."""
    if isinstance(name_or_path, os.PathLike):
        return True
    text = str(name_or_path)
    if text in (".", "..") or text.startswith(("/", "./", "../", "~")):
        return True
    return (os.sep != "/" and os.sep in text) or text.count("/") > 1


def beside_a_local_folder(name: str | os.PathLike) -> bool:
    """`owner/name` where a local folder `owner` exists: a hub id to try, but more likely a mistyped folder."""
    parts = str(name).split("/")
    return len(parts) == 2 and os.path.isdir(parts[0])


def check_local_folder(name_or_path: str | os.PathLike, what: str, fix: str) -> None:
    """Raise where `name_or_path` is a file, or reads as a local path and is no folder; `what` names it, `fix`
    says what to pass instead. An existing folder and a possible hub id pass."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"{what} {str(name_or_path)!r} is a file, not a folder; {fix}")
    if looks_local(name_or_path):
        raise FileNotFoundError(f"no such folder: {str(name_or_path)!r} ({what}; looked for {path.absolute()}); {fix}")


def resolve_target(name_or_path: str | os.PathLike, **hf_kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) for the short name `smollm2-135m-instruct`, a local folder, or a hub id.

    `hf_kwargs` (dtype, attn_implementation, revision, ...) go to `AutoModelForCausalLM.from_pretrained`.
    The model comes back in eval mode. A path that does not exist is an error naming it (`check_local_folder`)
    before transformers would read it as a hub id.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    if not str(name_or_path):
        raise ValueError(f"the target is empty: {TARGET_FIX}")
    embedded_target = str(name_or_path).lower() == EMBEDDED_NAME
    if not embedded_target:
        check_local_folder(name_or_path, "the target", TARGET_FIX)
        if str(name_or_path).startswith("~"):
            name_or_path = Path(name_or_path).expanduser()  # transformers reads '~' literally
    folder = embedded_folder() if embedded_target else name_or_path
    tokenizer_kwargs = {k: hf_kwargs[k] for k in ("revision", "token", "trust_remote_code") if k in hf_kwargs}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **hf_kwargs)
    except OSError as err:
        if embedded_target or Path(folder).is_dir():  # a folder that is there but does not load: its own error
            raise
        # a name that could be a hub id is a local path too: a mistyped one is said first, then what the hub said
        # (often only that it could not be reached)
        raise FileNotFoundError(f"no such folder: {str(folder)!r} (the target; looked for {Path(folder).absolute()}, "
                                f"and as a hub id: {err}); {TARGET_FIX}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **tokenizer_kwargs)
    except (OSError, ValueError) as err:
        if not Path(folder).is_dir():
            raise
        # transformers' own words speak of backend and slow tokenizers, not of the folder that lacks one
        raise ValueError(f"the target folder {str(folder)!r} holds no tokenizer that transformers can load (no "
                         "readable tokenizer.json, tokenizer_config.json or tokenizer.model; transformers' own words "
                         "are above); save the target's tokenizer beside it (tokenizer.save_pretrained(folder)), or "
                         "copy its tokenizer files there") from err
    if embedded_target:
        # As from_pretrained records a hub id, record the short name rather than this machine's cache path,
        # so drafters trained on it name a target that resolves anywhere.
        model.name_or_path = model.config._name_or_path = EMBEDDED_NAME
        tokenizer.name_or_path = EMBEDDED_NAME
    return model.eval(), tokenizer


def target_tokenizer(target: PreTrainedModel) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved beside a target loaded from a local folder (or the embedded one), or None."""
    folder = getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", None)
    if folder == EMBEDDED_NAME:
        folder = str(embedded_folder())
    if not folder or not os.path.isdir(folder):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None
