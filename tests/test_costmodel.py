"""The roofline cost model: shapes, limits and the vectorised run path."""

import numpy as np
import pytest

from backends.presets import MODELS, derive_num_blocks, get_hardware, get_model, num_parameters
from backends.roofline import Efficiencies, RooflineCostModel
from sim.batch import Batch
from sim.errors import ServesimError


def decode_batch(n, context):
    b = Batch()
    for i in range(n):
        b.add(str(i), context - 1, 1, [], needs_logits=True, is_decode=True)
    return b


def test_parameter_counts_match_the_published_sizes():
    assert num_parameters(MODELS["Llama-3.1-8B"]) == pytest.approx(8.03e9, rel=1e-3)
    assert num_parameters(MODELS["Qwen3-8B"]) == pytest.approx(8.19e9, rel=1e-3)
    assert num_parameters(MODELS["Qwen3-0.6B"]) == pytest.approx(0.596e9, rel=1e-3)
    assert num_parameters(MODELS["Mistral-7B"]) == pytest.approx(7.25e9, rel=1e-3)


def test_small_decode_is_memory_bound_on_weights():
    be = RooflineCostModel(get_model("Llama-3.1-8B"), get_hardware("H100-SXM"), Efficiencies(memory=1.0, step_overhead_s=0.0))
    seconds = be.execute(decode_batch(1, 16)).seconds
    m = MODELS["Llama-3.1-8B"]
    # Every weight is read once, except the embedding table (one row per token).
    weight_bytes = 2 * (num_parameters(m) - m["vocab_size"] * m["hidden_size"])
    floor = weight_bytes / 3.35e12
    assert floor <= seconds < 1.02 * floor


def test_large_prefill_is_compute_bound():
    be = RooflineCostModel(get_model("Llama-3.1-8B"), get_hardware("H100-SXM"), Efficiencies(gemm=1.0, attention=1.0, step_overhead_s=0.0))
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
        2 * 8192 * (num_parameters(MODELS["Llama-3.1-8B"]) - 2 * 128256 * 4096), rel=1e-4)  # norms aside


def test_attention_grows_with_each_requests_own_context():
    be = RooflineCostModel(get_model("Llama-3.1-8B"), get_hardware("H200"))
    short = be.execute(decode_batch(64, 512)).breakdown["attention"]
    long = be.execute(decode_batch(64, 8192)).breakdown["attention"]
    assert long == pytest.approx(16 * short, rel=0.01)


def test_decode_run_equals_step_by_step():
    be = RooflineCostModel(get_model("Qwen3-8B"), get_hardware("A100-80GB"))
    contexts = np.array([17, 300, 4096, 1])
    run = be.decode_run(contexts.tolist(), 5)[0]
    for j in range(5):
        b = Batch()
        for i, c in enumerate(contexts):
            b.add(str(i), int(c) + j - 1, 1, [], needs_logits=True, is_decode=True)
        assert be.execute(b).seconds == run[j]  # exactly: the engine's fast path relies on it


def test_derived_blocks_and_too_big_models():
    n = derive_num_blocks(get_model("Llama-3.1-8B"), get_hardware("H100-SXM"), 16, 0.9, 2048, 256)
    assert 25_000 < n < 32_000  # about 460k tokens of KV cache, as vLLM reports on an H100
    with pytest.raises(ServesimError, match="do not fit"):
        derive_num_blocks(get_model("Llama-3.1-70B"), get_hardware("H100-SXM"), 16, 0.9, 2048, 256)


def test_bad_efficiency_is_refused():
    with pytest.raises(ServesimError):
        Efficiencies(gemm=0.0)
