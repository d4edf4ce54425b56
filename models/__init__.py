"""Model definitions and checkpoint loading."""
from models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from models.loader import ModelSource, iter_checkpoint, load_tokenizer, resolve_model
from models.presets import PRESETS

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "ModelSource", "PRESETS", "iter_checkpoint",
           "load_tokenizer", "resolve_model"]
