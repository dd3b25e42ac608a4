"""The roofline cost model: shapes, limits and the vectorised run path."""

import numpy as np
import pytest

from backends.costmodel.roofline import Efficiencies, RooflineCostModel
from backends.hardware import HARDWARE
from backends.model_config import ModelConfig
from sim.batch import Batch
from sim.errors import ServesimError


def decode_batch(n, context):
    b = Batch()
    for i in range(n):
        b.add(str(i), context - 1, 1, [], needs_logits=True, is_decode=True)
    return b


def test_parameter_counts_match_the_published_sizes():
    for name, published in (("Llama-3.1-8B", 8.03e9), ("Qwen3-8B", 8.19e9), ("Qwen3-0.6B", 0.596e9),
                            ("Mistral-7B", 7.25e9)):
        assert ModelConfig.from_preset(name).num_parameters == pytest.approx(published, rel=1e-3)


def test_small_decode_is_memory_bound_on_weights():
    be = RooflineCostModel(ModelConfig.from_preset("Llama-3.1-8B"), HARDWARE["H100-SXM"], Efficiencies(memory=1.0, step_overhead_s=0.0))
    seconds = be.execute(decode_batch(1, 16)).seconds
    m = ModelConfig.from_preset("Llama-3.1-8B")
    # Every weight is read once, except the embedding table (one row per token).
    weight_bytes = 2 * (m.num_parameters - m.vocab_size * m.hidden_size)
    floor = weight_bytes / 3.35e12
    assert floor <= seconds < 1.02 * floor


def test_large_prefill_is_compute_bound():
    be = RooflineCostModel(ModelConfig.from_preset("Llama-3.1-8B"), HARDWARE["H100-SXM"],
                           Efficiencies(gemm=1.0, attention=1.0, step_overhead_s=0.0))
    b = Batch()
    b.add("p", 0, 8192, [], needs_logits=True)
    parts = be.execute(b).breakdown
    peak = 989.4e12
    # Every layer's matmuls at full speed: 2 FLOPs per weight per token (the weights of the layers are the
    # parameters but the embedding table, the LM head and the norms).
    h, i, layers, nh, nkv, hd = 4096, 14336, 32, 32, 8, 128
    layer_weights = h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * i
    assert parts["linear"] == pytest.approx(2 * 8192 * layers * layer_weights / peak, rel=1e-12)
    # Causal attention of one 8192-token prompt: 4 * heads * head_dim FLOPs per query-key pair, 8192 * 8193 / 2 pairs.
    assert parts["attention"] == pytest.approx(layers * 4 * nh * hd * (8192 * 8193 // 2) / peak, rel=1e-12)
    # The LM head on the one logits row is memory-bound: its weights and the row, fp32 logits out.
    assert parts["lm_head"] == pytest.approx(((h * 128256 + h) * 2 + 128256 * 4) / (3.35e12 * 0.85), rel=1e-12)
    assert be.execute(b).seconds == pytest.approx(sum(parts.values()), rel=1e-12)
    assert 2 * 8192 * layers * layer_weights == pytest.approx(
        2 * 8192 * (ModelConfig.from_preset("Llama-3.1-8B").num_parameters - 2 * 128256 * 4096), rel=1e-4)  # norms aside


def test_attention_grows_with_each_requests_own_context():
    be = RooflineCostModel(ModelConfig.from_preset("Llama-3.1-8B"), HARDWARE["H200"])
    short = be.execute(decode_batch(64, 512)).breakdown["attention"]
    long = be.execute(decode_batch(64, 8192)).breakdown["attention"]
    assert long == pytest.approx(16 * short, rel=0.01)


def test_decode_run_equals_step_by_step():
    be = RooflineCostModel(ModelConfig.from_preset("Qwen3-8B"), HARDWARE["A100-80GB"])
    contexts = np.array([17, 300, 4096, 1])
    run = be.decode_run(contexts.tolist(), 5)[0]
    for j in range(5):
        b = Batch()
        for i, c in enumerate(contexts):
            b.add(str(i), int(c) + j - 1, 1, [], needs_logits=True, is_decode=True)
        assert be.execute(b).seconds == run[j]  # exactly: the engine's fast path relies on it


def test_bad_efficiency_is_refused():
    with pytest.raises(ServesimError):
        Efficiencies(gemm=0.0)


@pytest.mark.parametrize("preset", ["Llama-3.1-8B", "Mistral-7B", "Qwen3-8B", "Qwen3-0.6B"])
def test_a_config_json_costs_what_its_preset_costs(tmp_path, preset):
    import json

    from tests.test_model_config import LLAMA_31_8B, MISTRAL_7B_V03, QWEN3_06B, QWEN3_8B

    config = {"Llama-3.1-8B": LLAMA_31_8B, "Mistral-7B": MISTRAL_7B_V03, "Qwen3-8B": QWEN3_8B,
              "Qwen3-0.6B": QWEN3_06B}[preset]
    (tmp_path / "config.json").write_text(json.dumps(config))
    b = decode_batch(16, 3000)
    b.add("p", 100, 500, [], needs_logits=True)
    for tp in (1, 2):
        ours = RooflineCostModel(ModelConfig.from_preset(preset), HARDWARE["H200"], tp=tp).execute(b)
        read = RooflineCostModel(ModelConfig.from_hf(tmp_path), HARDWARE["H200"], tp=tp).execute(b)
        assert read.seconds == ours.seconds and read.breakdown == ours.breakdown


def test_tp2_halves_the_gemms_and_adds_two_allreduces_per_layer():
    from backends.costmodel.tensor_parallel import ALLREDUCE_LATENCY_S

    m = ModelConfig.from_preset("Llama-3.1-8B")
    b = Batch()
    b.add("p", 0, 8192, [], needs_logits=True)  # compute-bound GEMMs
    one = RooflineCostModel(m, HARDWARE["H100-SXM"]).execute(b).breakdown
    two = RooflineCostModel(m, HARDWARE["H100-SXM"], tp=2).execute(b).breakdown
    assert "allreduce" not in one
    assert two["linear"] == one["linear"] / 2
    ring = 2 * (2 - 1) / 2 * (8192 * 4096 * 2) / 450e9 + ALLREDUCE_LATENCY_S  # one all-reduce of the hidden states
    assert two["allreduce"] == 2 * 32 * ring
    assert two["kv_write"] == one["kv_write"] / 2  # 4 of the 8 KV heads per GPU


def test_fp8_weights_and_kv_cache_halve_their_bytes():
    m = ModelConfig.from_preset("Llama-3.1-8B")
    decodes = decode_batch(8, 4000)  # memory-bound: weight reads and K/V reads
    bf16 = RooflineCostModel(m, HARDWARE["H100-SXM"]).execute(decodes).breakdown
    fp8 = RooflineCostModel(m, HARDWARE["H100-SXM"], dtype="fp8").execute(decodes).breakdown
    assert fp8["linear"] == pytest.approx(bf16["linear"] / 2, rel=0.01)
    kv8 = RooflineCostModel(m, HARDWARE["H100-SXM"], kv_cache_dtype="fp8").execute(decodes).breakdown
    assert kv8["kv_write"] == bf16["kv_write"] / 2 and kv8["linear"] == bf16["linear"]
    per_token = 32 * 2 * 8 * 128 * 2 / (3.35e12 * 0.85)  # a decode's K/V read per context token, bf16
    assert bf16["attention"] - kv8["attention"] == pytest.approx(8 * 4000 * per_token / 2, rel=1e-9)
