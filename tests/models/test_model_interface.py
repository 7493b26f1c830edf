"""Every kind of model the worker runs (services/worker/model_kinds.py) implements the whole
``Model`` interface (services/worker/model_interface.py), and the worker finds each family's
kind through its family alone."""

from __future__ import annotations

import typing

import pytest

from kvflow.services.worker.model_interface import Model
from kvflow.services.worker.model_kinds import KINDS, model_kind
from kvflow.shared.models.generic import transformers_config
from kvflow.shared.models.registry import families, hf_config
from tests.helpers.families import CONFIGS, TRANSFORMERS_ONLY

MEMBERS = sorted(
    {n for n in vars(Model) if not n.startswith("_")} | set(typing.get_type_hints(Model))
)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_has_every_member_of_the_interface(kind: str) -> None:
    impl = KINDS[kind]()
    declared = {n for c in impl.__mro__ for n in getattr(c, "__annotations__", {})}
    missing = [n for n in MEMBERS if not hasattr(impl, n) and n not in declared]
    assert missing == []
    assert "load" in MEMBERS and "forward_device_pooled" in MEMBERS and "generates" in MEMBERS


def test_every_family_names_a_kind_the_worker_has() -> None:
    assert {f.kind for f in families().values()} == set(KINDS)
    raw = CONFIGS["olmo3"]().to_dict() | {"architectures": ["Olmo3ForCausalLM"]}
    assert model_kind(hf_config(raw)).__name__ == "DecoderModel"
    neox = transformers_config(TRANSFORMERS_ONLY["gpt_neox"]().to_dict())
    assert model_kind(neox).__name__ == "TransformersModel"
