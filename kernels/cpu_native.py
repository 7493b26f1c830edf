"""Native CPU kernels (C, compiled once with the machine's C compiler, loaded with ctypes).

The CPU path's hot spot that plain PyTorch does badly is decode attention over a paged cache: it
must gather every sequence's K/V blocks into a contiguous copy before a batched matmul can read
them, which moves the whole context through memory three times per layer. The C kernel in
``csrc/paged_attention_cpu.c`` reads the blocks where they lie.

Building needs no torch headers (plain C on raw pointers), so it takes about a second. The
library is cached in the machine cache's kernels/ folder by a hash of the source, the headers it
includes, the flags and the compiler, so a changed kernel is rebuilt. Where no compiler is
found, ``load()`` returns None and callers use the PyTorch reference.

A loaded library stays loaded for the process's life, so where they are built and whether they
are used at all is the process's, given once by its entry point (``configure``, before the first
kernel loads: the worker from its settings, services/worker/machine.py), never read here from
the environment.

Every native kernel runs its threads through one pool (``csrc/thread_pool.c``, loaded first and
globally by ``pool()``), not OpenMP: an OpenMP region waits for every thread of its team, so one
descheduled thread (another process on the core) stalls each of the few hundred regions of a
step, while the pool's calls wait only for tasks some thread has claimed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("kvflow.kernels")

CSRC = Path(__file__).parent / "csrc"
_SRC = CSRC / "paged_attention_cpu.c"
_POOL_SRC = CSRC / "thread_pool.c"
POOL_HEADER = CSRC / "kvf_pool.h"  # what every kernel includes (part of its build's key)
# -ffast-math lets gcc vectorise the max/sum reductions and expf (glibc's vector math); the
# arithmetic is still fixed for a given build, so results do not vary from call to call. It is
# a compile flag only: given at link time, gcc links crtfastmath.o into the library, whose
# constructor turns on flush-to-zero / denormals-are-zero for the whole process that loads it
# (every float in a worker, and hypothesis refusing to run in a test process that loaded it).
# -fopenmp-simd: the `omp simd` hints only (no OpenMP runtime; threads come from the pool).
_COMPILE_FLAGS = [
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fopenmp-simd",
    "-fPIC",
    f"-I{CSRC}",
    "-c",
]
_POOL_FLAGS = ["-O2", "-pthread", "-fPIC", "-c"]
_LINK_FLAGS = ["-shared", "-pthread"]


@dataclass(frozen=True)
class NativeSetup:
    """What a process tells its native kernels once: the machine cache ``cache_dir`` (libraries
    are kept in its kernels/ folder) and whether native kernels are used at all (False: the
    PyTorch reference runs everywhere: a switch for comparing and for machines whose compiler
    builds bad code)."""

    cache_dir: Path
    enabled: bool = True


_setup: NativeSetup | None = None


def configure(setup: NativeSetup) -> None:
    """Set this process's ``NativeSetup``, before the first kernel loads (RuntimeError for
    another setup once one has loaded: a library cannot be unloaded)."""
    global _setup
    if _setup is not None and setup != _setup and pool.cache_info().currsize:
        raise RuntimeError(f"native kernels already loaded with {_setup}; not switching to {setup}")
    _setup = setup


def setup() -> NativeSetup:
    """This process's ``NativeSetup`` (RuntimeError, saying what to call, before ``configure``)."""
    if _setup is None:
        raise RuntimeError(
            "the native CPU kernels were not configured: a process calls "
            "kvflow.kernels.cpu_native.configure(NativeSetup(cache_dir, enabled)) at its start "
            "(the worker: services/worker/machine.py, from --cache-dir and --native-kernels)"
        )
    return _setup


def library_dir(cache_dir: Path) -> Path:
    """Where built libraries are kept in the machine cache ``cache_dir``."""
    return cache_dir / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(
    src: Path = _SRC,
    compile_flags: Sequence[str] = _COMPILE_FLAGS,
    headers: Sequence[Path] = (POOL_HEADER,),
    *,
    cache_dir: Path,
) -> Path | None:
    """Compile ``src`` (including ``headers``) with ``compile_flags`` into a shared library in
    the machine cache ``cache_dir`` (or reuse the one built there); None without a working
    compiler, with a warning saying what to install."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (install gcc): using the slower PyTorch attention")
        return None
    if not src.is_file():  # an install without the package data
        log.warning("%s is missing (reinstall kvflow): using the slower PyTorch attention", src)
        return None
    flags = [cc, *compile_flags, "|", *_LINK_FLAGS]  # what the cached build's name depends on
    sources = b"".join(p.read_bytes() for p in (src, *headers))
    key = hashlib.sha256(sources + " ".join(flags).encode()).hexdigest()[:16]
    out = library_dir(cache_dir) / f"{src.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        obj = Path(tmp) / f"{src.stem}.o"
        proc = subprocess.run(
            [cc, *compile_flags, str(src), "-o", str(obj)], capture_output=True, text=True
        )
        if proc.returncode == 0:
            proc = subprocess.run(
                [cc, *_LINK_FLAGS, str(obj), "-o", str(tmp_out), "-lm"],
                capture_output=True,
                text=True,
            )
        if proc.returncode != 0:
            log.warning(
                "building %s failed (%s): using the slower PyTorch attention\n%s",
                src.name,
                cc,
                proc.stderr[-2000:],
            )
            return None
        os.replace(tmp_out, out)  # atomic: concurrent workers never load a half-written file
    log.info("built native CPU kernel %s", out)
    return out


@cache
def pool() -> ctypes.CDLL | None:
    """The thread pool every native kernel calls, loaded with its symbols global (kernel
    libraries loaded after it resolve ``kvf_parallel`` to this one pool); None where it cannot
    be built or native kernels are off (``NativeSetup.enabled``)."""
    native = setup()
    if not native.enabled:
        return None
    path = build(_POOL_SRC, _POOL_FLAGS, cache_dir=native.cache_dir)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    lib.kvf_pool_threads.restype = ctypes.c_int
    lib.kvf_pool_selftest.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p] + [
        ctypes.c_long
    ] * 2
    lib.kvf_pool_selftest.restype = ctypes.c_int
    return lib


def load_kernels(src: Path, compile_flags: Sequence[str]) -> ctypes.CDLL | None:
    """A kernel library built from ``src`` and loaded after the pool it calls; None where
    either cannot be built or native kernels are off."""
    if pool() is None:
        return None
    path = build(src, compile_flags, cache_dir=setup().cache_dir)
    return None if path is None else ctypes.CDLL(str(path))


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or native kernels are off."""
    lib = load_kernels(_SRC, _COMPILE_FLAGS)
    if lib is None:
        return None
    fn = lib.kvf_paged_decode_attention
    fn.restype = ctypes.c_int
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    fn.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, i, f, i, f, i, i]
    return lib


def available() -> bool:
    return load() is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    ``q`` [B, H, D] fp32; ``k_cache``/``v_cache`` [num_blocks, block_size, Hkv, D] fp32 or
    bf16 (widened to fp32 as they are read);
    ``block_tables`` [B, max_blocks] int32 (entries past a sequence's last block are not read);
    ``seq_lens`` [B] int32, each >= 1, counting the new token whose K/V is already written.
    Returns [B, H, D]. Any H / Hkv ratio; a sequence's result never depends on the batch.

    ``window`` > 0: sliding-window attention over the last ``window`` keys of each context only
    (the blocks before them, and their block-table entries, are not read). ``softcap`` > 0:
    scores (after ``scale``) become ``softcap * tanh(score / softcap)``. Same positional
    order as ``reference.DecodeFn``, so this is a ``plan_attention`` ``decode_fn``."""
    lib = load()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available (see the log for why)")
    b, h, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if (
        q.dtype != torch.float32
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or v_cache.dtype != k_cache.dtype
    ):
        raise TypeError("the native CPU kernel takes an fp32 q and an fp32 or bf16 KV cache")
    if dk != d or h % hkv or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables and seq_lens must be int32")
    if block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError("block_tables / seq_lens do not match the batch")
    if window < 0 or softcap < 0:
        raise ValueError(f"window ({window}) and softcap ({softcap}) must be >= 0")
    if b == 0:
        return q.new_empty(q.shape)
    lens = seq_lens.tolist()
    if min(lens) < 1 or max(lens) > block_tables.shape[1] * bs:
        raise ValueError("a context length is < 1 or longer than its block table")
    q = q.contiguous()
    tables = block_tables.contiguous()
    for t in (k_cache, v_cache):
        if not t.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    rc = lib.kvf_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        bs,
        tables.shape[1],
        nb,
        float(scale),
        int(window),
        float(softcap),
        int(k_cache.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise ValueError(f"a block table holds a block id outside [0, {nb})")
    if rc != 0:
        raise MemoryError("the native attention kernel could not allocate its scratch memory")
    return out
