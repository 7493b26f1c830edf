"""What llama.cpp's Gemma 2/3 loaders hardcode or default rather than read from a GGUF
(src/models/gemma2.cpp, gemma3.cpp), as kvflow's GGUF config fills it in: each case through the
family's own reader, so every field given is one the reader takes (strict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvflow.shared.gguf_header import GGUFHeader
from kvflow.shared.models.family import GgufFile
from kvflow.shared.models.registry import family, hf_config

SLIDE, FULL = "sliding_attention", "full_attention"


def gguf_raw(arch: str, layers: int, f: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A GGUF's config as shared/models/gguf_config.py maps it (the family's ``Gguf.config``
    hook over the shared fields), for a small Gemma of ``layers`` layers."""
    raw: dict[str, Any] = {
        "architectures": ["Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 64,
        "rope_theta": 1_000_000.0,
        "sliding_window": None,  # what the file lacks is None until gguf_config drops it
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        **extra,
    }
    hook = family(arch).gguf.config
    raw |= hook(GgufFile(GGUFHeader(Path(f"{arch}.gguf"), fields=f), arch), raw)
    return {k: v for k, v in raw.items() if v is not None}


def test_gemma3_every_sixth_layer_global_local_rope_base_gelu() -> None:
    raw = gguf_raw("gemma3", 8, {}, sliding_window=512)
    assert raw["layer_types"] == [SLIDE] * 5 + [FULL] + [SLIDE] * 2
    cfg = hf_config(raw, "gemma3.gguf", strict=True)
    assert cfg.layer_windows == (512,) * 5 + (0,) + (512,) * 2
    assert (cfg.rope.theta, cfg.rope_local.theta) == (1_000_000.0, 10_000.0)
    assert cfg.hidden_act == "gelu_tanh" and cfg.scale == 8**-0.5 and cfg.final_softcap == 0.0


def test_gemma3_pattern_and_swa_base_from_the_file_or_no_window() -> None:
    f = {"gemma3.attention.sliding_window_pattern": 3, "gemma3.rope.freq_base_swa": 5000.0}
    cfg = hf_config(gguf_raw("gemma3", 6, f, sliding_window=16), "g.gguf", strict=True)
    assert cfg.layer_windows == (16, 16, 0, 16, 16, 0) and cfg.rope_local.theta == 5000.0
    flags = {"gemma3.attention.sliding_window_pattern": [True, False, False, True]}
    cfg = hf_config(gguf_raw("gemma3", 4, flags, sliding_window=16), "g.gguf", strict=True)
    assert cfg.layer_windows == (16, 0, 0, 16)
    assert hf_config(gguf_raw("gemma3", 4, {}), "g.gguf", strict=True).layer_windows == ()


def test_gemma2_defaults_window_soft_caps_and_27b_query_scale() -> None:
    cfg = hf_config(gguf_raw("gemma2", 4, {}), "gemma2.gguf", strict=True)
    assert cfg.layer_windows == (4096, 0, 4096, 0) and cfg.rope_local is None
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.scale) == (50.0, 30.0, 8**-0.5)
    cfg = hf_config(gguf_raw("gemma2", 46, {}, attn_logit_softcapping=20.0), "g.gguf", strict=True)
    assert cfg.attn_softcap == 20.0 and cfg.scale == 16**-0.5  # 27B: hidden / heads = 16
