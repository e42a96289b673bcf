from .config import EagleConfig
from .model import EagleModel

__all__ = ["EagleConfig", "EagleModel"]
