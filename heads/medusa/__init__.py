from .config import MedusaConfig
from .model import MedusaModel

__all__ = ["MedusaConfig", "MedusaModel"]
