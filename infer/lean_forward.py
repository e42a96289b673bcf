"""Moved to `infer.cpu.lean_forward`; kept only until infer/drafters/draft_model.py imports it from there."""

from .cpu.lean_forward import LeanForward, Unsupported  # noqa: F401
