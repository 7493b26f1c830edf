"""Models kvflow cannot serve are refused from their config alone, before any service starts or
the tokenizer is converted, with the field, its value and what to do instead
(``kvflow serve``, ``kvflow run SERVICE``, ``LLM()``); what it can serve natively (the families
of the registry) and through transformers (``--model-impl``) is found from config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow import LLM
from kvflow.cli.main import main
from kvflow.shared.access.connect import EXIT_REFUSED
from kvflow.shared.model_config import check_model, load_config
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.registry import supported_architectures
from tests.helpers.families import CONFIGS, family_of

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def model_dir(tmp_path: Path, **fields: object) -> Path:
    """A directory with only a config.json (no weights, no tokenizer: a refusal must come
    before either is read)."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return tmp_path


CASES = [
    ({"hidden_act": "relu2"}, "hidden_act = 'relu2': not a supported activation"),
    (
        {"rope_scaling": {"rope_type": "mrope3d", "factor": 2}},
        "rope type 'mrope3d' is not supported",
    ),
    ({"partial_rotary_factor": 0.5}, "partial rotary factor is not supported natively"),
    (  # llama.cpp's GGUFs of OLMo 3 say olmo2 with a window: never served without it
        {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "sliding_window": 8},
        "sliding_window = 8: OLMo 2 has no sliding window: this is OLMo 3",
    ),
    (
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba"},
        "architecture 'MambaForCausalLM' is not supported natively",
    ),
]


@pytest.mark.parametrize(("fields", "message"), CASES)
def test_serve_refuses_before_starting_anything(tmp_path, capsys, fields, message) -> None:
    path = model_dir(tmp_path, **fields)
    assert main(["serve", "--model", str(path), "--model-impl", "kvflow", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--model-impl transformers" in err  # what to do instead
    assert "nats" not in err.lower()  # nothing was started


def test_an_unknown_architecture_lists_the_supported_ones(tmp_path) -> None:
    path = model_dir(tmp_path, architectures=["FancyForCausalLM"], model_type="fancy")
    with pytest.raises(ValueError) as e:
        check_model(str(path))
    assert "FancyForCausalLM" in str(e.value)
    assert ", ".join(supported_architectures()) in str(e.value)
    assert "Qwen2ForCausalLM" in supported_architectures()


def test_run_refuses_with_the_exit_code_that_stops_restarts(tmp_path, capsys) -> None:
    path = model_dir(tmp_path, hidden_act="relu2")
    assert main(["run", "tokenizer", "--model", str(path)]) == EXIT_REFUSED
    assert "hidden_act = 'relu2'" in capsys.readouterr().err


def test_llm_refuses_before_converting_a_tokenizer(tmp_path) -> None:
    path = model_dir(tmp_path, hidden_act="relu2")  # no tokenizer files at all
    with pytest.raises(ValueError, match="hidden_act = 'relu2'"):
        LLM(model=str(path))


def test_auto_falls_back_to_transformers_for_an_architecture_it_lacks(tmp_path) -> None:
    path = model_dir(
        tmp_path,
        architectures=["GPTNeoXForCausalLM"],
        model_type="gpt_neox",
        rotary_pct=0.25,
    )
    src = ModelSource("hf", path, "neox")
    assert load_config(src).family == "transformers"
    with pytest.raises(ValueError, match="or serve it with --model-impl transformers"):
        load_config(src, model_impl="kvflow")
    native = model_dir(tmp_path, hidden_act="silu")
    assert load_config(ModelSource("hf", native, "l"), model_impl="transformers").family == (
        "transformers"
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_default_config_field_is_read(name: str) -> None:
    """A family's config class as transformers writes it by default: every field is read by
    kvflow or known to change nothing at inference (strict mode refuses any other)."""
    from kvflow.shared.models.registry import hf_config

    raw = CONFIGS[name]().to_dict()
    raw["architectures"] = [type(CONFIGS[name]()).__name__.replace("Config", "ForCausalLM")]
    raw["architectures"] = [
        a.replace("TextForCausalLM", "ForCausalLM") for a in raw["architectures"]
    ]
    assert hf_config(raw, name, strict=True).family == family_of(name)


def test_a_mixture_of_experts_refuses_adapters(tmp_path) -> None:
    moe = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    path = model_dir(tmp_path, **moe, num_local_experts=4, num_experts_per_tok=2)
    assert check_model(str(path), tensor_parallel_size=2).num_experts == 4
    with pytest.raises(ValueError, match="--enable-lora is not served yet for mixtures"):
        check_model(str(path), enable_lora=True)


@pytest.mark.parametrize(
    ("fields", "tp", "lora", "message"),
    [
        (
            {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"},
            2,
            False,
            "--tensor-parallel-size > 1 is not served for models whose q/k norms run over all "
            "heads together: tensor parallelism would need one more all-reduce per layer (olmo2)",
        ),
        (
            {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2"},
            1,
            True,
            "--enable-lora is not served for models with an ungated MLP (starcoder2)",
        ),
        (
            {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "rotary_pct": 0.25},
            2,
            False,
            "--tensor-parallel-size > 1 is not served through transformers' own modules",
        ),
    ],
)
def test_a_family_s_refusals_come_before_anything_starts(tmp_path, fields, tp, lora, message):
    """Each family's file says what it cannot be served with (``Family.no_tensor_parallel``,
    ``no_lora``); ``check_model`` refuses it from config.json alone, naming the family, and the
    same model is served without the flag."""
    path = model_dir(tmp_path, **fields)
    with pytest.raises(ValueError) as e:
        check_model(str(path), tensor_parallel_size=tp, enable_lora=lora)
    assert f"{path}: {message}" in str(e.value)
    assert check_model(str(path)).num_layers == 2
