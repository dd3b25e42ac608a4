"""Operator-table cost model on synthetic tables: interpolation, derivation, step sums, decode runs,
profiles and errors (no GPU data needed; see tests/optables_fixture.py for the closed forms)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.costmodel.optables.backend import OpTableBackend
from backends.costmodel.optables.derive import derive, gemm_shapes
from backends.costmodel.optables.interp import Curve, Grid, fill_rows_by_scaling, interp_loglog, interp_loglog_2d
from backends.costmodel.optables.model import OperatorModel, StepOverhead, padded_tokens
from backends.costmodel.optables.profile import build_profile, load_op_profile, save_op_profile
from backends.costmodel.optables.tables import load_tables
from sim.batch import Batch
from sim.errors import ServesimError
from tests.optables_fixture import (
    TINY,
    ar_ms,
    ctx_ms,
    gemm_ms,
    gen_ms,
    table_set,
    write_tables,
)

NVLINK = 450e9
grids = st.lists(st.floats(1.0, 1e6), min_size=2, max_size=8, unique=True).map(sorted)


@settings(max_examples=40, deadline=None)
@given(grids, st.data())
def test_interp_exact_on_grid_and_monotone_between(xs, data):
    xs = np.array(xs)
    ys = np.array(data.draw(st.lists(st.floats(1e-6, 1.0), min_size=len(xs), max_size=len(xs))))
    t, scaled = interp_loglog(xs, xs, ys)
    assert np.array_equal(t, ys) and not scaled.any()
    i = data.draw(st.integers(0, len(xs) - 2))
    between = np.geomspace(xs[i], xs[i + 1], 7)
    t, _ = interp_loglog(between, xs, ys)
    lo, hi = min(ys[i], ys[i + 1]), max(ys[i], ys[i + 1])
    assert np.all((t >= lo * (1 - 1e-12)) & (t <= hi * (1 + 1e-12)))
    steps = np.diff(t)
    assert np.all(steps >= -1e-15) or np.all(steps <= 1e-15)


@settings(max_examples=40, deadline=None)
@given(grids, grids, st.data())
def test_scalar_lookups_equal_the_array_lookups_bit_for_bit(xa, xb, data):
    """A single step is costed by the scalar lookups, a decode run by the array ones: they must agree
    exactly, on the grid, between its points and off it."""
    times = st.floats(1e-6, 1.0)
    ya = np.array(data.draw(st.lists(times, min_size=len(xa), max_size=len(xa))))
    grid = np.array([data.draw(st.lists(times, min_size=len(xb), max_size=len(xb))) for _ in xa])
    curve, surface = Curve(xa, ya, power=2.0), Grid(xa, xb, grid, power_b=2.0)
    points_a = xa + data.draw(st.lists(st.floats(0.1, 2e6), min_size=5, max_size=5))
    points_b = xb + data.draw(st.lists(st.floats(0.1, 2e6), min_size=5, max_size=5))
    many_t, many_off = curve.many(np.array(points_a))
    assert [curve.at(x) for x in points_a] == list(zip(many_t.tolist(), many_off.tolist()))
    a = np.array([data.draw(st.sampled_from(points_a)) for _ in range(20)])
    b = np.array([data.draw(st.sampled_from(points_b)) for _ in range(20)])
    many_t, many_off = surface.many(a, b)
    assert [surface.at(x, y) for x, y in zip(a.tolist(), b.tolist())] == list(zip(many_t.tolist(), many_off.tolist()))
    for a0 in points_a:  # one batch size along a decode run's lengths, bracketed once
        t, off = surface.along_b(a0, b)
        many_t, many_off = surface.many(a0, b)
        assert t.tolist() == many_t.tolist() and off.tolist() == many_off.tolist()
    if len(xb) > 1:  # sizes within one interval of the b axis (from its left point on): scalar brackets
        k = data.draw(st.integers(0, len(xb) - 2))
        inside = np.concatenate([[xb[k]], np.geomspace(xb[k], xb[k + 1], 9)[1:-1]])
        for a0 in points_a:
            t, off = surface.along_b(a0, inside)
            many_t, many_off = surface.many(a0, inside)
            assert t.tolist() == many_t.tolist() and off.tolist() == many_off.tolist()
        t, off = surface.along_b_pieces(points_a[:3], [3, 3, 2], inside)
        many_t, many_off = surface.many(np.repeat(points_a[:3], [3, 3, 2]), inside)
        assert t.tolist() == many_t.tolist() and off.tolist() == many_off.tolist()
    # Stretches of batch sizes along a decode run's lengths (requests leaving), each bracketed once.
    sizes = data.draw(st.lists(st.sampled_from(points_a), min_size=1, max_size=4))
    cuts = sorted(data.draw(st.lists(st.integers(1, 19), min_size=len(sizes) - 1, max_size=len(sizes) - 1, unique=True)))
    lengths = np.diff([0, *cuts, 20])
    t, off = surface.along_b_pieces(sizes, lengths, b)
    many_t, many_off = surface.many(np.repeat(sizes, lengths), b)
    assert t.tolist() == many_t.tolist() and off.tolist() == many_off.tolist()


def test_interp_worked_example_and_scaling_past_the_grid():
    xs, ys = np.array([1.0, 100.0]), np.array([1.0, 10.0])
    t, scaled = interp_loglog(np.array([10.0, 200.0, 0.5]), xs, ys, power=2.0)
    assert t[0] == pytest.approx(10 ** 0.5, rel=1e-12)  # half-way in log x: the geometric mean
    assert t[1] == 40.0 and t[2] == 1.0  # 10 x (200 / 100)^2; clamped below
    assert scaled.tolist() == [False, True, True]


def test_interp_2d_exact_on_grid_points():
    xa, xb = np.array([1.0, 2.0, 4.0]), np.array([10.0, 100.0])
    grid = np.array([[1.0, 3.0], [2.0, 5.0], [4.0, 9.0]])
    a, b = np.meshgrid(xa, xb, indexing="ij")
    t, scaled = interp_loglog_2d(a, b, xa, xb, grid)
    assert np.array_equal(t, grid) and not scaled.any()
    t, scaled = interp_loglog_2d(8.0, 100.0, xa, xb, grid, power_a=1.0)
    assert t == 18.0 and scaled  # twice the batch of the last row


def test_missing_cells_are_the_last_measured_row_scaled():
    grid = np.array([[1.0, 2.0], [2.0, np.nan], [np.nan, np.nan]])
    full, filled = fill_rows_by_scaling(np.array([1.0, 2.0, 4.0]), grid)
    assert full.tolist() == [[1.0, 2.0], [2.0, 4.0], [4.0, 8.0]]
    assert filled.tolist() == [[False, False], [False, True], [True, True]]


def test_derived_gemm_curves_are_the_tables_rows_on_the_grid():
    d = derive(table_set(), TINY)
    for op, (n, k) in gemm_shapes(TINY, 1).items():
        curve = d["gemm"][op]
        expected = [gemm_ms(m, n, k) * 1e-3 for m in curve["m"]]
        assert curve["seconds"] == expected  # exactly: on the grid nothing is recomputed


def test_off_grid_shapes_interpolate_between_neighbours_and_split_past_the_grid():
    model = dict(TINY, intermediate_size=181)  # gate-up n = 362: between 256 and 512
    d = derive(table_set(), model)
    m0 = d["gemm"]["gate_up"]["m"].index(1)
    t0, t1 = gemm_ms(1, 256, 128) * 1e-3, gemm_ms(1, 512, 128) * 1e-3
    w = math.log(362 / 256) / math.log(2)
    assert d["gemm"]["gate_up"]["seconds"][m0] == pytest.approx(t0 * (t1 / t0) ** w, rel=1e-12)
    big = derive(table_set(), dict(TINY, vocab_size=1536))  # LM head n = 1536: three GEMMs of 512
    assert big["gemm"]["lm_head"]["seconds"][m0] == pytest.approx(3 * gemm_ms(1, 512, 128) * 1e-3, rel=1e-12)
    assert any("lm_head n = 1536" in note for note in big["notes"])


def op_model(tp=1, dtype="bf16", overhead=0.0):
    derived = derive(table_set(), TINY, tp, dtype, nvlink_bytes_per_s=NVLINK)
    return OperatorModel(derived, TINY, tp, dtype, "bf16", StepOverhead(overhead, "test"))


def test_decode_step_is_the_sum_of_its_operators():
    ops = op_model(overhead=1e-3)
    parts = ops.step_parts([1, 1], [16, 16], 2)  # two decodes at KV length 16: table step 15
    m = 2  # padded_tokens(2) == 2
    gemms = sum(gemm_ms(m, n, k) for op, (n, k) in gemm_shapes(TINY, 1).items() if op != "lm_head")
    assert parts["gemm"] == pytest.approx(2 * gemms * 1e-3, rel=1e-12)
    assert parts["lm_head"] == pytest.approx(gemm_ms(2, 512, 128) * 1e-3, rel=1e-12)
    assert parts["attention"] == pytest.approx(2 * gen_ms(2, 15) * 1e-3, rel=1e-12)
    assert parts["allreduce"] == 0.0 and parts["overhead"] == 1e-3


def test_prefill_chunk_is_priced_at_the_equivalent_prompt_length():
    ops = op_model()
    # 200 new tokens on 50 cached: 200 * 50 + 200 * 201 / 2 = 30100 query-key pairs = isl 244.86...
    parts = ops.step_parts([200], [250], 1)
    isl = (math.sqrt(8 * 30100 + 1) - 1) / 2
    t0, t1 = ctx_ms(1, 64), ctx_ms(1, 256)
    w = math.log(isl / 64) / math.log(4)
    assert parts["attention"] == pytest.approx(2 * t0 * (t1 / t0) ** w * 1e-3, rel=1e-12)
    # Two new tokens on 250 cached cost at least a decode reading those 252 tokens' K/V.
    parts = ops.step_parts([2], [252], 1)
    assert parts["attention"] == 2 * ops.decode_attention(1, 252.0)


def test_tp2_halves_the_shapes_and_adds_the_tables_all_reduces():
    assert gemm_shapes(TINY, 2) == {"qkv": (128, 128), "o": (128, 64), "gate_up": (256, 128), "down": (128, 128),
                                    "lm_head": (256, 128)}
    ops = op_model(tp=2)
    parts = ops.step_parts([1] * 4, [16] * 4, 4)
    # Two per layer and one for the embedding, 4 tokens x 128 bf16 elements, in a CUDA graph; then
    # the logits' all-gather, eager, as an all-reduce of half of 4 x 512 elements (the tables
    # count bf16 elements, 2 bytes each).
    expected = (2 * 2 + 1) * ar_ms(4 * 128) + ar_ms(4 * 512 / 2, graph=False)
    assert parts["allreduce"] == pytest.approx(expected * 1e-3, rel=1e-12)
    big = ops.allreduce(np.array([64 * 2**20]), np.array([False]))  # past 8 MiB: the NVLink ring (no NCCL table)
    assert big[0] == pytest.approx(max(ar_ms(4 * 2**20, graph=False) * 1e-3, 64 * 2**20 / NVLINK + 5e-6), rel=1e-12)


def test_flashinfer_allreduce_fusion_prices_small_all_reduces_from_the_trtllm_table():
    """With vLLM's FlashInfer all-reduce fusion on up to a size, each hidden-state all-reduce up to
    it is TensorRT-LLM's kernel (its table) and takes the layer's two add+RMSNorms with it; past
    it, vLLM's custom kernel as before; the logits' all-gather is never fused. Worked by hand on
    the fixture: TRT-LLM's all-reduce here is half of vLLM's graph one."""
    from dataclasses import replace

    tables = table_set()
    ar = tables.custom_allreduce
    trt = ar[ar["kernel_source"] == "vLLM_custom_graph"].assign(
        kernel_source="TRTLLM", op_name="all_reduce", version="1.3.0rc20", seconds=lambda f: f["seconds"] / 2)
    fused_tables = replace(tables, fused_allreduce=trt)
    plain = OperatorModel(derive(tables, TINY, 2, nvlink_bytes_per_s=NVLINK), TINY, 2, "bf16", "bf16",
                          StepOverhead(0.0, "test"))
    limit = 8 * 128 * 2  # fused up to 8 tokens of 128 bf16 elements
    derived = derive(fused_tables, TINY, 2, nvlink_bytes_per_s=NVLINK, allreduce_fusion_max_bytes=limit)
    assert derived["allreduce"]["fused"]["max_bytes"] == limit
    fused = OperatorModel(derived, TINY, 2, "bf16", "bf16", StepOverhead(0.0, "test"))
    small, big = fused.step_parts([1] * 4, [16] * 4, 4), plain.step_parts([1] * 4, [16] * 4, 4)
    gather = ar_ms(4 * 512 / 2, graph=False)
    assert small["allreduce"] == pytest.approx(((2 * 2 + 1) * ar_ms(4 * 128) / 2 + gather) * 1e-3, rel=1e-12)
    assert big["allreduce"] == pytest.approx(((2 * 2 + 1) * ar_ms(4 * 128) + gather) * 1e-3, rel=1e-12)
    norms = 2 * (plain.kernel_floor_s + 4 * 4 * 128 * 2 / plain.bandwidth)  # one layer's two, 4 tokens
    assert small["elementwise"] == pytest.approx(big["elementwise"] - 2 * norms, rel=1e-12)
    # Past the limit (16 tokens), exactly the unfused step.
    assert fused.step_parts([1] * 16, [16] * 16, 16) == plain.step_parts([1] * 16, [16] * 16, 16)
    # No TRT-LLM table for the system: said, and priced as vLLM's kernel.
    notes = derive(tables, TINY, 2, nvlink_bytes_per_s=NVLINK, allreduce_fusion_max_bytes=limit)["notes"]
    assert any("no TensorRT-LLM all-reduce table" in n for n in notes)


def test_an_isolated_spike_of_a_gemm_table_is_read_as_its_neighbours():
    """A time more than 1.5x both its m-neighbours' (the first m: its one neighbour's) is noise, read
    as the larger neighbour; a step that holds for the next m is the kernel's and stays."""
    import pandas as pd

    from backends.costmodel.optables.derive import despiked

    def run(times):
        fixed, num = despiked(pd.Series(times, index=range(1, len(times) + 1), dtype=float))
        return fixed.tolist(), num

    assert run([13, 13, 32, 13, 13]) == ([13, 13, 13, 13, 13], 1)
    assert run([30, 10, 10]) == ([10, 10, 10], 1)
    assert run([10, 10, 20, 20, 40]) == ([10, 10, 20, 20, 40], 0)  # steps, not spikes
    assert run([10, 14, 10]) == ([10, 14, 10], 0)  # within 1.5x
    # In a derivation: the fixture's O projection (n = k = 128 at TP 1) with a spike at m = 4.
    tables = table_set()
    g = tables.gemm
    spike = (g["gemm_dtype"] == "bfloat16") & (g["n"] == 128) & (g["k"] == 128) & (g["m"] == 4)
    g = g.assign(seconds=np.where(spike, g["seconds"] * 3, g["seconds"]))
    from dataclasses import replace

    d = derive(replace(tables, gemm=g), TINY)
    o = d["gemm"]["o"]
    assert (o["n"], o["k"]) == (128, 128)
    i = o["m"].index(4)
    assert o["seconds"][i] == gemm_ms(8, 128, 128) * 1e-3  # the larger neighbour, m = 8
    assert any("o: 1 isolated spike" in n for n in d["notes"])
    assert derive(tables, TINY)["gemm"]["o"]["seconds"][i] == gemm_ms(4, 128, 128) * 1e-3


def test_fp8_uses_the_fp8_rows_except_the_lm_head():
    d = derive(table_set(), TINY, dtype="fp8")
    n, k = gemm_shapes(TINY, 1)["qkv"]
    assert d["gemm"]["qkv"]["seconds"] == [gemm_ms(m, n, k, "fp8") * 1e-3 for m in d["gemm"]["qkv"]["m"]]
    assert d["gemm"]["lm_head"]["dtype"] == "bf16"
    assert d["gemm"]["lm_head"]["seconds"][0] == gemm_ms(1, 512, 128) * 1e-3


def test_cuda_graph_padding():
    assert padded_tokens(np.array([1, 3, 9, 255, 257, 512, 513])).tolist() == [1, 4, 16, 256, 272, 512, 513]


def test_the_deployments_cuda_graph_sizes_decide_the_padding_and_the_all_reduce_kernels():
    """A server of --max-num-seqs 8 captures graphs up to 16 tokens (min(2 x 8, 512)): a step of 20
    tokens runs unpadded and its all-reduces are the eager kernels, where vLLM's defaults (up to 512)
    pad it to 24 inside a graph; a step of 13 pads to 16 either way. Worked on the fixture."""
    from sim.config import cuda_graph_sizes

    assert padded_tokens(np.array([3, 9, 13, 20]), np.array(cuda_graph_sizes(8))).tolist() == [4, 16, 16, 20]
    ops = op_model(tp=2)
    layers = TINY["num_hidden_layers"]

    def gemms(m):
        return layers * float(ops.gemms(np.array([float(m)]))[0])

    def allreduces(m, graph):  # two a layer and the embedding's, of m x hidden bf16 elements
        return (2 * layers + 1) * float(ops.allreduce(np.array([m * 128 * 2.0]), np.array([graph]))[0])

    gather = float(ops.allreduce(np.array([512 * 2 / 2]), np.array([False]))[0])  # the logits' (eager)
    before = ops.step_parts([20], [20], 1)
    assert before["gemm"] == pytest.approx(gemms(24), rel=1e-12)
    assert before["allreduce"] == pytest.approx(allreduces(24, True) + gather, rel=1e-12)
    ops.set_cuda_graph_sizes(cuda_graph_sizes(8))
    after = ops.step_parts([20], [20], 1)
    assert after["gemm"] == pytest.approx(gemms(20), rel=1e-12) and after["gemm"] < before["gemm"]
    assert after["allreduce"] == pytest.approx(allreduces(20, False) + gather, rel=1e-12)
    assert allreduces(20, False) > allreduces(24, True)  # the eager kernel's floor (the fixture's tables)
    assert ops.step_parts([1] * 13, [16] * 13, 13)["gemm"] == pytest.approx(gemms(16), rel=1e-12)
    with pytest.raises(ServesimError, match="CUDA-graph sizes must be whole numbers of tokens from 1"):
        ops.set_cuda_graph_sizes([0, 8])


def test_vllms_cuda_graph_sizes_by_max_num_seqs_gpu_and_version():
    """vllm/config/vllm.py, _set_cudagraph_sizes, as each wheel has it (0.12.0, 0.20.0 to 0.31.0, 0.33.0)."""
    from sim.config import CUDA_GRAPH_GRID, cuda_graph_sizes

    assert cuda_graph_sizes(1024, "H100-SXM") == tuple(x for x in CUDA_GRAPH_GRID if x <= 512)
    assert cuda_graph_sizes(8, "H200") == (1, 2, 4, 8, 16)
    assert cuda_graph_sizes(10, "H200", "0.12.0") == (1, 2, 4, 8, 16)  # 20 is off the grid: its largest below
    assert cuda_graph_sizes(10, "H200", "0.31.0") == (1, 2, 4, 8, 10, 16)  # from 0.31, max_num_seqs itself
    assert cuda_graph_sizes(1024, "B200", "0.27.0")[-1] == 512 and cuda_graph_sizes(1024, "B200", "0.28.0")[-1] == 1024
    assert cuda_graph_sizes(64, "H100", None, 100)[-2:] == (96, 100)  # not past the step's budget, and it captured
    assert cuda_graph_sizes(64, "H100", "0.20.0", 100)[-1] == 96  # the budget itself: captured from vLLM 0.21
    # A server given --max-cudagraph-capture-size: the grid up to it (its largest size at or below), whatever
    # max_num_seqs; still not past the budget.
    assert cuda_graph_sizes(4, "H100", None, 8192, 2048)[-3:] == (2016, 2032, 2048)
    assert cuda_graph_sizes(4, "H100", "0.18.0", 8192, 2050)[-1] == 2048
    assert cuda_graph_sizes(4, "H100", "0.18.0", 1024, 2048)[-1] == 1024


def decode_batch(contexts, step):
    b = Batch()
    for i, c in enumerate(contexts):
        b.add(str(i), c + step - 1, 1, [], needs_logits=True, is_decode=True)
    return b


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12), st.integers(2, 30), st.data(), st.sampled_from([1, 2]))
def test_decode_run_equals_step_by_step(contexts, num_steps, data, tp):
    be = OpTableBackend(op_model(tp=tp, overhead=2e-4))
    active = data.draw(st.lists(st.integers(1, num_steps + 5), min_size=len(contexts), max_size=len(contexts)))
    active[0] = num_steps + 5  # someone runs to the end
    seconds, parts = be.decode_run(contexts, num_steps, active)
    for j in range(num_steps):
        running = [c for c, a in zip(contexts, active) if a > j]
        result = be.execute(decode_batch(running, j))
        assert result.seconds == seconds[j]  # exactly: the engine's fast-forward relies on it
        for key, value in result.breakdown.items():
            assert value == (parts[key][j] if np.ndim(parts[key]) else parts[key])


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=6), st.data())
def test_decode_runs_reading_cached_stretches_equal_step_by_step(contexts, data):
    """Decode runs read their step times from stretches cached by earlier runs of the same batch
    size (backends/costmodel/optables/model.py, decode_run_values): runs that start inside a cached stretch, cross
    into the next one, or shrink as requests leave still give exactly the steps' own times."""
    be = OpTableBackend(op_model(overhead=2e-4))
    for _ in range(3):
        shift = data.draw(st.integers(0, 700))
        num_steps = data.draw(st.integers(2, 600))
        run = [c + shift for c in contexts]
        active = [num_steps] + data.draw(st.lists(st.integers(1, num_steps + 5), min_size=len(run) - 1,
                                                   max_size=len(run) - 1))
        seconds, parts = be.decode_run(run, num_steps, active)
        for j in sorted(set(data.draw(st.lists(st.integers(0, num_steps - 1), min_size=5, max_size=12)))):
            running = [c for c, a in zip(run, active) if a > j]
            result = be.execute(decode_batch(running, j))
            assert result.seconds == seconds[j]
            for key, value in result.breakdown.items():
                assert value == (parts[key][j] if np.ndim(parts[key]) else parts[key])


def test_profile_round_trip_gives_the_same_step_times(tmp_path):
    profile = build_profile(table_set(), "tiny", TINY, tp=2, nvlink_bytes_per_s=NVLINK)
    save_op_profile(profile, tmp_path / "p.json")
    loaded = load_op_profile(tmp_path / "p.json")
    a, b = OpTableBackend(profile.op_model()), OpTableBackend(loaded.op_model())
    q, c = np.array([[1, 1, 40], [1, 0, 0]]), np.array([[30, 900, 100], [7, 0, 0]])
    assert np.array_equal(a.step_seconds(q, c, np.array([3, 1])), b.step_seconds(q, c, np.array([3, 1])))
    assert loaded.source["system"] == "tiny_gpu" and loaded.source["framework_version"] == "0.24.0"


def test_tables_load_from_csv_and_errors_name_the_file(tmp_path):
    write_tables(tmp_path)
    tables = load_tables(tmp_path, "tiny_gpu")
    assert tables.device == "Synthetic GPU" and len(tables.gemm) == 2 * 8 * 16
    with pytest.raises(ServesimError, match=r"no operator tables for h100_sxm .*tiny_gpu \(vllm-0\.24\.0\)"):
        load_tables(tmp_path, "h100_sxm")
    path = tmp_path / "tiny_gpu__vllm-0.24.0__gemm_perf.csv"
    frame = __import__("pandas").read_csv(path).drop(columns=["m", "latency"])
    frame.to_csv(path, index=False)
    with pytest.raises(ServesimError, match=r"gemm_perf\.csv: the gemm table lacks column\(s\) m, latency"):
        load_tables(tmp_path, "tiny_gpu")


def test_unpriceable_configurations_are_refused():
    with pytest.raises(ServesimError, match="does not divide the model's 4 attention heads"):
        derive(table_set(), dict(TINY, intermediate_size=384), tp=3)
    # No all-reduce rows for 4 GPUs: not refused, priced as a ring over the link, and said.
    d = derive(table_set(), dict(TINY, num_attention_heads=8, num_key_value_heads=4), tp=4, nvlink_bytes_per_s=NVLINK)
    assert "graph" not in d["allreduce"] and any("no custom all-reduce rows for 4 GPUs" in n for n in d["notes"])
    with pytest.raises(ServesimError, match="needs the hardware's link"):
        derive(table_set(), TINY, tp=2)
    with pytest.raises(ServesimError, match="no context attention rows of kernel vllm_flash_attn_fa3 for 8 heads"):
        derive(table_set(), dict(TINY, num_attention_heads=8, num_key_value_heads=2))


def test_a_runs_max_num_seqs_gpu_and_vllm_version_give_its_cost_model_vllms_cuda_graph_sizes():
    """sim.app.plan.resolve gives the committed profile's model the deployment's capture sizes
    (`sim.config.cuda_graph_sizes`), with --max-num-seqs, the GPU and --vllm-version."""
    from dataclasses import replace

    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve

    options = ReplayOptions()  # Llama-3.1-8B on an H100: vLLM's defaults, graphs up to 512 tokens
    assert resolve(options).backend.ops.graph_sizes[-1] == 512
    small = replace(options, scheduler=replace(options.scheduler, max_num_seqs=8))
    assert resolve(small).backend.ops.graph_sizes.tolist() == [1, 2, 4, 8, 16]
    given = resolve(replace(small, max_cudagraph_capture_size=2048))  # vLLM's --max-cudagraph-capture-size
    assert given.backend.ops.graph_sizes[-1] == 2048 and given.cuda_graph_sizes[-1] == 2048
