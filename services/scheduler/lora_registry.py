"""The LoRA adapters that exist: ``--lora-modules`` from the start, plus those loaded at run
time (``POST /v1/load_lora_adapter`` -> gateway -> scheduler). The scheduler leader is the one
authority: an adapter exists once every live worker has read and checked it, a request naming
one that does not exist is refused (404 naming ``model``), and the adapter a request runs with
is the registry's (name, id, path), whatever the asking gateway had cached."""

from __future__ import annotations

from kvflow.shared.lora import LoRAError
from kvflow.shared.messages import LoRARef


class LoraRegistry:
    """Adapters by name; ids in load order, unique among the adapters that exist."""

    def __init__(self, static: list[LoRARef], enabled: bool) -> None:
        self.enabled = enabled
        self.adapters: dict[str, LoRARef] = {a.name: a for a in static}
        self.next_id = max((a.id for a in static), default=0) + 1

    def list(self) -> list[LoRARef]:
        return list(self.adapters.values())

    def resolve(self, ref: LoRARef) -> LoRARef:
        """The registered adapter a request names; raises LoRAError (404) when there is none."""
        got = self.adapters.get(ref.name)
        if got is None:
            raise LoRAError(f"The model `{ref.name}` does not exist.", "model", 404)
        return got

    def check_new(self, name: str, path: str, base_model: str) -> bool:
        """Whether ``name`` must be loaded from ``path``: False when it already is (from the
        same path: loading is idempotent); raises LoRAError (400) when it may not be."""
        if not self.enabled:
            raise LoRAError("LoRA adapters are off: start the server with --enable-lora", None)
        if not name or not path:
            raise LoRAError("both lora_name and lora_path are required", "lora_name")
        if name == base_model:
            raise LoRAError(f"`{name}` is the base model's name", "lora_name")
        have = self.adapters.get(name)
        if have is None:
            return True
        if have.path == path:
            return False
        raise LoRAError(
            f"The lora adapter '{name}' has already been loaded (from {have.path}); "
            "unload it first",
            "lora_name",
        )

    def add(self, name: str, path: str) -> LoRARef:
        """Register ``name`` (checked) with the next id."""
        ref = self.adapters[name] = LoRARef(name, self.next_id, path)
        self.next_id += 1
        return ref

    def restore(self, ref: LoRARef) -> None:
        """Register an adapter with its id (from the previous leader)."""
        self.adapters[ref.name] = ref
        self.next_id = max(self.next_id, ref.id + 1)

    def remove(self, name: str) -> LoRARef:
        """Forget ``name``; raises LoRAError (404) when there is no such adapter."""
        if not self.enabled:
            raise LoRAError("LoRA adapters are off: start the server with --enable-lora", None)
        got = self.adapters.pop(name, None)
        if got is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", "lora_name", 404)
        return got
