"""``kvflow keys`` reads its Redis connection as the services do (KVFLOW_REDIS_* through
Settings), with its own flags over the environment."""

from __future__ import annotations

import argparse

import pytest

from kvflow.cli.keys import add_arguments, redis_settings


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([*argv, "list"])


def test_the_environment_is_read_through_settings_and_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFLOW_REDIS_URL", "redis://env:6379")
    monkeypatch.setenv("KVFLOW_REDIS_PASSWORD_FILE", "/run/admin.pw")
    bus = redis_settings(_args())
    assert (bus.redis_url, bus.redis_password_file) == ("redis://env:6379", "/run/admin.pw")
    bus = redis_settings(_args("--redis-url", "redis://flag:1"))
    assert (bus.redis_url, bus.redis_password_file) == ("redis://flag:1", "/run/admin.pw")


def test_a_bad_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_WORKER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="KVFLOW_WORKER_TIMEOUT"):
        redis_settings(_args())
