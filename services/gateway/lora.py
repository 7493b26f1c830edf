"""The gateway's view of the LoRA adapters: which ``model`` names an adapter (``resolve``), the
adapter list for /v1/models, and the load/unload requests, all through the scheduler leader
(request/reply on ``kvflow.scheduler.lora``), which holds the registry. The list is cached: a
name the cache does not know asks the scheduler again, and the scheduler checks every request's
adapter itself, so a stale cache can neither serve an unloaded adapter nor miss a new one."""

from __future__ import annotations

from typing import Any

from kvflow.services.gateway.errors import APIError
from kvflow.shared import subjects
from kvflow.shared.config import Settings
from kvflow.shared.lora import parse_lora_modules
from kvflow.shared.messages import LoraAdapters, LoraList, LoraLoad, LoRARef, LoraUnload

LOAD_TIMEOUT_S = 75.0  # the scheduler waits up to 60 s for every worker to check an adapter


class GatewayLoras:
    def __init__(self, settings: Settings, base_model: str) -> None:
        ms = settings.model
        self.enabled = ms.enable_lora
        self.base_model = base_model
        self.known: dict[str, LoRARef] = (
            {r.name: r for r in parse_lora_modules(ms.lora_modules)} if self.enabled else {}
        )

    async def call(self, bus: Any, msg: LoraList | LoraLoad | LoraUnload) -> LoraAdapters:
        """Ask the scheduler; its answer updates the cache. Raises APIError for its refusals
        (in its status) and when no scheduler answers (503)."""
        timeout = LOAD_TIMEOUT_S if isinstance(msg, LoraLoad) else 2.0
        try:
            reply = await bus.request(subjects.SCHEDULER_LORA, msg, timeout)
        except Exception as e:  # noqa: BLE001 - no responder, timeout, closed connection
            raise APIError(
                503, f"no scheduler answered on {subjects.SCHEDULER_LORA} ({e})",
                "ServiceUnavailableError",
            ) from e  # fmt: skip
        if not isinstance(reply, LoraAdapters):
            raise APIError(
                503, f"unexpected reply {type(reply).__name__}", "ServiceUnavailableError"
            )
        self.known = {r.name: r for r in reply.adapters}
        if reply.error:
            kind = {404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
                reply.code, "BadRequestError"
            )
            raise APIError(reply.code, reply.error, kind, reply.param)
        return reply

    async def resolve(self, bus: Any, requested: str | None) -> tuple[str, LoRARef | None]:
        """The model a request names: the base (no ``model``, or the base's name) or an
        adapter; 404 naming ``model`` for anything else."""
        if not requested or requested == self.base_model:
            return self.base_model, None
        if self.enabled and requested not in self.known:
            try:
                await self.call(bus, LoraList())
            except APIError:
                pass  # answered from the cache; the scheduler checks the adapter again
        ref = self.known.get(requested)
        if ref is None:
            names = ", ".join(f"`{n}`" for n in [self.base_model, *self.known])
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves {names}.",
                "NotFoundError",
                "model",
            )
        return requested, ref

    async def listed(self, bus: Any) -> list[LoRARef]:
        """The adapters for /v1/models (the cache when the scheduler does not answer)."""
        if self.enabled:
            try:
                await self.call(bus, LoraList())
            except APIError:
                pass
        return list(self.known.values())
