"""``--kv-cache-dtype``: which dtype the paged KV cache holds (services/worker/model_setup.py
``kv_cache_dtype``), from the flag through the settings to the runner's spec."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvflow.services.worker.model_setup import kv_cache_dtype, runner_specs
from kvflow.shared.config import Settings

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DEVICE_OPS = object()  # the device path's kernel backend: only whether there is one matters


@pytest.mark.parametrize(
    ("asked", "dtype", "want"),
    [
        ("auto", F32, None),  # the model's own
        ("auto", BF16, BF16),  # the CPU path's --dtype bfloat16: bf16 GEMMs, a bf16 cache
        ("bfloat16", F32, BF16),  # any weights (w8a8 too): the cache alone rounded
        ("float32", BF16, None),  # --dtype bfloat16 with the exact cache
        ("float32", F32, None),
    ],
)
def test_the_cpu_path_holds_either_dtype(asked: str, dtype: torch.dtype, want: object) -> None:
    # the CPU path's model computes in fp32 whatever --dtype says
    assert kv_cache_dtype(asked, F32, dtype, None) == want


def test_the_device_path_keeps_the_models_dtype_and_says_what_to_pass() -> None:
    assert kv_cache_dtype("auto", F16, F16, DEVICE_OPS) is None
    # weights given in bf16 with --dtype left at its default: auto is the model's dtype there
    # (a bf16 model on the H200 was refused "pass --dtype auto or leave --kv-cache-dtype auto")
    assert kv_cache_dtype("auto", BF16, F32, DEVICE_OPS) is None
    assert kv_cache_dtype("bfloat16", BF16, BF16, DEVICE_OPS) is None
    with pytest.raises(ValueError, match="pass --dtype bfloat16 or leave --kv-cache-dtype auto"):
        kv_cache_dtype("bfloat16", F16, F16, DEVICE_OPS)
    with pytest.raises(ValueError, match="must be one of auto, bfloat16, float32"):
        kv_cache_dtype("fp8", F32, F32, None)


def parse(args: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    return Settings.from_args(parser.parse_args(args), environ={} if environ is None else environ)


def device_spec(s: Settings) -> object:
    return runner_specs(s.model, s.cache, s.worker, s.scheduler.max_num_seqs)[1]


def test_the_flag_and_the_variable_reach_the_runners_spec() -> None:
    s = parse(["--kv-cache-dtype", "bfloat16", "--device", "cpu"])
    assert s.cache.kv_cache_dtype == device_spec(s).kv_cache_dtype == "bfloat16"
    s = parse(["--device", "cpu"], {"KVFLOW_KV_CACHE_DTYPE": "float32"})
    assert device_spec(s).kv_cache_dtype == "float32"
    assert device_spec(parse(["--device", "cpu"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):  # argparse's choices: fp8 is not one
        parse(["--kv-cache-dtype", "fp8"])
