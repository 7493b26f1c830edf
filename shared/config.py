"""Settings of every kvflow service, in one section per concern (model, cache, scheduler,
worker, bus, gateway, ops) composed into ``Settings``; a service is handed the sections it uses.

Values come from defaults, then ``KVFLOW_*`` environment variables, then command-line flags.
Flag and variable names are flat, as deployments write them: each section field is a flag
(``block_size`` -> ``--block-size``, ``KVFLOW_BLOCK_SIZE``), named by its ``flag`` metadata
where the field's own name differs (``ModelSettings.path`` is ``--model``)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvflow.shared.model_settings import ModelSettings

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


@dataclass
class CacheSettings:
    """The paged KV cache and its tiers (host memory, Redis) and transport between workers."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory: float = field(
        default=1.0, metadata={"help": "GiB of KV cache per worker (CPU)"}
    )
    num_kv_blocks: int = field(
        default=0, metadata={"help": "KV blocks per worker (0: from --kv-cache-memory)"}
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "what the KV cache holds (vLLM's --kv-cache-dtype): auto (the model's "
            "dtype; bfloat16 on the CPU path's --dtype bfloat16) | bfloat16 (on the CPU path "
            "with any --dtype and --quantization: half the bytes each decode step reads, keys "
            "and values rounded to bf16, arithmetic in fp32; on a GPU only with --dtype "
            "bfloat16) | float32 (the CPU path: the exact cache under --dtype bfloat16)",
            "choices": KV_CACHE_DTYPES,
        },
    )
    kv_host_memory: float = field(
        default=0.0,
        metadata={"help": "GiB of host memory per worker for evicted KV blocks (0: no host tier)"},
    )
    kv_redis_tier: bool = field(
        default=False,
        metadata={
            "help": "store computed KV blocks in Redis (--redis-url) and load them instead of "
            "recomputing, across workers and restarts"
        },
    )
    kv_tier_ttl: int = field(
        default=3600, metadata={"help": "seconds a KV block stays in the Redis tier"}
    )
    kv_connector: str = field(
        default="nats",
        metadata={
            "help": "how workers move KV blocks between them (disaggregated prefill): nats | "
            "inproc (workers in one process: tests)"
        },
    )


@dataclass
class SchedulerSettings:
    """Batching limits, queue policy and failure timeouts of the scheduler."""

    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "most tokens in one step (chunked prefill budget)"}
    )
    max_waiting: int = field(
        default=1024, metadata={"help": "waiting-queue limit; past it requests get 429"}
    )
    scheduling_policy: str = field(
        default="priority",
        metadata={
            "help": "priority: waiting requests by (priority, arrival), lower first; under "
            "memory pressure the lowest-priority newest sequence is preempted | fcfs: arrival "
            "order, request priorities ignored, the newest sequence preempted (vLLM's "
            "--scheduling-policy)",
            "choices": ("fcfs", "priority"),  # services/scheduler/policy.py's POLICIES
        },
    )
    worker_timeout: float = field(
        default=3.0, metadata={"help": "seconds without a heartbeat before a worker is given up"}
    )
    step_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds without a step's result before its sequences are recomputed, "
            "unless the worker's heartbeats say it is still computing that step (then it is "
            "waited for: slow is not lost)"
        },
    )
    async_scheduling: bool = field(
        default=True,
        metadata={
            "help": "plan each worker's next step while it computes the current one (two plans "
            "in flight; a token not sampled yet is filled in by the worker), so the worker does "
            "not wait for the scheduler between steps (vLLM's --async-scheduling); false: one "
            "plan at a time"
        },
    )
    scheduler_ha: bool = field(
        default=False,
        metadata={"help": "compete for the leader lease in Redis (run two or more schedulers)"},
    )
    scheduler_id: str = field(default="", metadata={"help": "scheduler id (default: random)"})


@dataclass
class WorkerSettings:
    """One worker process: its identity and role, device and backend (model or sim)."""

    worker_id: str = field(default="", metadata={"help": "worker id (default: random)"})
    role: str = field(default="both", metadata={"help": "worker role: both | prefill | decode"})
    device: str = field(
        default="auto",
        metadata={"help": "worker device: auto (cuda when a GPU is visible) | cpu | cuda | cuda:N"},
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "on CUDA, run decode steps eagerly instead of as CUDA graphs"},
    )
    threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads per worker rank, for its kernels' pool and torch (0: its share "
            "of the CPUs this process may use: affinity capped by the cgroup quota)"
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks (devices) one worker's model is split over, Megatron-style: the "
            "worker starts the other ranks itself (gloo on CPU, NCCL on CUDA)"
        },
    )
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "pipeline stages per worker (only 1: not supported yet)"}
    )
    worker_backend: str = field(
        default="model",
        metadata={
            "help": "model: run the model | sim: a simulated worker (no weights: a step-time "
            "model and deterministic tokens; for pipeline benchmarks and scale tests)"
        },
    )
    sim_step_ms: float = field(
        default=0.0, metadata={"help": "sim backend: model time of every step, in ms"}
    )
    sim_cost_model: str = field(
        default="",
        metadata={
            "help": "sim backend: step time from a cost model instead (a JSON file of "
            "StepCostModel's coefficients, or 'cpu' for SmolLM2 on a 2-core CPU)"
        },
    )
    native_kernels: bool = field(
        default=True,
        metadata={
            "help": "the CPU path's native C kernels (compiled once into --cache-dir; without "
            "a C compiler the PyTorch reference runs); false: the reference everywhere (for "
            "comparing, or where the compiler builds bad code)"
        },
    )


@dataclass
class BusSettings:
    """Where services meet, NATS (required) and Redis (optional), and how a service logs in
    to them (shared/access/connect.py)."""

    nats_url: str = field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL"})
    redis_url: str = field(
        default="",
        metadata={
            "help": "Redis URL (optional; rediss:// for TLS); Redis with Sentinel: "
            "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB] (the sentinels; the primary "
            "is found and followed through them)"
        },
    )
    nats_user: str = field(
        default="",
        metadata={"help": "NATS user (default: the service's role, when a password file is given)"},
    )
    nats_password_file: str = field(
        default="",
        metadata={
            "help": "file holding this service's NATS password ('' = no credentials; "
            "`kvflow auth init` makes one per role)"
        },
    )
    nats_tls_ca: str = field(
        default="",
        metadata={"help": "CA file to verify the NATS server's certificate (turns TLS on)"},
    )
    nats_tls_cert: str = field(
        default="", metadata={"help": "client certificate for NATS (servers that verify clients)"}
    )
    nats_tls_key: str = field(default="", metadata={"help": "key of --nats-tls-cert"})
    redis_user: str = field(
        default="",
        metadata={
            "help": "Redis ACL user (default: the service's role, when a password file is given)"
        },
    )
    redis_password_file: str = field(
        default="",
        metadata={"help": "file holding this service's Redis password ('' = no credentials)"},
    )
    redis_tls_ca: str = field(
        default="", metadata={"help": "CA file to verify a rediss:// server's certificate"}
    )


@dataclass
class GatewaySettings:
    """The HTTP API: bind address, authentication, per-request limits and how often streamed
    output goes to the client."""

    host: str = field(default="127.0.0.1", metadata={"help": "gateway bind host"})
    port: int = field(default=8000, metadata={"help": "gateway bind port"})
    request_timeout: float = field(
        default=600.0, metadata={"help": "seconds a gateway request may take"}
    )
    api_key: str = field(
        default="",
        metadata={"help": "the API key clients must send (Authorization: Bearer KEY); '' = open"},
    )
    key_store: str = field(
        default="",
        metadata={
            "help": "'redis': also accept keys made with `kvflow keys add` (in --redis-url), "
            "with their rate limits; '' = off"
        },
    )
    cache_salt_per_key: bool = field(
        default=False,
        metadata={
            "help": "salt every request's prefix-cache keys with its API key (and any "
            "cache_salt it gives), so tenants never share cached blocks (multi-tenant)"
        },
    )
    enable_auto_tool_choice: bool = field(
        default=True,
        metadata={
            "help": "let the model decide to call tools (tool_choice 'auto', the default when a "
            "request has tools) and parse its calls with --tool-call-parser; false: 'auto' is a "
            "400, as vLLM without the flag ('required' and named functions always work)"
        },
    )
    tool_call_parser: str = field(
        default="hermes",
        metadata={
            "help": "how tool calls are found in the model's text under 'auto': hermes "
            '(<tool_call>{"name": ..., "arguments": ...}</tool_call>) | llama3_json (a JSON '
            'object {"name": ..., "parameters": ...}, several joined by \';\')',
            "choices": ("hermes", "llama3_json"),  # services/detokenizer/tool_parsers' PARSERS
        },
    )
    max_n: int = field(default=16, metadata={"help": "largest n / best_of per request"})
    max_open_requests: int = field(
        default=2048,
        metadata={"help": "requests one gateway holds open at once; past it new ones get 429"},
    )
    max_request_sequences: int = field(
        default=256, metadata={"help": "most sequences per request (prompts x best_of)"}
    )
    max_body_bytes: int = field(
        default=16 * 2**20, metadata={"help": "largest request body in bytes (413 above)"}
    )
    stream_interval: int = field(
        default=1,
        metadata={
            "help": "tokens per streamed delta, as vLLM's: 1 sends each token as it comes; N > 1 "
            "sends the first token at once, then every N tokens and the last (fewer messages, "
            "SSE events and socket writes per token: less CPU per token under load)"
        },
    )


@dataclass
class OpsSettings:
    """What every service shares: logging, the ops endpoint, the drain time and the machine's
    cache."""

    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    log_format: str = field(
        default="text",
        metadata={"help": "text | json (one object per line, with request and trace ids)"},
    )
    ops_port: int = field(
        default=0,
        metadata={
            "help": "port of the /health and /metrics endpoint of non-gateway services; 0 = off"
        },
    )
    drain_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds a draining service (SIGTERM) may take to finish its work"},
    )
    cache_dir: str = field(
        default="",
        metadata={
            "help": "where this machine keeps what kvflow computes once (compiled CPU kernels, "
            "GEMM calibrations, converted tokenizers, benchmark exports), shared by every "
            "process on it ('' = ~/.cache/kvflow)"
        },
    )

    def cache_root(self) -> Path:
        """The machine cache's folder: ``cache_dir``, or ``~/.cache/kvflow`` when empty. Each
        user of it keeps its own folder inside (kernels/, gemm-rows/, tokenizers/, ...)."""
        return Path(self.cache_dir) if self.cache_dir else Path.home() / ".cache" / "kvflow"


@dataclass
class Settings:
    """All sections; built once at a process's entry point (``from_args`` / ``from_env``)."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    bus: BusSettings = field(default_factory=BusSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    ops: OpsSettings = field(default_factory=OpsSettings)

    @classmethod
    def options(cls) -> list[Option]:
        """Every flag, in section order."""
        return list(_OPTIONS.values())

    @classmethod
    def of(cls, **flat: Any) -> Settings:
        """Settings from flat option names (``Settings.of(model="m.gguf", block_size=32)``),
        as the Python API's keyword arguments and tests give them."""
        return cls().replace(**flat)

    def replace(self, **flat: Any) -> Settings:
        """A copy with the options named by their flat names changed."""
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            if name not in _OPTIONS:
                raise TypeError(f"no setting named {name!r}")
            opt = _OPTIONS[name]
            by_section.setdefault(opt.section, {})[opt.attr] = value
        changed = {
            s: dataclasses.replace(getattr(self, s), **values) for s, values in by_section.items()
        }
        return dataclasses.replace(self, **changed)

    def get(self, name: str) -> Any:
        """The value of the option with flat name ``name``."""
        opt = _OPTIONS[name]
        return getattr(getattr(self, opt.section), opt.attr)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Defaults, then the ``KVFLOW_*`` variables of ``environ`` (default: this process's);
        called only at a process's entry point (``from_args``), never by library code."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for opt in _OPTIONS.values():
            raw = env.get(opt.env)
            if raw is not None:
                values[opt.name] = opt.convert(raw)
        return cls.of(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per option; defaults stay None so only given flags override."""
        for opt in _OPTIONS.values():
            extra: dict[str, Any] = {}
            if opt.type == "bool":  # `--flag` alone means true; `--flag false` works too
                extra = {"nargs": "?", "const": True}
            if opt.choices:
                extra["choices"] = opt.choices
            if opt.nargs:  # `--lora-modules a=PATH b=PATH`: one shell-quoted string
                extra["nargs"] = opt.nargs
            parser.add_argument(
                opt.flag,
                dest=opt.name,
                type=_PARSERS.get(opt.type, str),
                default=None,
                help=opt.help,
                **extra,
            )

    @classmethod
    def from_args(cls, ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
        given = {n: getattr(ns, n) for n in _OPTIONS if getattr(ns, n, None) is not None}
        for n, value in given.items():
            if isinstance(value, list):
                given[n] = shlex.join(value)
        return cls.from_env(environ).replace(**given)

    def to_env(self) -> dict[str, str]:
        """The settings as KVFLOW_* variables, for child processes."""
        return {opt.env: str(self.get(opt.name)) for opt in _OPTIONS.values()}


def variable(name: str) -> str:
    """The KVFLOW_* variable of the setting ``name`` (``nats_url``: KVFLOW_NATS_URL), for tools
    that read another process's environment to tell which stack and service it is."""
    return _OPTIONS[name].env


def check_stream_interval(settings: Settings) -> None:
    """ValueError (saying what to do) for a ``--stream-interval`` below 1."""
    n = settings.gateway.stream_interval
    if n < 1:
        raise ValueError(f"--stream-interval must be at least 1 (1 = every token), not {n}")


@dataclass(frozen=True)
class Option:
    """One flat option: where it lives (``section``.``attr``) and its names outside."""

    name: str  # flat name: ``block_size``
    section: str  # attribute of Settings: ``cache``
    attr: str  # field of the section: ``block_size``
    type: str  # "int" | "float" | "str" | "bool"
    help: str
    choices: tuple[str, ...] = ()  # the values allowed, when the option is one of a few names
    nargs: str = ""  # "+": the flag takes several values, kept as one shell-quoted string

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "KVFLOW_" + self.name.upper()

    def convert(self, raw: str) -> Any:
        try:
            value = _PARSERS.get(self.type, str)(raw)
        except ValueError as e:
            raise ValueError(f"{self.env}={raw!r} is not a valid {self.type}") from e
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.env}={raw!r} is not one of {', '.join(self.choices)}")
        return value


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not a boolean (true/false)")


_PARSERS: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": _parse_bool}


def _options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    for section in fields(Settings):
        for f in fields(section.default_factory):  # type: ignore[arg-type]
            name = f.metadata.get("flag", f.name)
            assert name not in out, f"two settings named {name}"
            out[name] = Option(
                name,
                section.name,
                f.name,
                str(f.type),
                f.metadata.get("help", ""),
                tuple(f.metadata.get("choices", ())),
                f.metadata.get("nargs", ""),
            )
    return out


_OPTIONS = _options()
