"""``kvflow bench chaos``: a seeded stream of faults of every kind against a loaded stack, and
the invariants that must hold through it.

    kvflow bench chaos --chaos-duration 1200 --seed 7 \\
        --serve-args "--nats-cluster 3 --redis-sentinel --schedulers 2 --tokenizers 2 \\
                      --detokenizers 2 --prefill-workers 1 --decode-workers 2"
    kvflow bench chaos --chaos-replay bench-results/chaos-plan.json   # the same faults again

It starts ``kvflow serve`` with ``--serve-args`` and keeps ``--chaos-users`` clients streaming
completions from a fixed pool of requests (greedy, and sampled with a seed: each has one right
text, measured once before the first fault). At the plan's times it SIGKILLs or SIGSTOPs (for 1 to
10 s) one process of a role: tokenizer, detokenizer, scheduler, prefill/decode/plain worker, a
NATS node, the Redis primary. `kvflow serve` starts a killed service again (and gives up on one
that exits four times within a minute, so a plan kills a role at most twice a minute); NATS
nodes and the Redis primary are not restarted by anyone, so each is killed at most once in a
plan (a second would leave no replica) and otherwise stopped. The plan is a function of ``--seed`` (written to
``--out``/chaos-plan.json; ``--chaos-replay`` runs a saved one).

Invariants: every request ends before its deadline (``hung``: 0); every text that completes is
its right text (``corrupted``: 0; a request that cannot complete ends with an error, counted by
its message); once the load stops every KV block is free; each service that lived through the
run stays within 10 % of its size after the warm-up. (Redis's keys are not counted: no role of
the stack may SCAN them, by design, and kvflow writes no key per request: the lease, the epoch,
the LoRA registry, API keys with their expiring rate counters and the KV tier's blocks.) The
report also gives the faults by role, the error rate and p99 latency inside and outside the
fault windows. Exit status 1 when an invariant fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvflow.benchmarks.stack import logged_stack
from kvflow.shared.config import variable

ROLES = (
    "tokenizer",
    "detokenizer",
    "scheduler",
    "prefill-worker",
    "decode-worker",
    "worker",
    "nats",
    "redis",
)
INFRA = ("nats", "redis")  # restarted by nobody: killed at most once per plan
# kills of one role within a minute: `kvflow serve` gives up on a service that exits a fourth
# time within a minute (kvflow/cli/launcher.py), and a stopped scheduler may exit once itself
KILLS_PER_MINUTE = 2
KILL_SHARE = 0.6  # of faults; the rest SIGSTOP for PAUSE_S
PAUSE_S = (1.0, 10.0)
FAULT_WINDOW_S = 15.0  # after a fault, requests count as "during faults"
DEADLINE_S = 180.0  # a request that has not ended by then is hung
RSS_GROWTH = 0.10


@dataclass(frozen=True)
class Fault:
    """At ``at`` seconds into the run: ``action`` ("kill" or "stop" for ``pause`` s) one
    process of ``role``, the ``pick``-th (modulo how many there are then)."""

    at: float
    role: str
    action: str
    pause: float
    pick: int


def plan(seed: int, duration: float, every: float, roles: tuple[str, ...] = ROLES) -> list[Fault]:
    """Faults at exponentially spread times (mean ``every`` s) within ``duration``, each of a
    role drawn from ``roles``; the same for the same arguments."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / every)
        if t >= duration:
            return faults
        role = rng.choice(roles)
        kills = [f.at for f in faults if f.role == role and f.action == "kill"]
        kill = rng.random() < KILL_SHARE and not (
            (role in INFRA and kills) or len([k for k in kills if t - k < 60]) >= KILLS_PER_MINUTE
        )
        pause = 0.0 if kill else round(rng.uniform(*PAUSE_S), 1)
        faults.append(
            Fault(round(t, 1), role, "kill" if kill else "stop", pause, rng.randrange(1 << 16))
        )


def dump(faults: list[Fault]) -> str:
    return json.dumps([asdict(f) for f in faults], indent=1)


def load(text: str) -> list[Fault]:
    return [Fault(**f) for f in json.loads(text)]


# -- the stack's processes ----------------------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _cmdline(pid: int) -> list[str]:
    try:
        return [
            a.decode(errors="replace")
            for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ]
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def service_pids(nats_url: str) -> dict[str, int]:
    """Live services of one stack (found by the NATS URL in their environment, so other stacks
    on the machine are never touched): {"worker:decode-0": pid, "scheduler:scheduler-1": pid,
    "detokenizer": pid, ...}; a role's second instance has its pid in the name."""
    out: dict[str, int] = {}
    for pid in _pids():
        env = _environ(pid)
        if env.get(variable("nats_url")) != nats_url:
            continue
        cmd = _cmdline(pid)
        if "run" not in cmd[:-1]:
            continue
        service = cmd[cmd.index("run") + 1]
        ident = env.get(variable("worker_id")) or env.get(variable("scheduler_id")) or service
        name = f"{service}:{ident}" if ident != service else service
        out[name if name not in out else f"{name}:{pid}"] = pid
    return out


def role_of(name: str) -> str:
    """A service's role in a plan: ``worker:prefill-0`` is a prefill-worker."""
    service, _, ident = name.partition(":")
    if service == "worker":
        kind = ident.split("-", 1)[0]
        return f"{kind}-worker" if kind in ("prefill", "decode") else "worker"
    return service


def nats_pids(nats_url: str) -> list[int]:
    """The nats-server processes serving the stack's client ports."""
    ports = {u.rsplit(":", 1)[1] for u in nats_url.split(",")}
    return sorted(
        pid
        for pid in _pids()
        if (cmd := _cmdline(pid)) and cmd[0].endswith("nats-server") and ports & set(cmd)
    )


def redis_primary_pid(port: int) -> int | None:
    title = f"127.0.0.1:{port}"
    for pid in _pids():
        cmd = " ".join(_cmdline(pid))
        if "redis-server" in cmd and title in cmd and "sentinel" not in cmd:
            return pid
    return None


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- the load -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request of the pool: greedy (``temperature`` 0) or sampled with ``seed``."""

    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None


def specs(seed: int, n: int = 24) -> list[Spec]:
    rng = random.Random(seed)
    topics = ["rivers", "bridges", "winter", "markets", "lamps", "gardens", "letters", "clouds"]
    out = []
    for i in range(n):
        prompt = f"Write a few sentences about {topics[i % 8]} and the number {i}."
        sampled = i % 3 == 2
        out.append(
            Spec(prompt, rng.randint(24, 64), 0.8 if sampled else 0.0, i if sampled else None)
        )
    return out


@dataclass
class Outcome:
    text: str = ""
    error: str | None = None
    finish: str | None = None
    started: float = 0.0
    took: float = 0.0


async def stream(client: httpx.AsyncClient, base: str, model: str, spec: Spec) -> Outcome:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens}
    body |= {"temperature": spec.temperature, "stream": True, "ignore_eos": True}
    if spec.seed is not None:
        body["seed"] = spec.seed
    out = Outcome(started=time.monotonic())
    try:
        async with asyncio.timeout(DEADLINE_S):
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}"
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.error = str(chunk["error"].get("message", chunk["error"]))[:80]
                    for choice in chunk.get("choices", []):
                        out.text += choice.get("text", "")
                        out.finish = choice.get("finish_reason") or out.finish
    except TimeoutError:
        out.error = "hung"
    except httpx.HTTPError as e:
        out.error = type(e).__name__
    out.took = time.monotonic() - out.started
    return out


@dataclass
class Tally:
    fates: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[tuple[float, float, bool]] = field(default_factory=list)  # start, took, ok

    def add(self, outcome: Outcome, want: str) -> None:
        if outcome.error == "hung":
            fate = "hung"
        elif outcome.error is not None:
            fate = "error"
            self.errors[re.sub(r"\d+", "N", outcome.error)] += 1
        elif outcome.text == want and outcome.finish == "length":
            fate = "ok"
        else:
            fate = "corrupted"
        self.fates[fate] += 1
        self.latencies.append((outcome.started, outcome.took, fate == "ok"))


def _p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))] if xs else 0.0


# -- the run ------------------------------------------------------------------------------------


class Chaos:
    def __init__(self, args: argparse.Namespace, base: str, nats_url: str) -> None:
        self.args, self.base, self.nats_url = args, base, nats_url
        self.model = "SmolLM2-135M-Instruct"
        self.pool = specs(args.seed)
        self.reference: dict[Spec, str] = {}
        self.tally = Tally()
        self.faults: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.fault_times: list[float] = []

    def targets(self, role: str) -> list[int]:
        if role == "nats":
            return nats_pids(self.nats_url)
        if role == "redis":
            port = _primary_port(self.args.serve_log)  # after a failover: the new one
            pid = redis_primary_pid(port) if port else None
            return [pid] if pid else []
        return sorted(p for n, p in service_pids(self.nats_url).items() if role_of(n) == role)

    async def inject(self, fault: Fault) -> None:
        pids = self.targets(fault.role)
        if not pids:
            self.skipped[fault.role] += 1
            return
        pid = pids[fault.pick % len(pids)]
        self.faults[f"{fault.role} {fault.action}"] += 1
        self.fault_times.append(time.monotonic())
        print(f"\n  {fault.at:7.1f} s  {fault.action} {fault.role} (pid {pid})", flush=True)
        try:
            if fault.action == "kill":
                os.kill(pid, signal.SIGKILL)
                return
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(fault.pause)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    async def run(self, faults: list[Fault]) -> int:
        async with httpx.AsyncClient(timeout=httpx.Timeout(DEADLINE_S)) as client:
            print(f"reference texts of {len(self.pool)} requests (no faults) ...", flush=True)
            at_once = asyncio.Semaphore(self.args.chaos_users)  # as many as the load keeps

            async def first(spec: Spec) -> Outcome:
                async with at_once:
                    return await stream(client, self.base, self.model, spec)

            outs = await asyncio.gather(*(first(s) for s in self.pool))
            for spec, out in zip(self.pool, outs, strict=True):
                if out.error:
                    print(f"the stack failed before any fault: {out.error}")
                    return 1
                self.reference[spec] = out.text
            warm = {n: (p, rss_mib(p)) for n, p in service_pids(self.nats_url).items()}
            t0 = time.monotonic()
            stop_at = t0 + self.args.chaos_duration
            rng = random.Random(self.args.seed)

            async def user() -> None:
                while time.monotonic() < stop_at:
                    spec = rng.choice(self.pool)
                    self.tally.add(
                        await stream(client, self.base, self.model, spec), self.reference[spec]
                    )
                    print(
                        "\r  " + "  ".join(f"{k} {v}" for k, v in sorted(self.tally.fates.items())),
                        end="",
                        flush=True,
                    )

            async def injector() -> None:
                pending = []
                for fault in faults:
                    await asyncio.sleep(max(0.0, t0 + fault.at - time.monotonic()))
                    pending.append(asyncio.create_task(self.inject(fault)))
                await asyncio.gather(*pending)

            await asyncio.gather(injector(), *(user() for _ in range(self.args.chaos_users)))
            free = await self._quiet(client)
        end = {n: (p, rss_mib(p)) for n, p in service_pids(self.nats_url).items()}
        return self.report(faults, free, warm, end)

    async def _quiet(self, client: httpx.AsyncClient) -> tuple[int, int]:
        """(free, total) KV blocks once nothing runs (waited for up to 60 s)."""
        stats: dict = {}
        for _ in range(120):
            try:
                stats = (await client.get(f"{self.base}/stats", timeout=5)).json()
            except httpx.HTTPError:
                stats = {}
            if stats and not stats["num_running"] and not stats["num_waiting"]:
                if stats["num_free_blocks"] == stats["num_total_blocks"]:
                    break
            await asyncio.sleep(0.5)
        return stats.get("num_free_blocks", -1), stats.get("num_total_blocks", 0)

    def report(self, faults: list[Fault], free: tuple[int, int], warm: dict, end: dict) -> int:
        fates, errors = self.tally.fates, self.tally.errors
        print(f"\n\nchaos: {self.args.chaos_duration:.0f} s, {self.args.chaos_users} users, "
              f"seed {self.args.seed}, {len(faults)} faults planned")  # fmt: skip
        print("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())))
        if self.skipped:
            print(
                "skipped (no such process): "
                + ", ".join(f"{k} {v}" for k, v in self.skipped.items())
            )
        print("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(fates.items())))
        for why, n in errors.most_common():
            print(f"  error x{n}: {why}")
        near = [
            any(0 <= s - f <= FAULT_WINDOW_S for f in self.fault_times)
            for s, _, _ in self.tally.latencies
        ]
        for label, mask in (("during faults", True), ("otherwise", False)):
            rows = [
                (took, ok)
                for (_, took, ok), n in zip(self.tally.latencies, near, strict=True)
                if n is mask
            ]
            failed = sum(1 for _, ok in rows if not ok)
            print(f"{label}: {len(rows)} requests, {failed} not ok "
                  f"({100 * failed / max(1, len(rows)):.1f} %), p99 {_p99([t for t, _ in rows]):.1f} s")  # fmt: skip
        print(f"KV blocks free at the end: {free[0]} of {free[1]}")
        grown = []
        print("| service | RSS after warm-up (MiB) | end | growth |\n|---|---:|---:|---:|")
        for name, (pid, before) in sorted(warm.items()):
            pid_end, after = end.get(name, (None, None))
            if pid_end != pid or not before or not after:
                print(f"| {name} | {before or 0:.0f} | restarted | |")
                continue
            growth = after / before - 1
            grown += [name] if growth > RSS_GROWTH else []
            print(f"| {name} | {before:.0f} | {after:.0f} | {100 * growth:+.1f} % |")
        bad = fates["hung"] + fates["corrupted"] + (free[0] != free[1]) + len(grown)
        print(
            "invariants: "
            + ("hold" if not bad else f"BROKEN (hung, corrupted, leaked blocks or grown: {grown})")
        )
        return 1 if bad else 0


def add_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--chaos-duration", type=float, default=60.0, help="seconds of load and faults")
    p.add_argument("--chaos-every", type=float, default=8.0, help="mean seconds between faults")
    p.add_argument("--chaos-users", type=int, default=6, help="clients streaming at once")
    p.add_argument("--chaos-roles", default=",".join(ROLES), help="roles faults may hit")
    p.add_argument("--chaos-replay", default="", help="a plan written by an earlier run")


def main(args: argparse.Namespace) -> int:
    roles = tuple(r for r in args.chaos_roles.split(",") if r)
    unknown = set(roles) - set(ROLES)
    if unknown:
        print(
            f"kvflow bench chaos: unknown roles {sorted(unknown)}; the roles are {', '.join(ROLES)}"
        )
        return 2
    faults = (
        load(Path(args.chaos_replay).read_text())
        if args.chaos_replay
        else plan(args.seed, args.chaos_duration, args.chaos_every, roles)
    )
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / "chaos-plan.json").write_text(dump(faults))
    print(f"plan: {len(faults)} faults ({out / 'chaos-plan.json'})")
    args.serve_log = out / "chaos-serve.log"
    with logged_stack(args.serve_args.split(), args.serve_log) as (base, nats_url):
        return asyncio.run(Chaos(args, base, nats_url).run(faults))


def _admin_login(log_path: Path) -> dict[str, str]:
    """The admin role's Redis login of the stack (`kvflow serve` prints where its credentials
    are), or none for a stack without credentials."""
    creds = re.search(
        r"credentials \(one per role, removed at exit\): (\S+);", log_path.read_text()
    )
    if creds is None:
        return {}
    from kvflow.shared.access.credentials import Credentials

    pw = Credentials(Path(creds[1])).redis_password_file("admin").read_text().strip()
    return {"username": "admin", "password": pw}


def _primary_port(log_path: Path) -> int | None:
    """The port of the stack's Redis primary now: its one redis-server, or the one the
    sentinels name (``--redis-sentinel``)."""
    text = log_path.read_text()
    m = re.search(r"redis redis://127\.0\.0\.1:(\d+)", text)
    if m is not None:
        return int(m[1])
    m = re.search(r"redis redis\+sentinel://([\d.]+):(\d+)", text)
    if m is None:
        return None
    import redis

    from kvflow.shared.access.grants import SENTINEL_MASTER

    try:
        s = redis.Redis(host=m[1], port=int(m[2]), socket_timeout=2, **_admin_login(log_path))
        _host, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER)
        s.close()
    except redis.RedisError:
        return None
    return int(port)
