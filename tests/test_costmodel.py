"""The roofline cost model: shapes, limits and the vectorised run path."""

import numpy as np
import pytest

from backends.hardware import HARDWARE
from backends.model_config import ModelConfig
from backends.roofline import Efficiencies, RooflineCostModel
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
    flops = 2 * 8192 * (ModelConfig.from_preset("Llama-3.1-8B").num_parameters - 2 * 128256 * 4096)
    assert be.execute(b).seconds > flops / 989.4e12


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
