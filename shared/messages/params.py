"""Request parameters, embedded in messages and never sent alone."""

from __future__ import annotations

import msgspec

# Request parameters (embedded, not sent alone)


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on the output, enforced while sampling (the worker masks the logits with a
    grammar matcher). ``kind``: "json" (``spec`` is a JSON schema as text), "regex" (a regular
    expression), "choice" (a JSON list of strings) or "grammar" (EBNF, xgrammar's dialect)."""

    kind: str
    spec: str
    param: str = "response_format"  # the request field it came from, for error messages


class LoRARef(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A LoRA adapter a request runs with (vLLM's ``LoRARequest``): its served ``name`` (what
    the request's ``model`` says), a positive ``id`` and the ``path`` of its PEFT directory
    (adapter_config.json + adapter_model.safetensors), which every worker reads itself."""

    name: str
    id: int
    path: str


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling and stopping parameters (vLLM names), as the pipeline carries them:
    each field is a feature's (shared/sampling/features.py maps the API's values onto it).
    msgpack arrays: new fields go at the end."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top logprobs per sampled token (0 = only the sampled one)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # top logprobs per prompt token (echo); such requests compute their whole prompt, skipping
    # prefix-cache hits, because cached tokens have no logits (vLLM does the same)
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None  # response_format / guided decoding
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    # vLLM's bad_words: never generate these words; the tokenizer fills in their token ids
    # (each word with and without a leading space), which the worker bans as sequences
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Marks a pooling request (vLLM's pooling tasks): the prompt is computed and its final
    hidden states are pooled into one vector instead of sampling a token.

    ``task``: "embed" (the pooled vector, /v1/embeddings), "classify" (the model's
    classification head over the pooled vector, then softmax: class probabilities, /classify)
    or "score" (the head's one logit through the model's score activation, a sigmoid unless
    its sentence-transformers config names another: /score, /rerank with a cross-encoder).
    ``pooling_type``: "LAST" (the last prompt token's row, vLLM's default for decoder models),
    "MEAN" (the mean of every prompt row), "CLS" (the first row) or "" (the model's own: its
    sentence-transformers pooling config, else CLS for encoders and LAST for decoders; the
    tokenizer fills it in). ``normalize``: L2-normalized (embed only), as vLLM gives by default.
    Set by the tokenizer: ``bidirectional`` (an encoder: the prompt is computed whole, in one
    step, never from the prefix cache) and ``pair_start`` (a text pair's second text starts at
    this token: token type 1 from there; 0: one text)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    task: str = "embed"
    bidirectional: bool = False
    pair_start: int = 0

    def needs_whole_prompt(self) -> bool:
        """MEAN and CLS read rows a prefix-cache hit would skip, and an encoder attends to
        every token of the prompt: such requests compute their whole prompt (as prompt_logprobs
        requests do); LAST in a decoder reads only the last row, which is always computed."""
        return self.pooling_type != "LAST" or self.bidirectional


POOLING_TASKS = ("embed", "classify", "score")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


class ToolCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A function call an assistant message made (OpenAI's ``tool_calls`` entry); ``arguments``
    is JSON text, as the API carries it."""

    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    role: str
    content: str
    tool_calls: list[ToolCall] = []  # an assistant message's calls
    tool_call_id: str | None = None  # a ``tool`` message: the call it answers
    name: str | None = None  # a ``tool`` message: the function's name (from its call)


class ToolSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A function tool offered to the model (OpenAI's ``tools`` entry, function only);
    ``parameters`` is its JSON schema as text."""

    name: str
    description: str | None = None
    parameters: str | None = None


class ToolParsing(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How the detokenizer turns a request's text into tool calls.

    ``mode``: "auto" (the model may write calls in ``parser``'s format, e.g. hermes
    ``<tool_call>{...}</tool_call>``; other text stays content), "required" (the grammar made the
    text a JSON array of ``{"name", "parameters"}``: every element is a call) or "named" (the
    grammar made the text the arguments of the function ``name``)."""

    mode: str
    parser: str = ""
    name: str = ""
