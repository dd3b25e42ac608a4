"""Calibration: NNLS, the fit of the cost model's coefficients, profiles and their refusal."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from backends.calibration import SETTLE_RUNS, calibrate, make_grid, measure, shape_batch
from backends.costmodel import make_cost_model
from backends.costmodel.fitted import FEATURES, CalibratedCostModel, Calibration, step_features
from backends.costmodel.roofline import Efficiencies, RooflineCostModel
from backends.hardware import HARDWARE
from backends.model_config import ModelConfig
from backends.profile import fit_calibration, load_profile, nnls, pad, predict, save_profile
from sim.app.cli import main
from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, replay
from sim.batch import Batch
from sim.config import CacheConfig
from sim.errors import ServesimError
from tests.helpers import make_trace


class StandInBackend:
    """A 'measured' backend for tests: the datasheet cost model with other efficiencies, plus
    seeded multiplicative noise. Has what calibration and comparison use of the real backend."""

    name = "stand-in"
    supports_fast_forward = False
    device = "cpu"
    device_name = "a stand-in"
    dtype = "float32"

    def __init__(self, model: str, noise: float = 0.02, num_blocks: int = 100_000, block_size: int = 16, seed: int = 0):
        self.costmodel = RooflineCostModel(ModelConfig.from_preset(model), HARDWARE["H100-SXM"], Efficiencies(0.45, 0.35, 0.6, 2e-3))
        self.noise, self.num_blocks, self.block_size = noise, num_blocks, block_size
        self.rng = np.random.default_rng(seed)
        self.num_executed = 0

    def execute(self, batch: Batch):
        assert all(max(t, default=0) < self.num_blocks for t in batch.block_tables)
        self.num_executed += 1
        result = self.costmodel.execute(batch)
        result.seconds *= 1.0 + self.noise * self.rng.standard_normal()
        return result


def grid_arrays(model: str, grid: str = "full"):
    shapes = make_grid(grid, ModelConfig.from_preset(model).max_position_embeddings)
    q = pad([s.query_lens for s in shapes])
    c = pad([s.context_lens for s in shapes])
    return q, c, np.array([sum(s.needs_logits) for s in shapes])


# NNLS.

def brute_force_nnls(a, b):
    """The best least-squares solution over every support whose unconstrained solution is >= 0."""
    best, best_x = np.inf, None
    n = a.shape[1]
    for k in range(n + 1):
        for support in itertools.combinations(range(n), k):
            x = np.zeros(n)
            if support:
                x[list(support)] = np.linalg.lstsq(a[:, list(support)], b, rcond=None)[0]
            if x.min() >= 0 and np.sum((a @ x - b) ** 2) < best:
                best, best_x = np.sum((a @ x - b) ** 2), x
    return best_x


@pytest.mark.parametrize("seed", range(20))
def test_nnls_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((12, 5))
    b = rng.standard_normal(12)
    x = nnls(a, b)
    assert x.min() >= 0
    np.testing.assert_allclose(x, brute_force_nnls(a, b), atol=1e-9)


# The fit.

# A GPU-like truth (flash attention: no dense or padded terms) and a CPU-like one (masked dense
# attention, decodes padded to the longest), each on the grid made for it.
TRUTHS = [
    ("Llama-3.1-8B", "full", Calibration((2e-15, 4e-15, 0, 3e-13, 0, 0, 2e-6, 1e-5, 5e-5, 1.5e-3), 150.0, 2)),
    ("tiny", "cpu", Calibration((2e-11, 0, 1e-11, 2e-10, 2e-10, 6e-10, 3e-6, 2e-5, 1e-4, 1e-3), 10.0, 4, 2.0**20)),
]


@pytest.mark.parametrize("model,grid,truth", TRUTHS)
def test_fit_recovers_known_coefficients_exactly_without_noise(model, grid, truth):
    m = ModelConfig.from_preset(model)
    q, c, n = grid_arrays(model, grid)
    exact = predict(m, truth, q, c, n)
    fit = fit_calibration(m, q, c, n, exact, truth.dtype_bytes)
    fitted = step_features(m, q, c, n, truth.dtype_bytes, fit.ridge_flops_per_byte, fit.cache_bytes) * fit.coefficients
    largest_share = (fitted / exact[:, None]).max(axis=0)  # of a term in any step's time
    for name, got, want, share in zip(FEATURES, fit.coefficients, truth.coefficients, largest_share):
        assert got == pytest.approx(want, rel=1e-2) if want else share < 1e-3, name
    assert fit.ridge_flops_per_byte == pytest.approx(truth.ridge_flops_per_byte, rel=1e-2)
    assert fit.cache_bytes == (None if truth.cache_bytes is None else pytest.approx(truth.cache_bytes, rel=1e-2))
    np.testing.assert_allclose(predict(m, fit, q, c, n), exact, rtol=1e-3)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("model,grid,truth", TRUTHS)
def test_fit_recovers_known_coefficients_with_noise(model, grid, truth, seed):
    m = ModelConfig.from_preset(model)
    q, c, n = grid_arrays(model, grid)
    exact = predict(m, truth, q, c, n)
    seconds = exact * (1 + 0.01 * np.random.default_rng(seed).standard_normal(len(q)))
    fit = fit_calibration(m, q, c, n, seconds, truth.dtype_bytes)
    # A term's share of its steps' time: a coefficient is identifiable as far as its term matters.
    share = np.median(step_features(m, q, c, n, truth.dtype_bytes, truth.ridge_flops_per_byte, truth.cache_bytes)
                      * truth.coefficients / exact[:, None], axis=0)
    fitted = step_features(m, q, c, n, truth.dtype_bytes, fit.ridge_flops_per_byte, fit.cache_bytes) * fit.coefficients
    fitted_share = np.median(fitted / fitted.sum(axis=1, keepdims=True), axis=0)
    for name, got, want, s, fs in zip(FEATURES, fit.coefficients, truth.coefficients, share, fitted_share):
        if want == 0:
            assert fs < 0.02, name
        elif s >= 0.1:  # smaller terms trade off with collinear ones (tokens and GEMM FLOPs on tiny)
            assert got == pytest.approx(want, rel=0.15), name
    if share[0] > 0.5:  # the ridge is identifiable where the GEMMs dominate
        assert fit.ridge_flops_per_byte == pytest.approx(truth.ridge_flops_per_byte, rel=0.05)
    assert np.median(np.abs(predict(m, fit, q, c, n) - exact) / exact) < 0.01


def test_fit_recovers_a_zero_coefficient():
    model = ModelConfig.from_preset("Llama-3.1-8B")
    q, c, n = grid_arrays("Llama-3.1-8B")
    truth = TRUTHS[0][2]
    fit = fit_calibration(model, q, c, n, predict(model, truth, q, c, n))
    assert fit.cache_bytes is None
    for name in ("attention_dense_flops", "kv_read_padded_bytes", "kv_read_padded_excess_bytes"):
        assert fit.coefficients[FEATURES.index(name)] == pytest.approx(0.0, abs=1e-22)


def test_fit_needs_enough_positive_points():
    model = ModelConfig.from_preset("tiny")
    q, c, n = grid_arrays("tiny", "small")
    with pytest.raises(ServesimError, match="at least 10"):
        fit_calibration(model, q[:5], c[:5], n[:5], np.ones(5))
    with pytest.raises(ServesimError, match="positive"):
        fit_calibration(model, q, c, n, np.zeros(len(q)))


# The calibrated cost model.

@pytest.mark.parametrize("model,grid,cal", TRUTHS)
def test_calibrated_step_is_the_same_alone_and_inside_a_decode_run(model, grid, cal):
    cm = CalibratedCostModel(ModelConfig.from_preset(model), cal)
    assert cm.supports_fast_forward
    contexts = np.array([5, 17, 300, 1000])
    run = cm.decode_run(contexts.tolist(), 6)[0]
    for j in range(6):
        batch = Batch()
        for i, ctx in enumerate(contexts.tolist()):
            batch.add(str(i), ctx + j - 1, 1, [0] * ((ctx + j) // 16 + 1), needs_logits=True, is_decode=True)
        result = cm.execute(batch)
        assert result.seconds == run[j]
        assert sum(result.breakdown.values()) == pytest.approx(result.seconds, rel=1e-12)
        q = np.ones((1, len(contexts)), dtype=np.int64)
        assert result.seconds == pytest.approx(float(predict(ModelConfig.from_preset(model), cal, q, q * 0 + contexts + j,
                                                             np.array([len(contexts)]))[0]), rel=1e-12)


def test_calibrated_step_is_the_fitted_sum():
    cal = Calibration((1e-12, 2e-12, 3e-12, 3e-11, 5e-11, 7e-11, 4e-6, 5e-5, 6e-5, 1e-3), 0.0, 4, cache_bytes=1000.0)
    cm = make_cost_model(ModelConfig.from_preset("tiny"), HARDWARE["H200"], cal)
    batch = Batch()
    batch.add("a", 0, 10, [0], needs_logits=True)  # a 10-token prompt
    batch.add("b", 7, 1, [1], needs_logits=True, is_decode=True)  # a decode at context 8
    batch.add("c", 2, 1, [2], needs_logits=True, is_decode=True)  # a decode at context 3
    layers, h, i, nh, nkv, hd, v = 2, 64, 128, 4, 2, 16, 512
    tiny = ModelConfig.from_preset("tiny")
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers, tiny.num_attention_heads,
            tiny.num_key_value_heads, tiny.head_dim, tiny.vocab_size) == (h, i, layers, nh, nkv, hd, v)
    gemm = sum(2 * 12 * k * n for k, n in [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * i), (i, h)])
    features = [layers * gemm + 2 * 3 * h * v,
                layers * 4 * nh * hd * ((10 * 10 - 10 * 9 / 2) + 8 + 3),  # causal
                layers * 4 * nh * hd * (10 * 10 + 8 + 3),  # dense q x c
                layers * 2 * nkv * hd * 4 * (10 + 8 + 3),  # K/V read
                layers * 2 * nkv * hd * 4 * (2 * 8),  # two decodes padded to the longest
                layers * (2 * nkv * hd * 4 * (2 * 8) - 1000),  # what of a layer's padded K/V is past the cache
                12, 3, 1, 1]
    assert cm.execute(batch).seconds == pytest.approx(float(np.dot(features, cal.coefficients)), rel=1e-12)


def test_calibration_rejects_bad_coefficients():
    with pytest.raises(ServesimError, match="coefficients"):
        Calibration((1.0, 2.0))
    with pytest.raises(ServesimError, match="finite and >= 0"):
        Calibration((1e-12, -1.0, 0, 0, 0, 0, 0, 0, 0, 0))
    with pytest.raises(ServesimError, match="cache_bytes"):
        Calibration((0.0,) * 10, cache_bytes=0.0)
    # 1e300 s a FLOP: finite, but a step's seconds overflowed to infinity (an internal error at the digest)
    with pytest.raises(ServesimError, match=r"at most 1000 on any device: linear_flops=1e\+300"):
        Calibration((1e300,) + (0.0,) * 9)


def test_a_profile_with_a_huge_coefficient_is_a_one_line_error(tmp_path, capsys):
    profile = json.loads((Path(__file__).parents[1] / "profiles" / "tiny-cpu.json").read_text())
    profile["calibration"]["coefficients"]["linear_flops"] = 1e300
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(profile))
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,30,4\n")
    assert main(["replay", str(trace), "--model", "tiny", "--profile", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "linear_flops=1e+300" in err and "internal error" not in err
    with pytest.raises(ServesimError, match="hardware preset or a calibrated profile"):
        make_cost_model(ModelConfig.from_preset("tiny"), None)


# Calibrate against a stand-in backend; profiles.

@pytest.fixture(scope="module")
def standin_profile(tmp_path_factory):
    backend = StandInBackend("tiny", num_blocks=512)
    profile, raw = calibrate(backend, "tiny", grid="small", warmup=1, repeats=3)
    path = tmp_path_factory.mktemp("profiles") / "tiny-standin.json"
    save_profile(profile, path)
    raw.to_csv(path.with_suffix(".csv"), index=False)
    return path, profile, raw, backend


def test_calibrate_measures_every_shape_with_warmup_and_repeats(standin_profile):
    _, profile, raw, backend = standin_profile
    shapes = make_grid("small", ModelConfig.from_preset("tiny").max_position_embeddings)
    assert profile.grid["num_shapes"] == len(shapes) and profile.grid["num_skipped"] == 0
    assert len(raw) == 3 * len(shapes) and backend.num_executed == (1 + (SETTLE_RUNS + 1) * 3) * len(shapes)
    assert sorted(set(raw["kind"])) == ["decode", "mixed", "prefill"]
    assert (raw.groupby("shape")["repeat"].apply(list) == [[0, 1, 2]] * len(shapes)).all()


def test_calibrate_fits_the_stand_in(standin_profile):
    _, profile, _, _ = standin_profile
    fit = profile.fit
    assert fit["num_points"] == 22 and fit["repeat_noise"]["median_iqr_over_median"] > 0
    assert fit["train"]["median_ape"] < 0.05 and fit["cross_validated"]["median_ape"] < 0.08
    assert profile.model == "tiny" and profile.dtype == "float32" and profile.calibration.dtype_bytes == 4
    assert profile.block_size == 16 and profile.device == "cpu" and profile.device_name
    assert "numpy" in profile.software and profile.created


def test_shape_batches_use_scattered_block_ids_below_num_blocks():
    rng = np.random.default_rng(0)
    for shape in make_grid("small", 8192):
        batch = shape_batch(shape, 16, 40, 512, rng)
        assert batch.num_scheduled_tokens == list(shape.query_lens)
        assert [c + q for c, q in zip(batch.num_computed_tokens, batch.num_scheduled_tokens)] == list(shape.context_lens)
        flat = batch.flatten(16)
        assert flat.slot_mapping.max() < 40 * 16 and len(flat.logits_indices) == sum(shape.needs_logits)


def test_shapes_that_do_not_fit_are_skipped():
    profile, raw = calibrate(StandInBackend("tiny", num_blocks=40), "tiny", grid="small", warmup=0, repeats=1)
    assert profile.grid["num_skipped"] > 0
    assert (raw["context_lens"].map(lambda s: sum(-(-int(c) // 16) for c in s.split())) <= 40).all()
    with pytest.raises(ServesimError, match="--num-blocks"):
        calibrate(StandInBackend("tiny", num_blocks=2), "tiny", grid="small", warmup=0, repeats=1)


def test_measure_rejects_zero_repeats():
    with pytest.raises(ServesimError, match="--repeats"):
        measure(StandInBackend("tiny"), make_grid("small", 8192), 512, warmup=0, repeats=0)


def test_profile_round_trip(standin_profile):
    path, profile, _, _ = standin_profile
    loaded = load_profile(path, "tiny")
    assert loaded == profile
    assert json.loads(path.read_text())["calibration"]["coefficients"].keys() == set(FEATURES)


def test_profile_of_another_model_is_refused(standin_profile, tmp_path, capsys):
    path, _, _, _ = standin_profile
    with pytest.raises(ServesimError, match="calibrated for model 'tiny'.*not for 'Llama-3.1-8B'"):
        load_profile(path, "Llama-3.1-8B")
    with pytest.raises(ServesimError, match="calibrated for model 'tiny'"):
        resolve(ReplayOptions(model="Qwen3-0.6B", profile=str(path)))  # options resolve once, in plan.resolve
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n")
    assert main(["replay", str(trace), "--model", "Llama-3.1-8B", "--profile", str(path), "--quiet",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and "calibrated for model 'tiny'" in err and "\n" == err[-1]
    assert not (tmp_path / "run").exists()


def test_a_profile_is_refused_for_a_folder_of_its_name_but_another_shape(standin_profile, tmp_path):
    """Found by a review: the check compared names, and a config folder named tiny (a model's name is
    its folder's) holding a larger model took the tiny preset's profile; one of the preset's shapes is
    taken."""
    import dataclasses

    from backends.model_config import ModelConfig

    path, _, _, _ = standin_profile
    tiny = ModelConfig.from_preset("tiny")
    assert load_profile(path, dataclasses.replace(tiny, qk_norm=False)).model == "tiny"  # the shapes agree
    bigger = dataclasses.replace(tiny, hidden_size=256, num_attention_heads=8, head_dim=32)
    with pytest.raises(ServesimError, match=r"calibrated for the preset 'tiny', and this model 'tiny' differs from it: "
                                            r"hidden_size 256 \(the profile's 64\), num_attention_heads 8"):
        load_profile(path, bigger)


@pytest.mark.parametrize("text,message", [
    ("{", "invalid JSON"),
    ('{"format": "other"}', "not a servesim profile"),
    ('{"format": "servesim-profile", "version": 99}', "version 99"),
    ('{"format": "servesim-profile", "version": 1, "model": "tiny"}', "no field 'calibration'"),
    # An infinity where a whole number belongs was an internal error (OverflowError).
    (Path(__file__).parents[1].joinpath("profiles", "tiny-cpu.json").read_text().replace(
        '"block_size": 16', '"block_size": 1e999'), "wrong type .cannot convert float infinity to integer"),
])
def test_bad_profile_files_are_refused(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ServesimError, match=message):
        load_profile(path)
    with pytest.raises(ServesimError, match="no such profile"):
        load_profile(tmp_path / "missing.json")


def test_replay_with_a_profile_predicts_with_it(standin_profile, tmp_path):
    path, profile, _, _ = standin_profile
    trace = make_trace([(0.0, 100, 3)])
    options = ReplayOptions(model="tiny", hardware="H200", profile=str(path), cache=CacheConfig(num_blocks=64))
    result = replay(trace, resolve(options))
    # The first step is the whole 100-token prompt: one request, 100 tokens, one logits row.
    first = predict(ModelConfig.from_preset("tiny"), profile.calibration, np.array([[100]]), np.array([[100]]), np.array([1]))
    assert result.steps.seconds[0] == pytest.approx(float(first[0]), rel=1e-12)
    # The profile alone sets the step time: any --hardware gives the same run.
    other = replay(trace, resolve(ReplayOptions(model="tiny", hardware="A100-80GB", profile=str(path), cache=options.cache)))
    assert np.array_equal(other.steps.seconds, result.steps.seconds)
    with pytest.raises(ServesimError, match="does not apply"):
        ReplayOptions(model="tiny", backend="real", profile=str(path))


def test_the_committed_tiny_cpu_profile_loads_and_predicts(tmp_path):
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "profiles" / "tiny-cpu.json"
    profile = load_profile(path, "tiny")
    assert profile.device == "cpu" and profile.dtype == "float32" and profile.block_size == 16
    assert profile.grid["name"] == "cpu" and profile.fit["num_points"] == profile.grid["num_shapes"]
    assert 0 < profile.fit["cross_validated"]["median_ape"] < 1
    raw = path.with_suffix(".csv")
    assert raw.is_file()
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,300,20\n0.01,900,5\n")
    assert main(["replay", str(trace), "--model", "tiny", "--profile", str(path), "--num-blocks", "256",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] == 2 and summary["options"]["profile"] == str(path)


def test_thread_clock_leaves_out_time_the_thread_does_not_run():
    import time as time_module

    from backends import StepResult
    from backends.real.timing import ThreadClock, with_clock

    class Sleepy(StandInBackend):
        def execute(self, batch):
            time_module.sleep(0.05)  # descheduled, as when other processes hold the core
            return StepResult(0.05, {"forward": 0.04, "sample": 0.01})

    backend = Sleepy("tiny")
    clocked = with_clock(backend, "thread")
    assert with_clock(backend, "wall") is backend
    assert isinstance(clocked, ThreadClock) and clocked.num_blocks == backend.num_blocks
    result = clocked.execute(Batch())
    assert 0 <= result.seconds < 0.01
    assert sum(result.breakdown.values()) == pytest.approx(result.seconds)
    assert result.breakdown["forward"] == pytest.approx(4 * result.breakdown["sample"])
    backend.device = "cuda"
    with pytest.raises(ServesimError, match="--clock wall on a GPU"):
        with_clock(backend, "thread")


def test_each_measured_run_follows_its_replay_predecessor_fastest_shape_first():
    from backends.calibration import Shape, predecessor

    mixed = Shape("mixed", (1, 1, 32), (10, 20, 40), (True, True, False), (True, True, False))
    assert predecessor(mixed) == Shape("decode", (1, 1), (10, 20), (True, True), (True, True))
    assert predecessor(Shape("prefill", (64,), (64,), (True,), (False,))) == Shape("decode", (1,), (64,), (True,), (True,))
    decode = Shape("decode", (1, 1), (5, 9), (True, True), (True, True))
    assert predecessor(decode) is decode

    class Recording(StandInBackend):
        def __init__(self):
            super().__init__("tiny", noise=0.0, num_blocks=512)
            self.shapes = []  # (query lens, context lens) of every executed batch, in order

        def execute(self, batch):
            self.shapes.append((tuple(batch.num_scheduled_tokens),
                                tuple(c + q for c, q in zip(batch.num_computed_tokens, batch.num_scheduled_tokens))))
            return super().execute(batch)

    shapes = make_grid("small", 8192)
    backend = Recording()
    raw = measure(backend, shapes, 512, warmup=1, repeats=2)
    runs = backend.shapes[len(shapes):]  # after one warm-up run each
    assert len(runs) == 2 * (SETTLE_RUNS + 1) * len(shapes)
    measured_runs = [run for i, run in enumerate(runs) if i % (SETTLE_RUNS + 1) >= SETTLE_RUNS - 1]
    seconds = raw.groupby("shape")["seconds"].first()
    for round_runs in (measured_runs[:2 * len(shapes)], measured_runs[2 * len(shapes):]):
        order = [next(i for i, s in enumerate(shapes) if (s.query_lens, s.context_lens) == run)
                 for run in round_runs[1::2]]
        assert sorted(order) == list(range(len(shapes)))
        assert list(seconds[order]) == sorted(seconds[order])  # fastest first
        for before, index in zip(round_runs[0::2], order):
            p = predecessor(shapes[index])
            assert before == (p.query_lens, p.context_lens)
