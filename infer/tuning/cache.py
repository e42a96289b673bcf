"""The per-machine cache of measurements: what a timing was taken on (device name, model shape, threads, code) is
hashed into its file name and stored beside it, so a measurement is read back only where it still holds
(`$SELFSPEC_CACHE/calibration`, default ~/.cache/selfspec/calibration)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from ..embedded import cache_dir


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's (`cpu_name`): what a cost curve is cached under."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        name = cpu_name(Path("/proc/cpuinfo").read_text())
    except OSError:
        name = None
    return name or platform.processor() or platform.machine() or device.type


def cpu_name(cpuinfo: str) -> str | None:
    """The first CPU's model name in /proc/cpuinfo's text, with its family and model numbers where given. A virtual
    machine's model name can be as bare as "AMD EPYC" on a Zen 3 with AVX2 and on a Zen 5 with AVX-512, whose
    kernels and costs differ; the numbers tell them apart."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "cpu family", "model"):
            fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return None
    if "cpu family" in fields and "model" in fields:
        return f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"
    return fields["model name"]


def fingerprint(model) -> str:
    """What a model's forward cost depends on: its class, dtype and parameter shapes."""
    shapes = [(name, list(p.shape)) for name, p in model.named_parameters()]
    return digest([type(model).__name__, str(model.dtype), shapes])


def config_hash(config) -> str:
    return digest(config.to_dict())


def digest(value) -> str:
    """A short hash of any JSON-able value (sources, settings, shapes)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cache_file(kind: str, fields: dict) -> Path:
    return cache_dir() / "calibration" / f"{kind}-{digest(fields)}.json"


def read_cache(kind: str, fields: dict) -> dict | None:
    """The entry of `kind` measured under exactly `fields`, or None."""
    path = _cache_file(kind, fields)
    try:
        entry = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not measured yet, or a damaged file: measure again (and overwrite it)
    return entry if entry.get("fields") == fields else None


def write_cache(kind: str, fields: dict, content: dict) -> None:
    path = _cache_file(kind, fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"fields": fields, **content}, indent=1))
    partial.replace(path)
