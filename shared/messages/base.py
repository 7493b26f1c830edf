"""Shared pieces of every wire message: why a sequence finished, and the tagged base."""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.IntEnum):
    """Why a sequence stopped. NONE means it goes on."""

    NONE = 0
    STOP = 1  # EOS, a stop token id or a stop string
    LENGTH = 2  # max_tokens or max_model_len reached
    ABORT = 3  # cancelled by the client or the system
    ERROR = 4

    def openai(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(self))


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="k"):
    pass
