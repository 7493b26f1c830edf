"""The tokenizer service over a real NATS server: a long prompt is tokenized on its own thread,
so the short requests published after it are not held up behind it; and SIGTERM's drain
finishes the long prompt in hand before the service closes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvflow.services.tokenizer.service import BIG_INPUT_BYTES, TokenizerService
from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.messages import (
    GenerateRequest,
    SamplingParams,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
)

# ~600 KB (under NATS's 1 MiB max_payload): ~0.3-0.6 s of encoding, against ~1 ms for "hi"
LONG = "The river bends past the old mill, " * 17_000
INBOX = "test.tokenizer.replies"


async def _service(nats_url: str, tokenizer: Any) -> TokenizerService:
    svc = TokenizerService(Settings.of(nats_url=nats_url), tokenizer, 200_000, [2])
    await svc.start()
    return svc


async def _listen(nats_url: str) -> tuple[Bus, list[Any]]:
    """(a client, the tokenized requests and errors in arrival order)."""
    bus, seen = Bus("test"), []
    await bus.connect(nats_url)

    async def on(msg: Any, _raw: Any) -> None:
        seen.append(msg)

    await bus.subscribe(subjects.REQUESTS, on)
    await bus.subscribe(INBOX, on)
    return bus, seen


def _request(rid: str, prompt: str) -> GenerateRequest:
    return GenerateRequest(rid, INBOX, SamplingParams(max_tokens=4), prompt)


async def _until(seen: list, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(seen) < n:
        assert time.monotonic() < deadline, f"only {len(seen)} of {n} replies: {seen}"
        await asyncio.sleep(0.01)


def _tokenized(
    nats_url: str, tokenizer: Any, requests: list[GenerateRequest]
) -> tuple[list[Any], TokenizerService]:
    """Publish ``requests`` to a tokenizer service; its replies in arrival order, and it."""

    async def main() -> tuple[list[Any], TokenizerService]:
        svc = await _service(nats_url, tokenizer)
        client, seen = await _listen(nats_url)
        try:
            for r in requests:
                await client.publish(subjects.TOKENIZE, r)
            await _until(seen, len(requests))
            return seen, svc
        finally:
            await svc.drain()
            await svc.bus.close()
            await client.close()

    return asyncio.run(main())


def test_short_requests_are_not_held_up_by_a_long_prompt(nats_url, tokenizer) -> None:
    assert len(LONG.encode()) > 30 * BIG_INPUT_BYTES
    requests = [_request("long-1", LONG), _request("long-2", LONG)]
    requests += [_request(f"short-{i}", "hi") for i in range(5)]
    seen, _ = _tokenized(nats_url, tokenizer, requests)
    order = [m.request_id for m in seen]
    # before: one at a time in arrival order (long-1, long-2, short-0 ...): the short ones
    # waited ~1 s for both long prompts. The long ones keep their order between them.
    assert order[:5] == [f"short-{i}" for i in range(5)], order
    assert order[5:] == ["long-1", "long-2"], order


def test_the_long_prompt_tokenized_on_its_thread_equals_the_tokenizer_s_own(
    nats_url, tokenizer
) -> None:
    [out], _ = _tokenized(nats_url, tokenizer, [_request("long", LONG)])
    assert isinstance(out, TokenizedRequest)
    assert out.prompt_token_ids == list(tokenizer(LONG)["input_ids"])
    assert out.params.max_tokens == 4


def test_a_long_text_to_tokenize_does_not_hold_up_the_requests(nats_url, tokenizer) -> None:
    """/tokenize (an RPC on the service's second subject) of a long text goes to the same
    thread: the event loop, which serves both subjects, goes on with the short requests."""

    async def main() -> tuple[list[str], bool, object]:
        svc = await _service(nats_url, tokenizer)
        client, seen = await _listen(nats_url)
        try:
            rpc = asyncio.create_task(
                client.request(subjects.TOKENIZER_RPC, TokenizeRequest(prompt=LONG), timeout=60)
            )
            await asyncio.sleep(0.05)  # the RPC is out first
            for i in range(5):
                await client.publish(subjects.TOKENIZE, _request(f"short-{i}", "hi"))
            await _until(seen, 5)
            answered_before_the_short_ones = rpc.done()
            return [m.request_id for m in seen], answered_before_the_short_ones, await rpc
        finally:
            await svc.drain()
            await svc.bus.close()
            await client.close()

    order, rpc_first, result = asyncio.run(main())
    assert order == [f"short-{i}" for i in range(5)]
    assert not rpc_first  # before: the RPC's encoding held the loop, the short ones after it
    assert isinstance(result, TokenizeResult)
    assert result.tokens == list(tokenizer(LONG)["input_ids"])


def test_drain_finishes_the_long_prompt_in_hand(nats_url, tokenizer) -> None:
    """SIGTERM: the long prompt already taken is tokenized and published before the service
    closes; what is published after the drain is not taken (it waits for another tokenizer)."""

    async def main() -> list[str]:
        svc = await _service(nats_url, tokenizer)
        client, seen = await _listen(nats_url)
        try:
            await client.publish(subjects.TOKENIZE, _request("long", LONG))
            # the service has it (queued for its thread) before the drain starts
            deadline = time.monotonic() + 30
            while svc._big.empty() and not seen:
                assert time.monotonic() < deadline, "the long prompt never arrived"
                await asyncio.sleep(0.005)
            await svc.drain()
            await svc.bus.close()
            await client.publish(subjects.TOKENIZE, _request("after", "hi"))
            await _until(seen, 1)
            await asyncio.sleep(0.3)  # time for a wrong delivery of "after"
            return [m.request_id for m in seen]
        finally:
            await client.close()

    assert asyncio.run(main()) == ["long"]


class _Uncopyable:
    """A tokenizer that refuses to be copied (as one holding an unpicklable handle might)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tok(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tok)

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError("this tokenizer cannot be copied")


def test_a_tokenizer_that_cannot_be_copied_tokenizes_big_inputs_in_line(
    nats_url, tokenizer
) -> None:
    requests = [_request("long-1", LONG), _request("long-2", LONG)]
    got, svc = _tokenized(nats_url, _Uncopyable(tokenizer), requests)
    assert svc._no_big_copy
    want = list(tokenizer(LONG)["input_ids"])
    assert [(m.request_id, m.prompt_token_ids == want) for m in got] == [
        ("long-1", True),
        ("long-2", True),
    ]
