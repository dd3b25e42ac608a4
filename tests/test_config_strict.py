"""Hostile config.json files: a field of the wrong JSON type, an unknown layer type, a wrapper,
zero experts, a one-token model, a bad --moe-distribution. Each is refused in one line naming the
file, the field and the value (exit code 2 from the CLI), never read as some other value."""

import json
from pathlib import Path

import pytest

from backends.costmodel.optables.moe import check_moe_distribution
from backends.model_config import ModelConfig
from sim.app.cli import main
from sim.errors import ServesimError
from tests.moe_configs import GEMMA2_9B, MISTRAL_7B_V01

aic = pytest.importorskip("aiconfigurator_core")
CONFIGS = Path(aic.__file__).parent / "model_configs"
TRACE = Path(__file__).parent.parent / "traces" / "samples" / "azure_conv_2023_first5min.csv"
# The package's files that load (the others are refused naming what servesim cannot price).
LOADS = {"MiniMaxAI--MiniMax-M2.5", "MiniMaxAI--MiniMax-M2.7", "Qwen--Qwen3-0.6B", "Qwen--Qwen3-1.7B",
         "Qwen--Qwen3-235B-A22B", "Qwen--Qwen3-235B-A22B-FP8", "Qwen--Qwen3-30B-A3B", "Qwen--Qwen3-30B-A3B-FP8",
         "Qwen--Qwen3-32B", "Qwen--Qwen3-32B-FP8", "Qwen--Qwen3-32B-FP8-Static-PerTensor", "Qwen--Qwen3-8B",
         "Qwen--Qwen3-Coder-480B-A35B-Instruct", "deepseek-ai--DeepSeek-R1", "deepseek-ai--DeepSeek-V3",
         "meta-llama--Meta-Llama-3.1-405B", "meta-llama--Meta-Llama-3.1-70B", "meta-llama--Meta-Llama-3.1-8B",
         "mistralai--Mixtral-8x22B-v0.1", "mistralai--Mixtral-8x7B-v0.1", "moonshotai--Kimi-K2-Instruct",
         "moonshotai--Kimi-K2.5", "nvidia--DeepSeek-V3.1-NVFP4", "nvidia--Kimi-K2.5-NVFP4", "nvidia--Kimi-K2.6-NVFP4",
         "nvidia--Llama-3.1-70B-Instruct-FP8", "nvidia--MiniMax-M2.5-NVFP4", "nvidia--MiniMax-M2.7-NVFP4",
         "nvidia--Qwen3-235B-A22B-NVFP4", "openai--gpt-oss-120b", "openai--gpt-oss-20b",
         # Qwen3-VL's language models and Llama 4, read for text prompts (docs/moe.md)
         "Qwen--Qwen3-VL-2B-Instruct", "Qwen--Qwen3-VL-4B-Instruct", "Qwen--Qwen3-VL-8B-Instruct",
         "Qwen--Qwen3-VL-32B-Instruct", "Qwen--Qwen3-VL-32B-Thinking", "Qwen--Qwen3-VL-30B-A3B-Instruct",
         "Qwen--Qwen3-VL-235B-A22B-Instruct", "meta-llama--Llama-4-Scout-17B-16E-Instruct",
         "meta-llama--Llama-4-Maverick-17B-128E-Instruct",
         # DeepSeek sparse attention (docs/moe.md)
         "deepseek-ai--DeepSeek-V3.2", "nvidia--DeepSeek-V3.2-NVFP4", "zai-org--GLM-5", "zai-org--GLM-5-FP8",
         "zai-org--GLM-5.1", "zai-org--GLM-5.1-FP8"}


def package(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}_config.json").read_text())


LLAMA = "meta-llama--Meta-Llama-3.1-8B"
QWEN3 = "Qwen--Qwen3-8B"
QWEN3_MOE = "Qwen--Qwen3-30B-A3B"
MIXTRAL = "mistralai--Mixtral-8x7B-v0.1"
DEEPSEEK = "deepseek-ai--DeepSeek-V3"
GPT_OSS = "openai--gpt-oss-20b"


def write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(path)
    message = str(e.value)
    assert "\n" not in message and message.count(str(path)) == 1
    return message


def test_every_package_config_loads_or_is_refused_in_one_line():
    loaded = set()
    for path in sorted(CONFIGS.glob("*_config.json")):
        if path.name.endswith("hf_quant_config.json"):
            continue
        try:
            ModelConfig.from_hf(path)
            loaded.add(path.name.removesuffix("_config.json"))
        except ServesimError as e:
            assert "\n" not in str(e) and str(path) in str(e)
    assert LOADS <= loaded


# 1. A boolean must be JSON true or false, a number a JSON number.


@pytest.mark.parametrize("name,change,field", [
    (LLAMA, {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    (LLAMA, {"tie_word_embeddings": 0}, "tie_word_embeddings"),
    (LLAMA, {"attention_bias": "true"}, "attention_bias"),
    (QWEN3, {"use_sliding_window": "false", "sliding_window": 4096}, "use_sliding_window"),
    (QWEN3_MOE, {"use_sliding_window": "false", "sliding_window": 4096}, "use_sliding_window"),
    (QWEN3_MOE, {"norm_topk_prob": "false"}, "norm_topk_prob"),
    (QWEN3_MOE, {"tie_word_embeddings": "true"}, "tie_word_embeddings"),
    (DEEPSEEK, {"norm_topk_prob": 1}, "norm_topk_prob"),
    (GPT_OSS, {"attention_bias": "true"}, "attention_bias"),
    (MIXTRAL, {"use_sliding_window": "no", "sliding_window": 4096}, "use_sliding_window"),
])
def test_a_boolean_field_must_be_true_or_false(tmp_path, name, change, field):
    path = write(tmp_path, {**package(name), **change})
    assert refusal(path) == f"{path}: {field} = {change[field]!r}, expected true or false"


@pytest.mark.parametrize("raw", [MISTRAL_7B_V01, GEMMA2_9B])
@pytest.mark.parametrize("field", ["tie_word_embeddings", "use_sliding_window", "attention_bias"])
def test_a_boolean_field_of_the_sliding_families_must_be_true_or_false(tmp_path, raw, field):
    path = write(tmp_path, {**raw, field: "false"})
    assert refusal(path) == f"{path}: {field} = 'false', expected true or false"


@pytest.mark.parametrize("name", [LLAMA, QWEN3_MOE, GPT_OSS])
@pytest.mark.parametrize("value", ["1e-5", None, 0, -1e-5, True])
def test_rms_norm_eps_must_be_a_positive_number(tmp_path, name, value):
    path = write(tmp_path, {**package(name), "rms_norm_eps": value})
    if value is None:  # null: transformers' default
        assert ModelConfig.from_hf(path).rms_norm_eps == 1e-6
    else:
        assert refusal(path) == f"{path}: rms_norm_eps = {value!r}, expected a number above 0"


def test_json_booleans_and_nulls_read_as_before(tmp_path):
    raw = package(LLAMA)
    untied = ModelConfig.from_hf(write(tmp_path, raw))
    assert ModelConfig.from_hf(write(tmp_path, {**raw, "tie_word_embeddings": None})) == untied  # the default
    tied = ModelConfig.from_hf(write(tmp_path, {**raw, "tie_word_embeddings": True}))
    assert tied.tie_word_embeddings and tied.num_parameters < untied.num_parameters
    moe = ModelConfig.from_hf(write(tmp_path, {**package(QWEN3_MOE), "norm_topk_prob": False}))
    assert not moe.norm_topk_prob
    oss = ModelConfig.from_hf(write(tmp_path, {**package(GPT_OSS), "attention_bias": False}))
    assert not oss.attention_bias


# 2. layer_types holds only the layer types servesim prices.


@pytest.mark.parametrize("name,at", [(GPT_OSS, 0), (GPT_OSS, 5), (QWEN3, 3), (QWEN3_MOE, 7)])
def test_an_unknown_layer_type_is_refused_naming_its_position(tmp_path, name, at):
    raw = package(name)
    layers = raw["num_hidden_layers"]
    types = list(raw.get("layer_types") or ["full_attention"] * layers)
    types[at:] = ["banana"] * (layers - at)
    path = write(tmp_path, {**raw, "layer_types": types})
    assert refusal(path) == (f"{path}: layer_types[{at}] = 'banana': servesim prices full_attention, "
                             "sliding_attention and chunked_attention (Llama 4) layers only")


STATE_HINT = "keeps a state per request, which servesim does not simulate yet (docs/moe.md, Not yet)"


@pytest.mark.parametrize("name", ["Qwen--Qwen3.5-27B", "Qwen--Qwen3.5-35B-A3B", "Qwen--Qwen3.5-397B-A17B",
                                  "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nvidia--Nemotron-H-56B-Base-8K"])
def test_a_hybrid_of_linear_attention_or_state_space_layers_is_refused_saying_why(name):
    """Qwen3.5's Gated DeltaNet and Nemotron-H's Mamba layers keep a state per request: the refusal
    says so, beside the families servesim prices, and points at what vLLM does for them."""
    message = refusal(CONFIGS / f"{name}_config.json")
    assert "is not supported: its linear-attention or state-space layers " + STATE_HINT.replace("keeps", "keep") \
        in message


def test_a_linear_attention_layer_type_is_refused_saying_why(tmp_path):
    raw = package(QWEN3)
    types = ["full_attention"] * raw["num_hidden_layers"]
    types[1] = "linear_attention"
    path = write(tmp_path, {**raw, "layer_types": types})
    assert refusal(path) == (f"{path}: layer_types[1] = 'linear_attention': servesim prices full_attention, "
                             "sliding_attention and chunked_attention (Llama 4) layers only; a linear-attention or "
                             f"state-space layer {STATE_HINT}")
    assert "state" not in refusal(write(tmp_path, {**raw, "layer_types": ["banana"] * raw["num_hidden_layers"]}))


def test_layer_types_must_name_every_layer(tmp_path):
    raw = package(GPT_OSS)
    path = write(tmp_path, {**raw, "layer_types": raw["layer_types"][:-1]})
    assert refusal(path) == f"{path}: layer_types has 23 entries for num_hidden_layers = 24"


def test_qwen3_moe_sliding_layers_are_refused(tmp_path):
    raw = package(QWEN3_MOE)
    path = write(tmp_path, {**raw, "layer_types": ["sliding_attention"] * raw["num_hidden_layers"]})
    assert "layer_types has sliding_attention layers" in refusal(path)


# 3. A multimodal wrapper around a decoder servesim reads only at the top level.


@pytest.mark.parametrize("inner", [LLAMA, QWEN3])
def test_a_wrapped_dense_decoder_names_the_wrapper(tmp_path, inner):
    text = package(inner)
    path = write(tmp_path, {"model_type": "llava", "text_config": text})
    message = refusal(path)
    assert f"model_type 'llava' (a multimodal wrapper around a text_config of model_type {text['model_type']!r}) " \
           "is not supported" in message
    assert "servesim prices llama" not in message  # no longer contradicts itself
    assert ModelConfig.from_hf(write(tmp_path, text)).model_type == ""  # the same decoder alone loads


# 4. A mixture of experts has at least one expert, and top-k of them at most.


@pytest.mark.parametrize("name,field", [(QWEN3_MOE, "num_experts"), (MIXTRAL, "num_local_experts"),
                                        (GPT_OSS, "num_local_experts"), (DEEPSEEK, "n_routed_experts")])
@pytest.mark.parametrize("value", [0, False])
def test_zero_experts_are_refused_naming_the_field(tmp_path, name, field, value):
    path = write(tmp_path, {**package(name), field: value})
    assert refusal(path) == f"{path}: {field} = {value!r}, expected a whole number >= 1"


def test_top_k_above_the_experts_is_refused(tmp_path):
    path = write(tmp_path, {**package(QWEN3_MOE), "num_experts_per_tok": 200})
    assert "num_experts_per_tok must be in [1, num_experts = 128], got 200" in refusal(path)


# 5. A model's context holds a prompt and one output token at least (--max-model-len's least).


@pytest.mark.parametrize("name", [LLAMA, QWEN3_MOE, GPT_OSS])
def test_a_one_token_context_is_refused(tmp_path, name):
    path = write(tmp_path, {**package(name), "max_position_embeddings": 1})
    assert refusal(path) == f"{path}: max_position_embeddings = 1, expected a whole number >= 2"
    assert ModelConfig.from_hf(write(tmp_path, {**package(name), "max_position_embeddings": 2})) \
        .max_position_embeddings == 2


@pytest.mark.parametrize("name", [LLAMA, QWEN3_MOE])
def test_a_context_past_any_models_is_refused(tmp_path, name):
    path = write(tmp_path, {**package(name), "max_position_embeddings": 2**40})
    assert refusal(path).startswith(f"{path}: max_position_embeddings = {2**40}, more than 16,777,216 tokens, "
                                    "the most --max-model-len takes")


def test_the_cli_refuses_a_bad_config_with_exit_code_2(tmp_path, capsys):
    path = write(tmp_path, {**package(LLAMA), "tie_word_embeddings": "false"})
    code = main(["replay", str(TRACE), "--limit", "5", "--model", str(path), "--hardware", "H200",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"sim: error: {path}: tie_word_embeddings = 'false', expected true or false"


# 6. --moe-distribution says what it accepts.


@pytest.mark.parametrize("bad", ["power-law:0", "power-law:0.0", "power-law:-1", "power-law", "zipf:1.1"])
def test_a_bad_moe_distribution_says_what_is_accepted(bad):
    with pytest.raises(ServesimError) as e:
        check_moe_distribution("--moe-distribution", bad)
    assert str(e.value) == (f"--moe-distribution {bad!r}: give auto, balanced or power-law:ALPHA with ALPHA above 0 "
                            "(the moe_perf tables measure power-law:1.01 and power-law:1.2)")


@pytest.mark.parametrize("good", ["auto", "balanced", "power-law:1.01", "power-law:1.2", "power-law:0.5"])
def test_good_moe_distributions_pass_the_check(good):
    check_moe_distribution("--moe-distribution", good)
