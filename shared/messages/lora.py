"""LoRA adapters at run time: the gateway asks the scheduler (request/reply on
``kvflow.scheduler.lora``) to list, load or unload adapters; the scheduler has every live worker
check an adapter (``LoraLoad`` on the worker's step subject, request/reply) before it exists,
and tells them when one is gone (``LoraUnload``). Tags from 40 on."""

from __future__ import annotations

from kvflow.shared.messages.base import _Msg
from kvflow.shared.messages.params import LoRARef


class LoraLoad(_Msg, tag=40):
    """Add adapter ``name`` from the PEFT directory ``path`` (gateway -> scheduler), or check
    that it can be served (scheduler -> worker: read and validated, nothing kept)."""

    name: str
    path: str


class LoraUnload(_Msg, tag=41):
    """Remove adapter ``name`` (gateway -> scheduler); forget it (scheduler -> workers)."""

    name: str


class LoraList(_Msg, tag=42):
    """Which adapters exist (gateway -> scheduler)."""


class LoraAdapters(_Msg, tag=43):
    """The answer to each of the above: the adapters that exist now, or why not (``error``
    with an HTTP status in ``code`` and the request field it concerns in ``param``)."""

    adapters: list[LoRARef] = []
    error: str = ""
    code: int = 200
    param: str | None = None
