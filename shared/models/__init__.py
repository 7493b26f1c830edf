"""Model families: configs (config.py), rotary embeddings (rope.py), one file per family
(families/) and the registry that lists them (registry.py)."""

from kvflow.shared.models.config import ModelConfig, ModelConfigError, RopeSpec

__all__ = ["ModelConfig", "ModelConfigError", "RopeSpec"]
