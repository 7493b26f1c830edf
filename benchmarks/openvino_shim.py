"""A small OpenAI ``/v1/completions`` server over OpenVINO GenAI's ContinuousBatchingPipeline, so
that ``kvflow bench peers`` can load OpenVINO with the same client as every other engine.

It runs in OpenVINO's own virtual environment (scripts/peers-install.sh), so it imports nothing
from kvflow: only openvino_genai, fastapi and uvicorn. It serves what the benchmark sends and no
more: token-id or text prompts, ``max_tokens``, greedy, ``ignore_eos``, streamed or not, with
usage. One thread owns the pipeline: it adds the requests that arrived, runs ``step()`` (one
scheduled batch: prefill chunks and decodes together), and hands each request's new tokens to
its stream. ``GET /health`` answers once the model is compiled.

    python benchmarks/openvino_shim.py --model IR_DIR --port 8001 [--precision f32]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import uvicorn

try:  # OpenVINO's own venv has these, kvflow's has not
    import openvino as ov
    import openvino_genai as ov_genai
except ImportError as e:
    raise SystemExit(
        f"{e}: run this with OpenVINO's Python (scripts/peers-install.sh openvino makes it)"
    ) from e
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Pending:
    """One request: its prompt ids and its config, and where its tokens go (None: finished)."""

    ids: list[int]
    config: ov_genai.GenerationConfig
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)


class Engine:
    """The pipeline and the one thread that steps it."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        sched = ov_genai.SchedulerConfig()
        sched.max_num_seqs = args.max_num_seqs
        sched.max_num_batched_tokens = args.max_num_batched_tokens
        sched.cache_size = args.cache_size
        sched.dynamic_split_fuse = True
        sched.enable_prefix_caching = False  # the benchmark never repeats a prompt
        props: dict = {}
        if args.precision == "f32":
            props = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        self.pipe = ov_genai.ContinuousBatchingPipeline(model, sched, "CPU", props)
        self.tokenizer = self.pipe.get_tokenizer()
        self.eos = self.pipe.get_config().eos_token_id
        self.inbox: queue.Queue[tuple[int, Pending]] = queue.Queue()
        self.ids = itertools.count()
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, p: Pending) -> None:
        self.inbox.put((next(self.ids), p))

    def _loop(self) -> None:
        live: dict[int, tuple[ov_genai.GenerationHandle, Pending]] = {}
        while True:
            while live and not self.inbox.empty() or not live:
                rid, p = self.inbox.get()  # blocks only when nothing runs
                try:
                    tensor = ov.Tensor(np.array([p.ids], dtype=np.int64))
                    live[rid] = (self.pipe.add_request(rid, tensor, p.config), p)
                except Exception as e:  # noqa: BLE001 - that request fails, the server goes on
                    p.loop.call_soon_threadsafe(p.out.put_nowait, e)
            try:
                self.pipe.step()
            except Exception as e:  # noqa: BLE001 - the requests in flight fail, not the server
                for _, p in live.values():
                    p.loop.call_soon_threadsafe(p.out.put_nowait, e)
                live.clear()
                continue
            for rid, (handle, p) in list(live.items()):
                while handle.can_read():  # read() pops one step's outputs
                    for out in handle.read().values():
                        if out.generated_ids:
                            p.loop.call_soon_threadsafe(p.out.put_nowait, list(out.generated_ids))
                if handle.get_status() != ov_genai.GenerationStatus.RUNNING:
                    p.loop.call_soon_threadsafe(p.out.put_nowait, None)
                    del live[rid]


def build_app(engine: Engine, name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = list(engine.tokenizer.encode(prompt).input_ids.data[0])
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            return JSONResponse({"error": {"message": "prompt: a string or token ids"}}, 400)
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = int(body.get("max_tokens") or 16)
        config.ignore_eos = bool(body.get("ignore_eos", False))
        config.do_sample = False  # the benchmark is greedy
        pending = Pending(ids, config, asyncio.get_running_loop())
        engine.submit(pending)
        created = int(time.time())

        async def tokens() -> AsyncIterator[list[int]]:
            while (got := await pending.out.get()) is not None:
                if isinstance(got, Exception):
                    raise RuntimeError(f"OpenVINO GenAI: {got}") from got
                yield got

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> dict:
            c = {"id": "cmpl-ov", "object": "text_completion", "created": created, "model": name}
            c["choices"] = [{"index": 0, "text": text, "finish_reason": finish}]
            if usage is not None:
                c["usage"] = usage
            return c

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not body.get("stream"):
            out: list[int] = []
            async for got in tokens():
                out += got
            finish = "length" if len(out) >= config.max_new_tokens else "stop"
            return JSONResponse(chunk(engine.tokenizer.decode(out), finish, usage(len(out))))

        async def stream() -> AsyncIterator[str]:
            n = 0
            async for got in tokens():
                n += len(got)
                yield f"data: {json.dumps(chunk(engine.tokenizer.decode(got), None))}\n\n"
            finish = "length" if n >= config.max_new_tokens else "stop"
            yield f"data: {json.dumps(chunk('', finish))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                last = chunk("", None, usage(n))
                last["choices"] = []
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an optimum-intel export (openvino_model.xml)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default="openvino")
    p.add_argument(
        "--precision",
        choices=["f32", "default"],
        default="default",
        help="f32: fp32 compute and KV cache; default: what the CPU plugin picks",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cache-size", type=int, default=4, help="KV cache, GiB")
    args = p.parse_args()
    engine = Engine(args.model, args)
    core = ov.Core()
    hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    print(f"openvino_genai {ov_genai.__version__}; CPU plugin default precision {hint}", flush=True)
    uvicorn.run(build_app(engine, args.served_model_name), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
