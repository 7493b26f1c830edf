"""A short headless Locust run (loadtest/locustfile.py) against `kvflow serve`: a few users
stream chat completions for a bounded time; it must finish with zero failures and report time
to first token, inter-token latency and end-to-end latency."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.helpers.stack import ROOT

pytestmark = pytest.mark.e2e

USERS = 3
RUN_TIME = "10s"  # several requests per user: what the checks below need


def test_locust_streams_with_zero_failures_and_reports_ttft(stack, tmp_path) -> None:
    env = {**os.environ, "LOADTEST_SCALE": "0.25", "LOADTEST_SEED": "1"}  # short requests
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
        "--headless", "--host", stack, "--users", str(USERS), "--spawn-rate", str(USERS),
        "--run-time", RUN_TIME, "--stop-timeout", "60", "--only-summary",
        "--csv", str(tmp_path / "kvflow"), "--html", str(tmp_path / "kvflow.html"),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    with open(tmp_path / "kvflow_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    failures = (tmp_path / "kvflow_failures.csv").read_text()
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0, failures
    name = "/v1/chat/completions"
    ttft, itl, e2e = rows[("TTFT", name)], rows[("ITL", name)], rows[("E2E", name)]
    post = rows[("POST", f"{name} (headers)")]
    assert int(post["Request Count"]) >= 1
    assert int(ttft["Request Count"]) == int(e2e["Request Count"]) == int(post["Request Count"])
    assert int(itl["Request Count"]) > int(ttft["Request Count"])  # several tokens each
    # the first token of a request comes before its end
    assert float(ttft["Median Response Time"]) <= float(e2e["Median Response Time"])
    html = (tmp_path / "kvflow.html").read_text()
    assert "TTFT" in html and "ITL" in html
