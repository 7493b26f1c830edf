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
        return _OPENAI_NAMES[self]

    @staticmethod
    def of(value: int) -> FinishReason:
        """``FinishReason(value)`` without the enum machinery (a tuple lookup): it runs once per
        generated token in the detokenizer. A value out of range raises ValueError as the enum
        would."""
        return _BY_VALUE[value] if 0 <= value < len(_BY_VALUE) else FinishReason(value)


_OPENAI_NAMES = (None, "stop", "length", "abort", "error")
_BY_VALUE = tuple(FinishReason)
assert [int(r) for r in _BY_VALUE] == list(range(len(_BY_VALUE))) == list(range(len(_OPENAI_NAMES)))


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="k"):
    pass
