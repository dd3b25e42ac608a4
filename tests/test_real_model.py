"""The real backend's forward pass against a dense per-request reference (seed 001's check)."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.real import RealBackend  # noqa: E402
from backends.real import reference as ref  # noqa: E402
from backends.real.reference import dense_logits  # noqa: E402
from sim.batch import Batch  # noqa: E402
from tests.helpers import run, tokens  # noqa: E402


@pytest.fixture(scope="module")
def backend():
    return RealBackend("tiny", device="cpu", block_size=4, num_blocks=128, seed=0)


def test_seed001_one_mixed_step_matches_each_request_alone(backend):
    # A: a full prefill of 7 tokens, B: 5 tokens, C: 22 tokens in two chunks (10, then 12).
    a, b, c = tokens(1, 7), tokens(2, 5), tokens(3, 22)
    perm = np.random.default_rng(0).permutation(np.arange(3, 128)).tolist()  # scattered physical blocks
    tables = [perm[0:3], perm[3:5], perm[5:12]]
    step1 = run(backend, [(a, 0, 7, tables[0], True), (b, 0, 5, tables[1], True), (c, 0, 10, tables[2], False)])
    assert step1.shape == (2, 512)
    next_a, next_b = step1.argmax(-1).tolist()
    for got, ids in ((step1[0], a), (step1[1], b)):
        assert (got - dense_logits(backend.model, ids)[-1]).abs().max().item() <= 1e-3
    # Step 2: A decodes, B decodes, C's second chunk (positions 10..21), one forward pass.
    a2, b2 = a + [next_a], b + [next_b]
    step2 = run(backend, [(a2, 7, 1, tables[0], True), (b2, 5, 1, tables[1], True), (c, 10, 12, tables[2], True)])
    for got, ids in ((step2[0], a2), (step2[1], b2), (step2[2], c)):
        err = (got - dense_logits(backend.model, ids)[-1]).abs().max().item()
        assert err <= 1e-3, err


def test_execute_returns_greedy_tokens_in_batch_order(backend):
    a, c = tokens(4, 9), tokens(5, 20)
    b = Batch()
    b.add("a", 0, 9, [40, 41, 42], True, token_source=a)
    b.add("c", 0, 8, [50, 51, 52, 53, 54], False, token_source=c)  # a partial chunk: no token
    result = backend.execute(b)
    assert result.sampled_token_ids.tolist() == [int(dense_logits(backend.model, a)[-1].argmax())]
    assert set(result.breakdown) == {"prepare", "forward", "sample"}
    assert result.seconds == pytest.approx(sum(result.breakdown.values()))
    assert backend.name == "real" and backend.supports_fast_forward is False
    assert backend.num_blocks == 128 and backend.block_size == 4 and backend.device.type == "cpu"
    assert backend.kv_caches[0][0].shape == (128, 4, 2, 16)


@st.composite
def mixed_batches(draw):
    """Requests with a cached part (computed by earlier steps, maybe in several chunks) and a part
    computed in one mixed step; physical blocks drawn at random."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_reqs = draw(st.integers(1, 4))
    lengths = [draw(st.integers(1, 40)) for _ in range(num_reqs)]
    cached = [draw(st.integers(0, n - 1)) for n in lengths]
    chunk = draw(st.integers(1, 16))
    need = sum(-(-n // block_size) for n in lengths)
    blocks = draw(st.permutations(range(64)))[:need] if need <= 64 else None
    return block_size, lengths, cached, chunk, blocks


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mixed_batches(), seed=st.integers(0, 2**16))
def test_any_mixed_batch_matches_dense_reference(case, seed):
    block_size, lengths, cached, chunk, blocks = case
    if blocks is None:
        return
    be = _backend(block_size)
    seqs = [tokens(seed + i, n) for i, n in enumerate(lengths)]
    tables, start = [], 0
    for n in lengths:
        k = -(-n // block_size)
        tables.append(blocks[start:start + k])
        start += k
    # Earlier steps: the cached parts, chunk tokens at a time, all requests together.
    done = [0] * len(seqs)
    while any(d < c for d, c in zip(done, cached)):
        items = []
        for ids, table, d, c in zip(seqs, tables, done, cached):
            if d < c:
                items.append((ids, d, min(chunk, c - d), table, False))
        # A step whose requests need no logits still runs the layers (and fills the cache).
        b = Batch()
        for i, (ids, d, s, table, _) in enumerate(items):
            b.add(str(i), d, s, table, False, token_source=ids)
        flat = b.flatten(block_size)
        be.runner.logits(flat)
        done = [min(c, d + chunk) if d < c else d for d, c in zip(done, cached)]
    # The mixed step: every request computes the rest of its tokens and gets logits.
    logits = run(be, [(ids, c, n - c, table, True) for ids, c, n, table in zip(seqs, cached, lengths, tables)])
    for row, ids in enumerate(seqs):
        err = (logits[row] - dense_logits(be.model, ids)[-1]).abs().max().item()
        assert err <= 1e-3, (row, err)


_BACKENDS: dict = {}


def _backend(block_size):
    if block_size not in _BACKENDS:
        _BACKENDS[block_size] = RealBackend("tiny", device="cpu", block_size=block_size, num_blocks=64, seed=1)
    return _BACKENDS[block_size]


def test_llama3_rope_scaling_stretches_only_long_wavelengths():
    from backends.model_config import ModelConfig
    from backends.presets import MODELS

    scaling = MODELS["Llama-3.1-8B"]["rope_scaling"]
    assert ModelConfig.from_preset("Llama-3.1-8B").rope_scaling == scaling
    assert ModelConfig.from_preset("Qwen3-8B").rope_scaling is None
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    scaled = ref.llama3_scaled_inv_freq(plain, scaling)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], plain[short])  # high frequencies kept
    assert torch.allclose(scaled[long], plain[long] / 8)  # low frequencies stretched 8x
    assert (scaled <= plain).all() and (scaled >= plain / 8).all()
    assert (scaled[1:] <= scaled[:-1]).all()  # frequencies still fall with the dimension
    # The blend is continuous at both ends of the medium band.
    edge = ref.llama3_scaled_inv_freq(torch.tensor([2 * math.pi / 2048, 2 * math.pi / 8192], dtype=torch.float64),
                                      scaling)
    assert torch.allclose(edge, torch.tensor([2 * math.pi / 2048, 2 * math.pi / 8192 / 8], dtype=torch.float64))


@pytest.mark.parametrize("change, message", [
    ({"factor": None}, "rope_scaling factor = None, expected a number above 0"),
    ({"low_freq_factor": "1"}, "rope_scaling low_freq_factor = '1', expected a number above 0"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings = 0"),
    ({"high_freq_factor": 1.0}, "high_freq_factor (1.0) must be above low_freq_factor (1.0)"),
])
def test_a_llama3_rope_scaling_missing_a_number_is_refused_by_the_real_backend(tmp_path, capsys, change, message):
    """Before, a config.json's llama3 rope_scaling without its factors (or with text, or low = high) was an
    internal error (KeyError, TypeError) or a division by zero when the real backend built its RoPE table."""
    import json

    from backends.presets import MODELS
    from tests.helpers import one_error_line, sim

    tiny = {k: v for k, v in MODELS["tiny"].items() if k not in ("rope_theta", "rope_scaling", "qk_norm")}
    scaling = {**MODELS["Llama-3.1-8B"]["rope_scaling"], **change}
    config = {**tiny, "model_type": "llama", "rope_theta": 10000.0, "rope_scaling": scaling}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,8,2\n")
    assert sim("replay", trace, "--backend", "real", "--model", tmp_path / "m", "--out", tmp_path / "run",
               "--quiet") == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "run").exists()
