"""Every wire message of kvflow, and nothing else.

Messages are msgspec Structs encoded as msgpack arrays (``array_like=True``): field order is the
wire contract, so new fields are appended last with a default. Each message carries a tag, so a
subject may carry several kinds and one typed decoder (``decode``) reads them all.

Subjects (see ``shared/subjects.py``) and the flow:

    gateway --GenerateRequest--> tokenizer --TokenizedRequest--> scheduler (+ detokenizer)
    scheduler --StepPlan--> worker --StepResult--> scheduler + detokenizer
    detokenizer --DeltaBatch--> gateway inbox;  tokenizer --RequestError--> gateway inbox
    gateway/detokenizer --Abort--> scheduler + detokenizer

One module per part of the flow (base, params, requests, steps, outputs, kv, ops, lora); this package
re-exports every message and holds the one decoder.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.shared.messages.base import FinishReason
from kvflow.shared.messages.kv import (
    KvChunk,
    KvChunkRequest,
    KvLoad,
    KvLoadDone,
    KvPull,
    KvTransferDone,
)
from kvflow.shared.messages.lora import LoraAdapters, LoraList, LoraLoad, LoraUnload
from kvflow.shared.messages.ops import (
    DetokenizerClaims,
    LiveRequests,
    LiveRequestsQuery,
    MetricsReport,
    MetricsRequest,
    Ping,
    Pong,
)
from kvflow.shared.messages.outputs import (
    Delta,
    DeltaBatch,
    PromptTokenLogprob,
    TokenLogprob,
    ToolCallDelta,
)
from kvflow.shared.messages.params import (
    POOLING_TASKS,
    POOLING_TYPES,
    ChatMessage,
    LoRARef,
    PoolingParams,
    SamplingParams,
    StructuredOutput,
    ToolCall,
    ToolParsing,
    ToolSpec,
)
from kvflow.shared.messages.requests import (
    Abort,
    Accepted,
    DetokenizeRequest,
    DetokenizeResult,
    GenerateRequest,
    ModelInfo,
    ModelInfoRequest,
    RequestError,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
)
from kvflow.shared.messages.steps import (
    PLACEHOLDER,
    STALE_EPOCH_ERROR,
    BlockRef,
    NewRequest,
    PooledOutput,
    PromptLogprobs,
    SampleLogprobs,
    ScheduledSeq,
    SchedulerStats,
    StatsRequest,
    StepPlan,
    StepResult,
    StepVoid,
    WorkerHeartbeat,
    WorkerRelease,
    WorkerStats,
)

__all__ = [
    "PLACEHOLDER",
    "Abort",
    "Accepted",
    "BlockRef",
    "ChatMessage",
    "Delta",
    "DeltaBatch",
    "DetokenizeRequest",
    "DetokenizeResult",
    "ModelInfo",
    "ModelInfoRequest",
    "FinishReason",
    "GenerateRequest",
    "KvChunk",
    "KvChunkRequest",
    "KvLoad",
    "KvLoadDone",
    "KvPull",
    "KvTransferDone",
    "LoRARef",
    "LoraAdapters",
    "LoraList",
    "LoraLoad",
    "LoraUnload",
    "DetokenizerClaims",
    "LiveRequests",
    "LiveRequestsQuery",
    "Message",
    "MetricsReport",
    "MetricsRequest",
    "NewRequest",
    "POOLING_TASKS",
    "POOLING_TYPES",
    "Ping",
    "PoolingParams",
    "Pong",
    "PooledOutput",
    "PromptLogprobs",
    "PromptTokenLogprob",
    "RequestError",
    "STALE_EPOCH_ERROR",
    "SampleLogprobs",
    "SamplingParams",
    "ScheduledSeq",
    "SchedulerStats",
    "StatsRequest",
    "StepPlan",
    "StepResult",
    "StepVoid",
    "StructuredOutput",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "ToolParsing",
    "ToolSpec",
    "TokenizeRequest",
    "TokenizeResult",
    "TokenizedRequest",
    "WorkerHeartbeat",
    "WorkerRelease",
    "WorkerStats",
    "decode",
    "encode",
]

Message = (
    GenerateRequest
    | TokenizedRequest
    | Abort
    | StepPlan
    | StepResult
    | WorkerHeartbeat
    | DeltaBatch
    | RequestError
    | StatsRequest
    | SchedulerStats
    | KvPull
    | KvChunkRequest
    | KvChunk
    | KvTransferDone
    | WorkerRelease
    | Accepted
    | KvLoad
    | KvLoadDone
    | TokenizeRequest
    | TokenizeResult
    | DetokenizeRequest
    | DetokenizeResult
    | ModelInfoRequest
    | ModelInfo
    | MetricsRequest
    | MetricsReport
    | Ping
    | Pong
    | LoraLoad
    | LoraUnload
    | LoraList
    | LoraAdapters
    | StepVoid
    | DetokenizerClaims
    | LiveRequestsQuery
    | LiveRequests
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode any kvflow message; raises ``msgspec.DecodeError`` or ``ValidationError``."""
    return _decoder.decode(data)
