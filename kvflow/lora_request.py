"""vLLM's ``LoRARequest``: which LoRA adapter a prompt runs with in ``LLM.generate`` / ``LLM.chat``
(``lora_request=``). The adapter is loaded into the running stack by name the first time it is
used (every worker reads and checks it; the stack needs ``enable_lora=True``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: the adapter's name (unique per stack); ``lora_int_id``: vLLM's positive
    id (the stack numbers adapters itself; kept for vLLM's signature); ``lora_path``: a PEFT
    directory (adapter_config.json + adapter_model.safetensors) the workers can read."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest needs a lora_name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, not {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} needs a lora_path")
