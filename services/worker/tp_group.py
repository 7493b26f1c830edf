"""A tensor-parallel worker group (``--tensor-parallel-size N``): the worker process is rank 0;
it starts ranks 1..N-1 itself (spawned processes on this machine, one device each on CUDA),
and only rank 0 talks to NATS. The scheduler sees one worker with the group's KV blocks.

Every rank holds its shard of the model and of the KV cache (services/worker/tensor_parallel.py)
and runs every step: rank 0 broadcasts each StepPlan (and each reset) inside the group before it
runs it, and the other ranks run the same plans in the same order (``follow``). Every rank
samples from the same gathered logits with the same random stream (seeded alike at start), so
their request states stay identical; only rank 0's results leave the group.

Failure: the group steps only whole. A follower that exits (a crash, kill -9) makes rank 0 exit
at once (code 1, without answering the step), so its heartbeat stops and the scheduler moves the
worker's requests elsewhere (migration); the launcher or Kubernetes starts the group again. A
follower whose rank 0 is gone exits too (it polls its parent). Collectives have a timeout
(``COLLECTIVE_TIMEOUT_S``): a rank that hangs fails the group instead of stopping it forever;
an idle rank 0 sends a keep-alive every ``KEEPALIVE_S`` so waiting followers never time out."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - its reductions send tensors through pipes

from kvflow.kernels import cpu_native
from kvflow.kernels.cpu_native import NativeSetup
from kvflow.services.worker import machine, tp_shm
from kvflow.services.worker.draft import load_draft
from kvflow.services.worker.lora import LoRACache, LoRASpec
from kvflow.services.worker.model_interface import KvCacheSpec
from kvflow.services.worker.model_loader import load_weights, round_weights
from kvflow.services.worker.model_setup import DeviceSpec, KvSpec
from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.tensor_parallel import (
    LoRAShard,
    TPGroup,
    shard_config,
    shard_weights,
    tp_layout,
)
from kvflow.services.worker.tp_shm import ShmComm
from kvflow.shared.config import Settings
from kvflow.shared.cpu_budget import usable_cpus
from kvflow.shared.messages import StepPlan, StepResult
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.speculative import SpeculativeConfig

log = logging.getLogger("kvflow.worker")

SHM_SLOT_MAX = 64 << 20  # bytes of one rank's slot in the shared-memory collectives
COLLECTIVE_TIMEOUT_S = 120.0  # the longest a rank waits in one collective
KEEPALIVE_S = 10.0  # an idle rank 0 tells the followers it is alive this often
GROUP_FAILED_EXIT = 1  # rank 0's exit code when a rank is lost (the launcher starts it again)

# what rank 0 broadcasts (first byte), then the payload
_PLAN, _RESET, _FORGET, _KEEPALIVE, _STOP = b"P", b"R", b"F", b"K", b"S"


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one group starts from (sent to the followers when they start)."""

    world: int
    init_method: str  # torch.distributed rendezvous (tcp://127.0.0.1:PORT)
    backend: str  # gloo | nccl
    kv: KvSpec  # num_blocks fixed: the same on every rank
    device: DeviceSpec  # rank 0's device; rank r uses the r-th one after it on CUDA
    threads: int  # torch threads per rank
    seed: int  # every rank's global random stream starts here
    worker_id: str
    native: NativeSetup  # the worker's machine cache and native kernels (machine.py)
    share_kv: bool = False  # rank 0 maps every rank's KV cache (it moves KV blocks)
    draft: SpeculativeConfig | None = None  # a draft model (every rank runs it whole)
    lora: LoRASpec | None = None  # --enable-lora (each rank cuts its part of every adapter)
    shm_path: str = ""  # the ranks' shared-memory collectives (tp_shm.py); "": torch's only
    shm_slot_bytes: int = 0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for all, or the ``rank``-th GPU from rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def group_blocks(cfg: ModelConfig, kv: KvSpec, dtype: torch.dtype, world: int) -> int:
    """KV blocks of every rank: ``kv.num_blocks``, or as many as ``kv.kv_cache_gib`` holds on
    the rank with the most KV heads (rank 0: heads are dealt to the first ranks first)."""
    if kv.num_blocks:
        return kv.num_blocks
    heads = max(len(tp_layout(cfg, r, world).kv_heads) for r in range(world))
    per_block = KvCacheSpec.of(cfg, dtype).with_kv_heads(heads).block_bytes(kv.block_size)
    return max(1, int(kv.kv_cache_gib * 2**30) // per_block)


def load_rank(src: ModelSource, spec: RankSpec, rank: int) -> ModelRunner:
    """Rank ``rank``'s runner: its shard of ``src`` on its device, its part of the KV cache
    (after ``init_process_group``: graph capture on CUDA runs the collectives)."""
    cfg = load_config(src)
    layout = tp_layout(cfg, rank, spec.world)
    weights = load_weights(src, cfg, spec.device.dtype)  # dense (a GPTQ/AWQ one dequantized)
    shard = round_weights(shard_weights(weights, cfg, layout), spec.device.quantization)
    del weights
    device = dataclasses.replace(spec.device, device=rank_device(spec.device.device, rank))
    lora = None
    if spec.lora is not None:
        lora = dataclasses.replace(spec.lora, shard=LoRAShard(cfg, layout))
    comm = None
    if spec.shm_path:
        comm = ShmComm(spec.shm_path, rank, spec.world, spec.shm_slot_bytes, COLLECTIVE_TIMEOUT_S)
    # a draft model runs whole on every rank (no collectives): the same proposals everywhere
    draft = load_draft(spec.draft, device, cfg) if spec.draft is not None else None
    return ModelRunner(
        src,
        spec.kv,
        device,
        config=shard_config(cfg, layout),
        weights=shard,
        worker_id=spec.worker_id,
        draft=draft,
        lora=lora,
        tp=TPGroup(layout, comm),
    )


def _join_group(spec: RankSpec, rank: int) -> None:
    torch.set_num_threads(spec.threads)
    torch.distributed.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=rank,
        world_size=spec.world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def _ready(spec: RankSpec, rank: int) -> None:
    """Every rank loaded; the random streams start alike (sampling stays in step)."""
    torch.manual_seed(spec.seed)
    random.seed(spec.seed)
    torch.distributed.barrier()
    if rank == 0 and spec.shm_path:  # every rank has it mapped: nothing is left behind
        os.unlink(spec.shm_path)


def _check_shm_room(cfg: ModelConfig, kv: KvSpec, dtype: torch.dtype, world: int) -> None:
    """The followers' KV caches move to shared memory for rank 0 to read: ValueError when
    /dev/shm cannot hold them."""
    assert kv.num_blocks is not None
    heads = sum(len(tp_layout(cfg, r, world).kv_heads) for r in range(1, world))
    need = kv.num_blocks * KvCacheSpec.of(cfg, dtype).with_kv_heads(heads).block_bytes(
        kv.block_size
    )
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if free < need + (64 << 20):
        raise ValueError(
            f"with --role prefill|decode or a KV tier, the other ranks' KV caches "
            f"({need / 2**30:.2f} GiB) go to /dev/shm, which has {free / 2**30:.2f} GiB free: "
            "give the container more (docker --shm-size, compose shm_size, a memory emptyDir "
            "on /dev/shm in Kubernetes) or lower --kv-cache-memory"
        )


def _shm_for(
    settings: Settings, cfg: ModelConfig, world: int, device: torch.device
) -> tuple[str, int]:
    """(path, slot bytes) of the group's shared-memory collectives, made now; ("", 0) on a GPU,
    a CPU without ordered stores, or too little room in /dev/shm (then gloo carries them)."""
    if device.type != "cpu" or not tp_shm.available():
        return "", 0
    s = settings.scheduler
    vocab_width = -(-cfg.vocab_size // world)
    rows = max(s.max_num_batched_tokens * cfg.hidden_size, s.max_num_seqs * vocab_width)
    slot = min(4 * rows, SHM_SLOT_MAX)  # fp32; anything larger goes through gloo
    path = f"/dev/shm/kvflow-tp-{os.getpid()}-{random.randrange(2**32):08x}"
    try:
        tp_shm.create(path, world, slot)
    except OSError as e:
        log.warning("tensor-parallel group: no shared memory for collectives (%s); gloo only", e)
        return "", 0
    return path, slot


# --------------------------------------------------------------------------------------------
# rank 0


class TPLeader:
    """Rank 0's side of the group, the worker service's StepRunner
    (services/worker/step_runner.py): broadcasts what changes the ranks' state before doing
    it on its own model runner (on the model thread, always: the broadcasts are ordered with
    the steps), watches the follower processes, and keeps idle followers from timing out."""

    def __init__(self, procs: list[Any], shm_path: str = "") -> None:
        self.procs = procs  # the followers' processes, rank 1 first
        self.shm_path = shm_path  # the shared-memory collectives' file (tp_shm.py)
        self.runner: ModelRunner | None = None  # rank 0's, once loaded
        # every rank's KV caches (rank 0's own, the others' mapped here), when the worker moves
        # KV blocks (disaggregated roles, KV tiers): services/worker/kv_blocks.py reads them all
        self.rank_caches: list[Any] | None = None
        self.last_sent = time.monotonic()
        self.closed = False

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        data = kind + payload
        size = torch.tensor([len(data)], dtype=torch.long)
        torch.distributed.broadcast(size, 0)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        torch.distributed.broadcast(buf, 0)
        self.last_sent = time.monotonic()

    @property
    def rank0(self) -> ModelRunner:
        assert self.runner is not None, "the group's rank 0 is not loaded yet"
        return self.runner

    @property
    def num_blocks(self) -> int:
        return self.rank0.num_blocks

    @property
    def block_size(self) -> int:
        return self.rank0.block_size

    @property
    def max_model_len(self) -> int:
        return self.rank0.max_model_len

    @property
    def kv_caches(self) -> list[Any]:
        return self.rank0.kv_caches

    @property
    def loras(self) -> LoRACache | None:
        return self.rank0.loras

    def kv_shards(self) -> list[Any] | None:
        return self.rank_caches

    def weight_bytes(self) -> int:
        return self.rank0.weight_bytes()  # rank 0's shard

    def take_expert_load(self) -> list[int] | None:
        return self.rank0.take_expert_load()

    def execute(self, plan: StepPlan) -> StepResult:
        from kvflow.shared.messages import encode

        self._send(_PLAN, encode(plan))
        result = self.rank0.execute(plan)
        if result.error and _broken(self.rank0):
            self.fail()  # the step failed because the group broke: no answer, exit now
        return result

    def reset(self) -> None:
        self._send(_RESET)
        self.rank0.reset()

    def forget_lora(self, name: str) -> None:
        """An unloaded adapter leaves every rank's cache."""
        if self.rank0.loras is None:
            return
        self._send(_FORGET, name.encode())
        self.rank0.forget_lora(name)

    def keepalive(self) -> None:
        """From the model thread when idle: followers waiting for a plan see rank 0 alive."""
        if not self.closed and time.monotonic() - self.last_sent >= KEEPALIVE_S:
            self._send(_KEEPALIVE)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the followers (the worker is exiting)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send(_STOP)
        except Exception as e:  # noqa: BLE001 - a follower already gone: stop the rest below
            log.warning("tensor-parallel group: stop not delivered (%s)", e)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        torch.distributed.destroy_process_group()

    def _lost_rank(self, wait_s: float = 0.0) -> int | None:
        """The first follower rank found exited (within ``wait_s``), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch(self) -> None:
        """A daemon thread: the first follower to exit takes the group down."""
        from multiprocessing.connection import wait

        def run() -> None:
            wait([p.sentinel for p in self.procs])
            if not self.closed:
                self.fail()

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def fail(self) -> None:
        rank = self._lost_rank(wait_s=1.0)  # its sentinel may close before it can be reaped
        if rank is None:
            what = "a collective failed (a rank hung or timed out)"
        else:
            what = f"tensor-parallel rank {rank} exited (code {self.procs[rank - 1].exitcode})"
        log.error(
            "%s: the group cannot step; the worker exits so the scheduler moves its requests "
            "to other workers",
            what,
        )
        for p in self.procs:
            if p.is_alive():
                p.kill()
        if self.shm_path:  # lost before the group formed: not unlinked yet
            with contextlib.suppress(OSError):
                os.unlink(self.shm_path)
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)


def start_group(
    settings: Settings,
    src: ModelSource,
    kv: KvSpec,
    device: DeviceSpec,
    lora: LoRASpec | None = None,
    draft: SpeculativeConfig | None = None,
) -> TPLeader:
    """Rank 0 (on the worker's model thread): start the other ranks, join them, load this
    rank's shard; the group is ready when every rank has loaded."""
    from kvflow.shared.infra import free_port

    world = settings.worker.tensor_parallel_size
    cfg = load_config(src)
    tp_layout(cfg, world - 1, world)  # ValueError: more ranks than heads
    dev = device.device
    if dev.type == "cuda" and (dev.index or 0) + world > torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel-size {world} from {dev} needs {world} GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )
    kv = dataclasses.replace(kv, num_blocks=group_blocks(cfg, kv, device.dtype, world))
    shm_path, shm_slot = _shm_for(settings, cfg, world, dev)
    cache = settings.cache
    share_kv = settings.worker.role != "both" or cache.kv_host_memory > 0 or cache.kv_redis_tier
    if share_kv and dev.type == "cpu":
        _check_shm_room(cfg, kv, device.dtype, world)
    threads = settings.worker.threads or max(1, usable_cpus() // world)
    spec = RankSpec(
        world,
        f"tcp://127.0.0.1:{free_port()}",
        "nccl" if dev.type == "cuda" else "gloo",
        kv,
        device,
        threads,
        random.randrange(2**31),
        settings.worker.worker_id,
        machine.native_setup(settings),
        share_kv=share_kv,
        draft=draft,
        lora=lora,
        shm_path=shm_path,
        shm_slot_bytes=shm_slot,
    )
    log.info(
        "tensor-parallel group of %d ranks (%s%s, %d threads each): starting ranks 1-%d",
        world,
        spec.backend,
        f" + shared memory, {shm_slot >> 20} MiB slots" if shm_path else "",
        threads,
        world - 1,
    )
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]
    procs = [
        ctx.Process(
            target=follower_main,
            args=(src, spec, rank, settings.ops.log_level, settings.ops.log_format, send),
            name=f"tp-rank-{rank}",
            daemon=True,
        )
        for rank, (_, send) in enumerate(pipes, start=1)
    ]
    for p in procs:
        p.start()
    for _, send in pipes:
        send.close()
    leader = TPLeader(procs, shm_path)
    leader.watch()  # a rank that dies while the group forms takes rank 0 down too
    _join_group(spec, 0)
    leader.runner = load_rank(src, spec, 0)
    if spec.share_kv:
        leader.rank_caches = [leader.runner.kv_caches] + [recv.recv() for recv, _ in pipes]
    _ready(spec, 0)
    log.info("tensor-parallel group ready: %d ranks", world)
    return leader


# --------------------------------------------------------------------------------------------
# ranks 1..N-1


def follower_main(
    src: ModelSource, spec: RankSpec, rank: int, level: str, fmt: str, kv_conn: Any
) -> None:
    """A follower rank's process: join the group, load the shard, hand rank 0 its KV cache
    (``kv_conn``, when the worker moves blocks), run rank 0's broadcasts."""
    from kvflow.shared.logs import setup_logging

    setup_logging(f"worker-rank-{rank}", level, fmt)
    cpu_native.configure(spec.native)  # before any kernel loads, as the worker's own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops the group (or its death does)
    _exit_with_parent()
    try:
        _join_group(spec, rank)
        runner = load_rank(src, spec, rank)
        if spec.share_kv:  # CPU: into shared memory; CUDA: an IPC handle (torch's reductions)
            kv_conn.send(runner.kv_caches)
        kv_conn.close()
        _ready(spec, rank)
        steps = follow(runner)
        log.info("tensor-parallel rank %d: stopped after %d steps", rank, steps)
        torch.distributed.destroy_process_group()
    except Exception:
        log.exception("tensor-parallel rank %d failed; exiting (the group goes down)", rank)
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(GROUP_FAILED_EXIT)  # rank 0 is gone: nothing here can be used

    threading.Thread(target=run, name="tp-parent", daemon=True).start()


def _broken(runner: ModelRunner) -> bool:
    tp = runner.model.tp
    return tp is not None and tp.broken


def follow(runner: ModelRunner) -> int:
    """Run every plan (and reset) rank 0 broadcasts until it stops; returns the steps run. A
    collective that fails (a rank died, or timed out) raises."""
    from kvflow.shared.messages import StepPlan, decode

    steps = 0
    while True:
        size = torch.zeros(1, dtype=torch.long)
        torch.distributed.broadcast(size, 0)
        buf = torch.empty(int(size), dtype=torch.uint8)
        torch.distributed.broadcast(buf, 0)
        data = buf.numpy().tobytes()
        kind, payload = data[:1], data[1:]
        if kind == _STOP:
            return steps
        if kind == _RESET:
            runner.reset()
        elif kind == _FORGET and runner.loras is not None:
            runner.loras.forget(payload.decode())
        elif kind == _PLAN:
            plan = decode(payload)
            assert isinstance(plan, StepPlan)
            runner.execute(plan)
            if _broken(runner):
                raise RuntimeError("a collective of the step failed: the ranks are out of step")
            steps += 1
