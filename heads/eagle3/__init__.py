from .config import Eagle3Config
from .model import Eagle3Model, build_vocab_map

__all__ = ["Eagle3Config", "Eagle3Model", "build_vocab_map"]
