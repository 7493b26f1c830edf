"""Fault injection on one real stack: `kvflow serve --schedulers 2 --prefill-workers 1
--decode-workers 2` (real processes, real NATS and Redis). Garbage on every subject, a decode
worker killed with SIGKILL mid-stream, the leading scheduler killed, NATS stopped and started
again, a second detokenizer drained and one killed, a flood above capacity, and SIGTERM with a
request open. Users see none of it: streams go on with the same text (a killed detokenizer's
requests taken over by the other), requests complete or fail clearly, and the stack keeps
serving. The tests run in this order on the same stack; the last one shuts it down."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvflow.shared.access.grants import NATS_ROLES
from kvflow.shared.infra import start_nats
from tests.helpers.faults import (
    MODEL,
    Stream,
    rss_mib,
    service_pids,
    stack_credentials,
    stack_urls,
)
from tests.helpers.stack import ROOT, wait_all_blocks_free

pytestmark = pytest.mark.e2e
NAME = "faults"


@pytest.fixture(scope="module")
def faults_stack():
    """Its own launcher (not running_stack) so the last test can SIGTERM it mid-request."""
    from kvflow.shared.infra import free_port

    port = free_port()
    log_path = ROOT / ".pytest_cache" / f"kvflow-serve-{NAME}.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    args = ["--schedulers", "2", "--prefill-workers", "1", "--decode-workers", "2"]
    args += ["--max-waiting", "16", "--kv-cache-memory", "0.3", "--max-model-len", "1024"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    extra: list = []  # servers the tests start (a restarted nats-server)
    try:
        deadline = time.monotonic() + 300
        while "kvflow: ready" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        yield base, proc, extra
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for server in extra:
            server.stop()
        log.close()


def prompts(n: int) -> list[str]:
    topics = ["rivers", "bridges", "winter", "markets", "lamps", "gardens", "letters", "clouds"]
    return [f"Tell a short story about {topics[i % 8]} number {i}." for i in range(n)]


def run_streams(base: str, ps: list[str], max_tokens: int) -> list[Stream]:
    return [Stream(base, p, max_tokens).start() for p in ps]


def complete(base: str, prompt: str, max_tokens: int = 8, timeout: float = 120) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def wait_healthy(base: str, timeout: float = 120) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the stack did not become healthy again")


def test_malformed_messages_are_dropped_and_nothing_dies(faults_stack) -> None:
    import asyncio

    import nats

    base, proc, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    before = service_pids(nats_url)
    subjects = [
        "kvflow.tokenize",
        "kvflow.requests",
        "kvflow.abort",
        "kvflow.results",
        "kvflow.workers.heartbeat",
        "kvflow.kv.done",
        "kvflow.scheduler.stats",
        "kvflow.worker.decode-0.step",
        "kvflow.worker.prefill-0.kv",
        "kvflow.tokenizer.rpc",
    ]

    creds = stack_credentials(NAME)

    async def spray() -> None:
        # as every role in turn (the stack is closed: a stranger cannot publish at all); what a
        # role may not publish the server drops, what it may reaches the services
        for role in NATS_ROLES:
            password = creds.nats_password_file(role).read_text().strip()
            nc = await nats.connect(nats_url, user=role, password=password)
            for subject in subjects:
                for payload in (b"", b"\x00\xff garbage", b"\x93\x01\x02\x03", b"\x92\x05\xc0"):
                    await nc.publish(subject, payload)
            await nc.flush()
            await nc.close()

    asyncio.run(spray())
    time.sleep(1.0)
    assert service_pids(nats_url) == before  # every service alive, none restarted
    assert proc.poll() is None
    assert complete(base, "The capital of France is")


def test_killed_decode_worker_mid_stream_loses_nothing(faults_stack) -> None:
    base, _, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    ps = prompts(16)
    reference = [s.join() for s in run_streams(base, ps, 40)]
    assert all(s.error is None and s.finish_reason == "length" for s in reference)
    wait_all_blocks_free(base)

    streams = run_streams(base, ps, 40)
    deadline = time.monotonic() + 120
    while min(len(s.pieces) for s in streams) < 4:  # every stream is under way
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    workers = httpx.get(f"{base}/stats", timeout=5).json()["workers"]
    busiest = max((w for w in workers if w["role"] == "decode"), key=lambda w: w["num_running"])
    assert busiest["num_running"] > 0
    os.kill(service_pids(nats_url)[f"worker:{busiest['worker_id']}"], signal.SIGKILL)
    for s in streams:
        s.join()
    assert [s.error for s in streams] == [None] * 16
    assert [s.text for s in streams] == [r.text for r in reference]
    wait_all_blocks_free(base, timeout=30)


def test_throttled_workers_that_come_back_corrupt_no_stream(faults_stack) -> None:
    """Both decode workers frozen (SIGSTOP) past the heartbeat timeout mid-stream, thawed for
    half a second, four times over (an overloaded machine): each time they are given up, their
    sequences re-queued, and they rejoin and take them up again; a thawed worker first finishes
    the plan it was frozen in and publishes that step's result. No such result may be taken for
    a later step's: every text equals an undisturbed run's, and all blocks end free."""
    base, _, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    ps = prompts(16)
    reference = [s.join() for s in run_streams(base, ps, 48)]
    wait_all_blocks_free(base)
    streams = run_streams(base, ps, 48)
    deadline = time.monotonic() + 120
    while min(len(s.pieces) for s in streams) < 4:  # every stream is under way
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    pids = [pid for name, pid in service_pids(nats_url).items() if name.startswith("worker:decode")]
    assert len(pids) == 2
    try:
        for _ in range(4):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(4.0)  # past the heartbeat timeout (3 s): given up
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for s in streams:
        s.join()
    assert [s.error for s in streams] == [None] * 16
    assert [s.text for s in streams] == [r.text for r in reference]
    wait_all_blocks_free(base, timeout=30)


def test_killed_leader_scheduler_another_takes_over(faults_stack) -> None:
    base, _, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    ps = prompts(4)
    reference = [s.join().text for s in run_streams(base, ps, 32)]
    assert all(reference)
    before = httpx.get(f"{base}/stats", timeout=5).json()
    streams = run_streams(base, ps, 32)
    while min(len(s.pieces) for s in streams) < 3:
        time.sleep(0.05)
    os.kill(service_pids(nats_url)[f"scheduler:{before['scheduler_id']}"], signal.SIGKILL)
    t_kill = time.monotonic()
    # new requests are served again within a bounded time
    while True:
        try:
            complete(base, "Hello", 2, timeout=30)
            break
        except httpx.HTTPError:
            assert time.monotonic() - t_kill < 60, "no scheduler took over within 60 s"
            time.sleep(0.2)
    takeover_s = time.monotonic() - t_kill
    print(f"\nscheduler takeover: a new request was served {takeover_s:.1f} s after SIGKILL")
    after = httpx.get(f"{base}/stats", timeout=5).json()
    # a new leadership (the lease's epoch counter moved on): the standby, or the killed
    # scheduler's replacement that the launcher starts under the same id, whichever takes the
    # free lease first (both are fenced by the epoch; CI has seen either win)
    assert after["epoch"] > before["epoch"]
    assert f"scheduler:{after['scheduler_id']}" in service_pids(nats_url)
    for s in streams:
        s.join()
    assert [s.error for s in streams] == [None] * 4
    assert [s.text for s in streams] == reference
    wait_all_blocks_free(base, timeout=30)


@contextlib.contextmanager
def extra_detokenizer(log_name: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A second detokenizer process on the stack's NATS (logged in as the role), ready."""
    nats_url, _ = stack_urls(NAME)
    login = str(stack_credentials(NAME).nats_password_file("detokenizer"))
    env = {**os.environ, "KVFLOW_NATS_URL": nats_url, "KVFLOW_MAX_MODEL_LEN": "1024"}
    env["KVFLOW_NATS_PASSWORD_FILE"] = login  # the stack is closed: log in as the role
    log_path = ROOT / ".pytest_cache" / log_name
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "run", "detokenizer"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while "detokenizer ready" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_second_detokenizer_shares_requests_and_drains_cleanly(faults_stack) -> None:
    base, _, _ = faults_stack
    ps = prompts(12)  # spread at random by the queue group: both get some (1 - 2^-11)
    reference = [s.join().text for s in run_streams(base, ps, 24)]
    with extra_detokenizer("kvflow-faults-detok2.log") as (extra, log_path):
        streams = run_streams(base, ps, 24)
        while min(len(s.pieces) for s in streams) < 2:
            time.sleep(0.05)
        extra.send_signal(signal.SIGTERM)  # drain: it finishes its share, takes no more
        for s in streams:
            s.join()
        assert [s.error for s in streams] == [None] * 12
        assert [s.text for s in streams] == reference  # no delta lost or repeated
        assert extra.wait(60) == 0
        share = int(re.search(r"detokenizer draining: (\d+) requests", log_path.read_text())[1])
        assert share >= 1  # it had requests of its own when it was asked to stop
    assert complete(base, "The capital of France is")  # the first one carries on alone


def test_a_killed_detokenizers_requests_are_taken_over_with_the_same_text(faults_stack) -> None:
    """SIGKILL of a detokenizer mid-stream: the other takes its requests over within seconds
    (services/detokenizer/takeover.py) and every stream ends with the text it has alone, long
    before the requests' deadline (600 s)."""
    base, _, _ = faults_stack
    ps = prompts(12)[::-1]
    reference = [s.join().text for s in run_streams(base, ps, 32)]

    def takeovers() -> float:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        return sum(
            float(v)
            for v in re.findall(r"^kvflow:detokenizer_takeovers_total\S* (\S+)$", text, re.M)
        )

    before = takeovers()
    with extra_detokenizer("kvflow-faults-detok3.log") as (extra, _):
        streams = run_streams(base, ps, 32)
        while min(len(s.pieces) for s in streams) < 2:
            time.sleep(0.05)
        extra.kill()
        for s in streams:
            s.join(120)
        assert [s.thread.is_alive() for s in streams] == [False] * 12, "a stream hung"
        assert [s.error for s in streams] == [None] * 12
        assert [s.text for s in streams] == reference
    assert takeovers() > before  # it held some (1 - 2^-12), and they were taken over


def test_the_only_detokenizer_killed_its_restarted_process_takes_every_stream_over(
    faults_stack,
) -> None:
    """SIGKILL of the stack's one detokenizer mid-stream: `kvflow serve` starts it again, the
    new process asks the scheduler which requests run (and which ended while it was away), takes
    them over, and every stream ends with the text it has without the fault."""
    base, _, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    ps = prompts(8)
    reference = [s.join().text for s in run_streams(base, ps, 40)]
    (pid,) = [p for n, p in service_pids(nats_url).items() if n == "detokenizer"]
    streams = run_streams(base, ps, 40)
    while min(len(s.pieces) for s in streams) < 2:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    for s in streams:
        s.join(120)
    assert [s.thread.is_alive() for s in streams] == [False] * 8, "a stream hung"
    assert [s.error for s in streams] == [None] * 8
    assert [s.text for s in streams] == reference
    assert service_pids(nats_url)["detokenizer"] != pid  # the restarted one


def test_nats_outage_requests_complete_or_fail_clearly_then_serving_resumes(faults_stack) -> None:
    base, _, extra = faults_stack
    nats_url, _ = stack_urls(NAME)
    port = int(nats_url.rsplit(":", 1)[1])
    nats_pid = next(
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit()
        and re.search(rb"nats-server\x00.*-p\x00" + str(port).encode(), _cmdline(int(p)))
    )
    streams = run_streams(base, prompts(6), 48)
    while min(len(s.pieces) for s in streams) < 2:
        time.sleep(0.05)
    os.kill(nats_pid, signal.SIGKILL)
    time.sleep(5)
    extra.append(start_nats(port=port, config=stack_credentials(NAME).nats_conf))
    for s in streams:
        s.join(timeout=200)
        assert not s.thread.is_alive(), "a request hung past its deadline"
        # complete, or an error that says what happened: never a silent truncation
        assert (s.error is None and s.finish_reason == "length") or s.error, s.text
    wait_healthy(base)
    assert complete(base, "The capital of France is")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_flood_gets_429_and_memory_stays_bounded(faults_stack) -> None:
    base, _, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    pids = service_pids(nats_url)
    rss_before = {name: rss_mib(pid) for name, pid in pids.items()}

    def one(i: int) -> tuple[int, str | None]:
        body = {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
        return r.status_code, r.headers.get("retry-after")

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(400)))
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429}, sorted(set(codes))
    assert codes.count(429) > 0 and codes.count(200) > 0
    assert all(ra is not None for c, ra in results if c == 429)
    grown = {
        name: rss_mib(pid) - rss_before[name]
        for name, pid in service_pids(nats_url).items()
        if name in rss_before
    }
    print(f"\nflood: {codes.count(200)} served, {codes.count(429)} got 429; RSS growth MiB {grown}")
    assert max(grown.values()) < 300, grown
    wait_all_blocks_free(base, timeout=30)


SERVICE_ROLES = ("tokenizer", "detokenizer", "scheduler", "prefill-worker", "decode-worker")


def test_a_seeded_minute_of_faults_of_every_role_under_load_loses_and_leaks_nothing(
    faults_stack, capsys
) -> None:
    """`kvflow bench chaos` for 60 s on this stack (one NATS server and one Redis here, which
    no one restarts: their faults are the NATS cluster's and Sentinel's tests'): every service
    role killed or stopped under load, seeded. No request hangs, no text is wrong, every block
    comes back, no service that lived through it grew."""
    from kvflow.benchmarks.chaos import Chaos, plan

    base, _, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    faults = plan(32, 60, 6, SERVICE_ROLES)
    assert {f.role for f in faults} == set(SERVICE_ROLES)  # the seed hits every role
    args = argparse.Namespace(seed=32, chaos_duration=60.0, chaos_users=3)
    args.serve_log = ROOT / ".pytest_cache" / f"kvflow-serve-{NAME}.log"
    chaos = Chaos(args, base, nats_url)
    code = asyncio.run(chaos.run(faults))
    report = capsys.readouterr().out
    print(report)
    assert chaos.tally.fates["hung"] == 0 and chaos.tally.fates["corrupted"] == 0, report
    assert chaos.tally.fates["ok"] > 20 and sum(chaos.faults.values()) == len(faults), report
    assert code == 0, report  # blocks free, no service grown


def test_sigterm_finishes_the_open_request_then_stops_everything(faults_stack) -> None:
    base, proc, _ = faults_stack
    nats_url, _ = stack_urls(NAME)
    stream = Stream(base, "Write a long story about the sea.", 48).start()
    while len(stream.pieces) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stream.join()
    assert stream.error is None and stream.finish_reason == "length"
    assert proc.wait(90) == 0
    assert service_pids(nats_url) == {}
