"""`kvflow bench chaos`'s own logic, offline: the seeded plan (the same faults for the same
seed, replayed from its file, every role hit, the infrastructure killed at most once), the roles
of a stack's processes as it finds them, and how each request's fate is told."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvflow.benchmarks.chaos import (
    INFRA,
    KILLS_PER_MINUTE,
    ROLES,
    Outcome,
    Tally,
    dump,
    load,
    plan,
    role_of,
    service_pids,
)


def test_a_seed_gives_one_plan_and_its_file_replays_it() -> None:
    a, b = plan(7, 600, 5), plan(7, 600, 5)
    assert a == b and a != plan(8, 600, 5)
    assert load(dump(a)) == a


def test_the_plan_spreads_faults_of_every_role_within_the_run() -> None:
    faults = plan(3, 3600, 4)
    times = [f.at for f in faults]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 3600
    assert 600 < len(faults) < 1200  # mean interval 4 s
    assert {f.role for f in faults} == set(ROLES)
    assert {f.action for f in faults} == {"kill", "stop"}
    assert all(1.0 <= f.pause <= 10.0 for f in faults if f.action == "stop")
    assert all(f.pause == 0 for f in faults if f.action == "kill")
    for role in INFRA:  # nobody restarts them: a second kill would leave no replica
        assert sum(f.role == role and f.action == "kill" for f in faults) == 1
    for role in ROLES:  # `kvflow serve` gives up on a service that exits 4 times a minute
        kills = [f.at for f in faults if f.role == role and f.action == "kill"]
        assert all(len([k for k in kills if 0 <= t - k < 60]) <= KILLS_PER_MINUTE for t in kills)
    assert plan(3, 60, 4, ("detokenizer",))
    assert {f.role for f in plan(3, 600, 4, ("detokenizer", "worker"))} == {"detokenizer", "worker"}


def test_the_roles_of_a_stacks_processes() -> None:
    assert role_of("worker:prefill-0") == "prefill-worker"
    assert role_of("worker:decode-1") == "decode-worker"
    assert role_of("worker:worker-0") == "worker"
    assert role_of("scheduler:scheduler-1") == "scheduler"
    assert role_of("detokenizer:4242") == "detokenizer"


def test_processes_are_found_by_their_stacks_nats_url_only() -> None:
    def child(url: str, *argv: str) -> subprocess.Popen:
        env = {**os.environ, "KVFLOW_NATS_URL": url}
        code = "import time; time.sleep(60)"
        return subprocess.Popen([sys.executable, "-c", code, *argv], env=env)

    mine = "nats://127.0.0.1:1,nats://127.0.0.1:2"
    procs = [child(mine, "run", "detokenizer"), child(mine, "run", "detokenizer")]
    procs.append(child("nats://127.0.0.1:9", "run", "detokenizer"))  # another stack's
    try:
        for _ in range(50):  # until the children's command lines are theirs
            found = service_pids(mine)
            if len(found) == 2:
                break
            time.sleep(0.1)
        assert sorted(found.values()) == sorted(p.pid for p in procs[:2])
        assert {role_of(n) for n in found} == {"detokenizer"}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_each_request_is_told_ok_corrupted_error_or_hung() -> None:
    t = Tally()
    t.add(Outcome("the text", finish="length"), "the text")
    t.add(Outcome("the txet", finish="length"), "the text")
    t.add(Outcome("the te", finish=None), "the text")  # ended early without an error
    t.add(Outcome("", error="part of the output was lost in transit 12"), "the text")
    t.add(Outcome("", error="hung"), "the text")
    assert t.fates == {"ok": 1, "corrupted": 2, "error": 1, "hung": 1}
    assert list(t.errors) == ["part of the output was lost in transit N"]
