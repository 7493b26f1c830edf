"""Settings in sections: every flag and KVFLOW_* variable of the former flat Settings keeps its
name and parses to the same value, now found in its section."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.cli.main import build_parser
from kvflow.shared.config import (
    BusSettings,
    CacheSettings,
    GatewaySettings,
    ModelSettings,
    OpsSettings,
    SchedulerSettings,
    Settings,
    WorkerSettings,
)

# every option of the flat Settings (as of 121959d): name -> (section.attr, a given value, its
# parsed value, the default)
OLD_FLAT = {
    "model": ("model.path", "/m/x.gguf", "/m/x.gguf", ""),
    "served_model_name": ("model.served_model_name", "alias", "alias", ""),
    "model_impl": ("model.model_impl", "transformers", "transformers", "auto"),
    "nats_url": ("bus.nats_url", "nats://h:1", "nats://h:1", "nats://127.0.0.1:4222"),
    "redis_url": ("bus.redis_url", "redis://h:2", "redis://h:2", ""),
    "host": ("gateway.host", "0.0.0.0", "0.0.0.0", "127.0.0.1"),
    "port": ("gateway.port", "9000", 9000, 8000),
    "ops_port": ("ops.ops_port", "9100", 9100, 0),
    "block_size": ("cache.block_size", "32", 32, 16),
    "kv_cache_memory": ("cache.kv_cache_memory", "2.5", 2.5, 1.0),
    "num_kv_blocks": ("cache.num_kv_blocks", "100", 100, 0),
    "kv_cache_dtype": ("cache.kv_cache_dtype", "bfloat16", "bfloat16", "auto"),
    "kv_host_memory": ("cache.kv_host_memory", "0.5", 0.5, 0.0),
    "kv_redis_tier": ("cache.kv_redis_tier", "true", True, False),
    "kv_tier_ttl": ("cache.kv_tier_ttl", "60", 60, 3600),
    "max_num_seqs": ("scheduler.max_num_seqs", "8", 8, 64),
    "max_num_batched_tokens": ("scheduler.max_num_batched_tokens", "512", 512, 2048),
    "max_model_len": ("model.max_model_len", "4096", 4096, 8192),
    "max_waiting": ("scheduler.max_waiting", "10", 10, 1024),
    "worker_id": ("worker.worker_id", "w7", "w7", ""),
    "role": ("worker.role", "prefill", "prefill", "both"),
    "dtype": ("model.dtype", "bfloat16", "bfloat16", "auto"),
    "device": ("worker.device", "cuda:1", "cuda:1", "auto"),
    "quantization": ("model.quantization", "int8", "int8", ""),
    "enforce_eager": ("worker.enforce_eager", "yes", True, False),
    "threads": ("worker.threads", "3", 3, 0),
    "worker_backend": ("worker.worker_backend", "sim", "sim", "model"),
    "sim_step_ms": ("worker.sim_step_ms", "1.5", 1.5, 0.0),
    "sim_cost_model": ("worker.sim_cost_model", "cpu", "cpu", ""),
    "scheduling_policy": ("scheduler.scheduling_policy", "fcfs", "fcfs", "priority"),
    "kv_connector": ("cache.kv_connector", "nats", "nats", "nats"),
    "worker_timeout": ("scheduler.worker_timeout", "4.5", 4.5, 3.0),
    "step_timeout": ("scheduler.step_timeout", "12", 12.0, 30.0),
    "async_scheduling": ("scheduler.async_scheduling", "false", False, True),
    "scheduler_ha": ("scheduler.scheduler_ha", "1", True, False),
    "scheduler_id": ("scheduler.scheduler_id", "s1", "s1", ""),
    "speculative_config": (
        "model.speculative_config",
        '{"method": "ngram", "num_speculative_tokens": 2}',
        '{"method": "ngram", "num_speculative_tokens": 2}',
        "",
    ),
    "drain_timeout": ("ops.drain_timeout", "7", 7.0, 30.0),
    "request_timeout": ("gateway.request_timeout", "60", 60.0, 600.0),
    "log_level": ("ops.log_level", "debug", "debug", "info"),
    "log_format": ("ops.log_format", "json", "json", "text"),
    "api_key": ("gateway.api_key", "k", "k", ""),
    "key_store": ("gateway.key_store", "redis", "redis", ""),
    "max_n": ("gateway.max_n", "4", 4, 16),
    "max_open_requests": ("gateway.max_open_requests", "5", 5, 2048),
    "max_request_sequences": ("gateway.max_request_sequences", "6", 6, 256),
    "max_body_bytes": ("gateway.max_body_bytes", "1024", 1024, 16 * 2**20),
    # added with access control (issue 22)
    "nats_user": ("bus.nats_user", "u", "u", ""),
    "nats_password_file": ("bus.nats_password_file", "/s/p", "/s/p", ""),
    "nats_tls_ca": ("bus.nats_tls_ca", "/s/ca", "/s/ca", ""),
    "nats_tls_cert": ("bus.nats_tls_cert", "/s/c", "/s/c", ""),
    "nats_tls_key": ("bus.nats_tls_key", "/s/k", "/s/k", ""),
    "redis_user": ("bus.redis_user", "r", "r", ""),
    "redis_password_file": ("bus.redis_password_file", "/s/rp", "/s/rp", ""),
    "redis_tls_ca": ("bus.redis_tls_ca", "/s/rca", "/s/rca", ""),
    "cache_salt_per_key": ("gateway.cache_salt_per_key", "true", True, False),
    "chat_template": ("model.chat_template", "/t/x.jinja", "/t/x.jinja", ""),
    "enable_auto_tool_choice": ("gateway.enable_auto_tool_choice", "false", False, True),
    "tool_call_parser": ("gateway.tool_call_parser", "llama3_json", "llama3_json", "hermes"),
    "pooling_type": ("model.pooling_type", "MEAN", "MEAN", ""),
    "task": ("model.task", "embed", "embed", "auto"),
    "enable_lora": ("model.enable_lora", "true", True, False),
    "lora_modules": ("model.lora_modules", "a=/x", "a=/x", ""),
    "max_loras": ("model.max_loras", "4", 4, 1),
    "max_lora_rank": ("model.max_lora_rank", "64", 64, 16),
    # added with tensor parallelism (issue 20)
    "tensor_parallel_size": ("worker.tensor_parallel_size", "2", 2, 1),
    "pipeline_parallel_size": ("worker.pipeline_parallel_size", "2", 2, 1),
    # added with the stream interval (issue 37)
    "stream_interval": ("gateway.stream_interval", "4", 4, 1),
    # added with the layer rules (issue 64): read before by the machine cache and the kernels
    "cache_dir": ("ops.cache_dir", "/var/cache/kvflow", "/var/cache/kvflow", ""),
    "native_kernels": ("worker.native_kernels", "0", False, True),
}


def _in_section(settings: Settings, where: str) -> object:
    section, attr = where.split(".")
    return getattr(getattr(settings, section), attr)


def test_every_option_is_listed_once() -> None:
    assert {opt.name for opt in Settings.options()} == set(OLD_FLAT)
    assert len(Settings.options()) == len(OLD_FLAT)


@pytest.mark.parametrize("name", sorted(OLD_FLAT))
def test_old_flag_and_variable_parse_to_the_same_value(name: str) -> None:
    where, raw, value, default = OLD_FLAT[name]
    assert _in_section(Settings(), where) == default
    flag = "--" + name.replace("_", "-")
    args = build_parser().parse_args(["run", "worker", flag, raw])
    from_flag = Settings.from_args(args, environ={})
    assert _in_section(from_flag, where) == value
    assert from_flag.get(name) == value
    from_env = Settings.from_env({"KVFLOW_" + name.upper(): raw})
    assert _in_section(from_env, where) == value
    # a flag wins over the environment; to_env gives the child processes the same value back
    assert _in_section(Settings.from_args(args, {"KVFLOW_" + name.upper(): raw}), where) == value
    assert _in_section(Settings.from_env(from_flag.to_env()), where) == value


def test_sections_compose_and_replace_keeps_the_rest() -> None:
    s = Settings.of(model="m.gguf", block_size=32, port=9)
    assert isinstance(s.model, ModelSettings) and s.model.path == "m.gguf"
    assert isinstance(s.cache, CacheSettings) and s.cache.block_size == 32
    assert isinstance(s.gateway, GatewaySettings) and s.gateway.port == 9
    assert isinstance(s.scheduler, SchedulerSettings) and isinstance(s.worker, WorkerSettings)
    assert isinstance(s.bus, BusSettings) and isinstance(s.ops, OpsSettings)
    t = s.replace(threads=2)
    assert t.worker.threads == 2 and t.cache.block_size == 32 and s.worker.threads == 0
    with pytest.raises(TypeError, match="no setting named"):
        s.replace(block_sise=1)
    with pytest.raises(AttributeError):  # values live in their sections only
        _ = s.block_size


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="KVFLOW_BLOCK_SIZE"):
        Settings.from_env({"KVFLOW_BLOCK_SIZE": "big"})
    with pytest.raises(ValueError, match="KVFLOW_KV_REDIS_TIER"):
        Settings.from_env({"KVFLOW_KV_REDIS_TIER": "maybe"})


def test_help_keeps_the_texts() -> None:
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in run._actions}
    assert helps["model"].startswith("GGUF file or HF model dir (default: SmolLM2-135M")
    assert helps["block_size"] == "tokens per KV cache block"
    assert helps["max_body_bytes"] == "largest request body in bytes (413 above)"
    assert all(helps[opt.name] for opt in Settings.options())


def test_a_setting_with_choices_refuses_others_as_flag_and_as_variable() -> None:
    from kvflow.services.scheduler.policy import POLICIES

    (opt,) = [o for o in Settings.options() if o.name == "scheduling_policy"]
    assert set(opt.choices) == set(POLICIES)  # the flag offers exactly the policies there are
    parser = build_parser()
    ns = parser.parse_args(["run", "scheduler", "--scheduling-policy", "fcfs"])
    assert Settings.from_args(ns, environ={}).scheduler.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "scheduler", "--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="KVFLOW_SCHEDULING_POLICY='lifo' is not one of"):
        Settings.from_env({"KVFLOW_SCHEDULING_POLICY": "lifo"})


def test_a_stream_interval_below_1_is_refused_saying_what_it_means() -> None:
    from kvflow.shared.config import check_stream_interval

    check_stream_interval(Settings.of(stream_interval=1))
    with pytest.raises(ValueError, match="--stream-interval must be at least 1"):
        check_stream_interval(Settings.of(stream_interval=0))


def test_the_cache_dir_is_the_setting_or_the_home_cache() -> None:
    """KVFLOW_CACHE_DIR (`--cache-dir`) is a setting like any other: unset or empty, it is
    ~/.cache/kvflow."""
    home = Path.home() / ".cache" / "kvflow"
    assert Settings().ops.cache_root() == home
    assert Settings.from_env({"KVFLOW_CACHE_DIR": ""}).ops.cache_root() == home
    assert Settings.from_env({"KVFLOW_CACHE_DIR": "/c"}).ops.cache_root() == Path("/c")
