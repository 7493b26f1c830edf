"""The worker's kinds of model: the implementation of ``Model`` (services/worker/
model_interface.py) that runs each ``Family.kind`` (shared/models/family.py). A new kind of
model is a new implementation and its line here; nothing else in the worker names a kind.

Each is imported when a model of its kind is built (the Transformers fallback imports
transformers' modeling code, which the other kinds never need)."""

from __future__ import annotations

from collections.abc import Callable

from kvflow.services.worker.model_interface import Model
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.registry import family


def _decoder() -> type[Model]:
    from kvflow.services.worker.model import DecoderModel

    return DecoderModel


def _encoder() -> type[Model]:
    from kvflow.services.worker.encoder_model import EncoderModel

    return EncoderModel


def _transformers() -> type[Model]:
    from kvflow.services.worker.transformers_model import TransformersModel

    return TransformersModel


KINDS: dict[str, Callable[[], type[Model]]] = {
    "decoder": _decoder,
    "encoder": _encoder,
    "transformers": _transformers,
}


def model_kind(cfg: ModelConfig) -> type[Model]:
    """The implementation that runs a model of ``cfg`` (its family's kind)."""
    return KINDS[family(cfg.family).kind]()
