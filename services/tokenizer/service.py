"""The tokenizer service: stateless, in a queue group, so any number of instances share the
load. GenerateRequest in; TokenizedRequest out to the scheduler and detokenizer, or RequestError
straight back to the gateway's inbox."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.msg import Msg

from services.tokenizer.prompts import (
    PromptError,
    check_length,
    check_logit_bias,
    prompt_token_ids,
)
from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import GenerateRequest, Message, RequestError, TokenizedRequest

log = logging.getLogger("kvflow.tokenizer")


class TokenizerService:
    def __init__(
        self, settings: Settings, tokenizer: Any, max_model_len: int, eos_ids: list[int]
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.bus = Bus("tokenizer")

    async def start(self) -> None:
        await self.bus.connect(self.settings.nats_url)
        await self.bus.subscribe(
            subjects.TOKENIZE, self._on_message, queue=subjects.TOKENIZER_QUEUE
        )
        log.info("tokenizer ready")

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        if not isinstance(msg, GenerateRequest):
            log.warning("tokenizer: unexpected %s", type(msg).__name__)
            return
        try:
            ids = prompt_token_ids(self.tokenizer, msg)
            params = check_length(ids, msg.params, self.max_model_len)
            check_logit_bias(params, len(self.tokenizer))
        except PromptError as e:
            await self.bus.publish(msg.reply_to, e.to_message(msg.request_id))
            return
        except Exception as e:  # noqa: BLE001 - the request fails, the service goes on
            log.exception("tokenizer: request %s failed", msg.request_id)
            err = RequestError(
                msg.request_id, f"tokenization failed: {e}", "InternalServerError", None, 500
            )
            await self.bus.publish(msg.reply_to, err)
            return
        out = TokenizedRequest(
            request_id=msg.request_id,
            reply_to=msg.reply_to,
            prompt_token_ids=ids,
            params=params,
            arrival_time=msg.arrival_time,
            eos_token_ids=self.eos_ids,
            priority=msg.priority,
        )
        await self.bus.publish(subjects.REQUESTS, out)


async def run(settings: Settings) -> None:
    from shared.model_loader import load_config
    from shared.model_source import load_tokenizer, resolve_model
    from shared.ops_http import start_ops_server

    ops = start_ops_server(settings.ops_port, "tokenizer")
    src = resolve_model(settings.model, settings.served_model_name)
    cfg = load_config(src)
    tok = load_tokenizer(src)
    max_len = min(settings.max_model_len, cfg.max_position_embeddings)
    service = TokenizerService(settings, tok, max_len, list(cfg.eos_token_ids))
    await service.start()
    ops.set_ready(lambda: service.bus.client.is_connected, service.bus)
    await asyncio.Event().wait()
