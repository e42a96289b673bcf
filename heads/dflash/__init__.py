from .config import DFlashConfig
from .model import DFlashModel

__all__ = ["DFlashConfig", "DFlashModel"]
