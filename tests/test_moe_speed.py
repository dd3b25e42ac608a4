"""The MoE operator-table model's fast paths (backends/costmodel/optables/moe.py) give exactly the
values of the generic cost-model path they replace: `execute` (token-count parts kept, decodes'
sums from list methods, first chunks kept by length), `decode_run` (stretches of a run's steps
kept by requests, sum mod requests and stretch; runs whose requests leave read piece by piece),
`dense` (the roofline's token parts kept by token count, table curves looked up with scalar
lookups) and the derived curves' disk cache (a model restored from it is the model derived from
the tables)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.costmodel.frame import CostModel
from backends.costmodel.roofline import MoERooflineCostModel
from backends.costmodel.tensor_parallel import ACTIVATION_BYTES
from sim.batch import Batch

DEPLOYMENTS = {  # (model, hardware, system, moe_table_model's arguments); distribution: auto unless given
    "qwen30b": ("Qwen3-30B-A3B", "H100-SXM", "h100_sxm", {}),
    "qwen30b-balanced": ("Qwen3-30B-A3B", "H100-SXM", "h100_sxm", dict(distribution="balanced")),
    "qwen235b-tp4-dp2-ep": ("Qwen3-235B-A22B", "H200", "h200_sxm",
                            dict(tp=4, dtype="fp8", dp=2, enable_expert_parallel=True)),
    "deepseek-v3-tp8": ("DeepSeek-V3", "H200", "h200_sxm", dict(tp=8)),  # MLA from its module tables
}
DP = ("qwen235b-tp4-dp2-ep",)


@pytest.fixture(scope="module")
def from_tables():
    """Each deployment's model derived from the package's tables (skipped without them)."""
    pytest.importorskip("aiconfigurator_core")
    from backends.costmodel.optables.moe import moe_table_model
    from backends.costmodel.optables.systems import require_package
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    return {key: moe_table_model(resolve_model(model), resolve_hardware(hardware), system, require_package() / "data",
                                 **args)
            for key, (model, hardware, system, args) in DEPLOYMENTS.items()}


@pytest.fixture(scope="module")
def derived(from_tables):
    """Each deployment's derived curves."""
    return {key: priced.derived() for key, priced in from_tables.items()}


def fresh(derived, key: str):
    """A new model of the deployment (empty caches), restored from its derived curves."""
    from backends.costmodel.optables.moe import MoETableCostModel
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    model, hardware, _, args = DEPLOYMENTS[key]
    return MoETableCostModel(resolve_model(model), resolve_hardware(hardware), None, **args, derived=derived[key])


def batch_of(requests: list[tuple[int, int]]) -> Batch:
    b = Batch()
    for i, (q, computed) in enumerate(requests):
        b.add(str(i), computed, q, [], needs_logits=q > 0, is_decode=q == 1)
    return b


decodes = st.lists(st.tuples(st.just(1), st.integers(0, 200_000)), max_size=70)
chunks = st.lists(st.tuples(st.integers(0, 9000), st.sampled_from([0, 0, 1, 37, 4096, 150_000])), max_size=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(decodes, chunks), min_size=1, max_size=4), st.sampled_from(list(DEPLOYMENTS)),
       st.randoms(use_true_random=False))
def test_execute_is_the_generic_path(derived, steps, key, rnd):
    fast, generic = fresh(derived, key), fresh(derived, key)
    for step_decodes, step_chunks in steps * 2:  # twice: the second time from the kept values
        requests = step_decodes + step_chunks
        rnd.shuffle(requests)
        if not requests:
            continue
        a, b = fast.execute(batch_of(requests)), CostModel.execute(generic, batch_of(requests))
        assert a.seconds == b.seconds and type(a.seconds) is type(b.seconds)
        assert list(a.breakdown.items()) == list(b.breakdown.items())
        assert all(type(v) is float for v in a.breakdown.values())
    assert fast.extrapolated == generic.extrapolated


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 300_000), min_size=1, max_size=60), st.integers(1, 700)),
                min_size=1, max_size=4),
       st.sampled_from(list(DEPLOYMENTS)), st.data())
def test_decode_run_is_the_generic_path(derived, runs, key, data):
    fast, generic = fresh(derived, key), fresh(derived, key)
    for contexts, num_steps in runs * 2:  # twice: the second time from the kept stretches
        active = data.draw(st.one_of(
            st.sampled_from([None, [num_steps] * len(contexts), [num_steps + 5 + i for i in range(len(contexts))],
                             [max(1, num_steps - i) for i in range(len(contexts))]]),
            st.lists(st.integers(1, num_steps + 3), min_size=len(contexts), max_size=len(contexts))))  # some leave
        a_seconds, a_parts = fast.decode_run(contexts, num_steps, active)
        b_seconds, b_parts = CostModel.decode_run(generic, contexts, num_steps, active)
        assert np.array_equal(a_seconds, b_seconds) and a_seconds.dtype == b_seconds.dtype
        assert list(a_parts) == list(b_parts)
        for name, value in a_parts.items():
            assert np.array_equal(value, b_parts[name]), name
            assert np.shape(value) == np.shape(b_parts[name])
    assert fast.extrapolated == generic.extrapolated


def old_dense(priced, t: int, num_logits: int) -> tuple:
    """`dense` as it was written before the fast paths: the roofline's parts in one formula, then
    the tables' linear (an MLA model's: the roofline's less MLA's projections), MoE (DP > 1: every
    rank's tokens, dispatch and combine, `dp_moe_parts`) and all-reduce parts with the array
    lookups, then what MLA's module tables hold taken out (kv_write, RoPE). A step of at most the largest
    CUDA-graph size runs its layers at the next size up (`tr`) and its all-reduces as the graph kernel."""
    from backends.costmodel.optables.model import padded_tokens
    from backends.costmodel.roofline import combine_bytes, dispatch_bytes, dp_gathered_tokens

    given_t, graph = t, t <= priced.graph_sizes[-1]
    t = int(padded_tokens(t, priced.graph_sizes)) if t else 0  # the tokens the layers run on
    linear, router, moe, kv_write, _, _, allreduce = MoERooflineCostModel.dense(priced, t, num_logits)
    m, b, h = priced.model, ACTIVATION_BYTES, priced.model.hidden_size
    layers, mlp_width = m.num_hidden_layers, 0.0
    if m.num_dense_mlp_layers:
        mlp_width += m.num_dense_mlp_layers * 3 * (m.intermediate_size // priced.tp)
    if m.shared_expert_intermediate_size:
        mlp_width += m.num_moe_layers * 3 * (m.shared_expert_intermediate_size // priced.tp)
    mlp_width += m.num_moe_layers * 3 * (m.moe_intermediate_size // priced.moe_tp) * m.num_experts_per_tok / priced.ep
    q_k_width = (priced._heads + priced._kv_heads) * (m.qk_rope_head_dim if m.kv_lora_rank else m.head_dim)
    norms = 8 if m.sandwich_norms else 6
    elementwise = ((layers * t * b * (norms * h + 2 * q_k_width) + t * b * mlp_width) / priced._bytes_s
                   + (given_t * h * b + num_logits * h * 2 * b) / priced._bytes_s)
    lm_head = 0.0
    if num_logits:
        v = priced._vocab
        lm_head = max(2.0 * num_logits * h * v / (priced._flops_s * priced.eff.gemm),
                      ((h * v + num_logits * h) * b + num_logits * v * 4) / priced._bytes_s)
    tokens = max(t, 1)
    many = lambda curve, x: curve.many(x)[0]  # noqa: E731
    if priced._linear_curves is not None:
        linear = float(sum(n * many(c, tokens) for c, n in priced._linear_curves)) if t else 0.0
    else:
        assert priced._mla is not None
        linear = max(0.0, float(linear - layers * priced._attention_linear(t)))
    if priced.dp == 1:
        moe = float(m.num_moe_layers * many(priced._moe, tokens)) if t else 0.0
    elif t:
        n = dp_gathered_tokens([t] * priced.dp, priced.tp if priced.sequence_parallel_moe else 1)
        d, c = dispatch_bytes(n, h, m.num_experts_per_tok), combine_bytes(n, h)
        moe = (float(m.num_moe_layers * many(priced._moe, max(n, 1)))
               + m.num_moe_layers * float(many(priced._gather, np.maximum(d, 1.0)))
               + m.num_moe_layers * float(many(priced._scatter, np.maximum(c, 1.0))))
    else:
        moe = 0.0
    def one_allreduce(size, graph=graph):
        custom = priced._ar_custom if graph else priced._ar_custom_eager
        return many(custom, max(size, 1)) if size <= 8 * 2**20 else many(priced._ar_nccl, np.maximum(size, 1.0))

    small = priced._small
    if priced.tp > 1:
        # two a layer, and with the small kernels priced the vocab-parallel embedding's
        allreduce = float((2 * layers + (small is not None)) * one_allreduce(t * h * b)) if t else 0.0
    if priced._moe is not None and t:  # the routed experts' SiLU-and-mul: in the moe_perf kernel's time
        i = m.moe_intermediate_size // priced.moe_tp
        elementwise = (((layers * t * b * (norms * h + 2 * q_k_width) + t * b * mlp_width) / priced._bytes_s
                        - t * (m.num_moe_layers * b * 3 * i * m.num_experts_per_tok / priced.ep / priced._bytes_s))
                       + (given_t * h * b + num_logits * h * 2 * b) / priced._bytes_s)
    if priced._mla is not None:
        kv_write = 0.0
        elementwise = elementwise - t * priced._rope_s_per_token
    if small is None:
        return linear, router, moe, kv_write, elementwise, lm_head, allreduce
    # The small kernels (`_derive_small_kernels`): the roofline's bytes at the GEMM table's bandwidth and
    # each kernel's floor, counted here kernel by kernel; the router and the LM head from the bf16 rows.
    floor, bandwidth, routing_in_table = small
    scale = priced._bytes_s / bandwidth
    per_layer = (4 if m.sandwich_norms else 2) + (0 if priced._mla is not None else 1 + m.qk_norm)
    per_layer += priced.weights_dtype in ("fp8", "fp8-block", "nvfp4")
    kernels = layers * per_layer + m.num_dense_mlp_layers + m.num_moe_layers * (
        (not routing_in_table) + bool(m.shared_expert_intermediate_size))
    elementwise = elementwise * scale
    if t:
        elementwise = elementwise + (kernels + 2) * floor
        if priced._mla is None:
            kv_write = kv_write * scale + layers * floor
        router = m.num_moe_layers * float(many(priced._router_curve, t))
    else:
        router = 0.0
    if num_logits:
        v = priced._vocab
        elementwise = elementwise + 3 * (floor + num_logits * v * priced.tp * 4 / bandwidth)  # greedy (backends/sampler.py)
        lm_head = many(priced._lm_head_curve, num_logits)
        if priced.tp > 1:
            allreduce = allreduce + one_allreduce(num_logits * v * priced.tp * b / 2, graph=False)
    return linear, router, moe, kv_write, elementwise, lm_head, allreduce


@pytest.mark.parametrize("key", list(DEPLOYMENTS))
def test_dense_is_the_formula_it_was(derived, key):
    priced = fresh(derived, key)
    if priced.tp > 1:  # the curves this reference knows: custom all-reduce to 8 MiB, NCCL past it and for DP
        assert None not in (priced._ar_custom, priced._ar_nccl)
    if key in DP:
        assert None not in (priced._gather, priced._scatter)
    assert priced._moe is not None and (priced._mla is not None) == (key == "deepseek-v3-tp8")
    sizes = sorted({0, 1, 2, 3, 7, 8, 9, 100, 511, 512, 513, 2048, 8191, 16384, 16385, 20000}
                   | {int(x) for x in priced._moe.xs} | {int(x) + 1 for x in priced._moe.xs})
    for t in sizes:
        for num_logits in (0, 1, t, 7):
            assert priced.dense(t, num_logits) == old_dense(priced, t, num_logits), (t, num_logits)
    assert priced.extrapolated.get("moe", 0) >= 1  # past the moe curve's last point: still counted


def test_a_small_servers_cuda_graphs_pad_the_moe_step_and_run_the_rest_eagerly(derived):
    """At --max-num-seqs 8 vLLM captures graphs up to 16 tokens (sim.config.cuda_graph_sizes): a step of
    13 tokens runs at 16, one of 20 unpadded with the custom all-reduce's eager kernel, as the dense
    operator model prices them; the parts priced with the defaults are dropped."""
    from sim.config import cuda_graph_sizes

    priced = fresh(derived, "deepseek-v3-tp8")
    before = priced.dense(20, 1)
    assert before == old_dense(priced, 20, 1)  # inside vLLM's default graphs (up to 512): at 24, graph kernels
    priced.set_cuda_graph_sizes(cuda_graph_sizes(8))
    after = priced.dense(20, 1)
    assert after == old_dense(priced, 20, 1) and after != before
    assert after[-1] > before[-1]  # the all-reduces: the eager kernel's floor at 20 tokens
    assert priced.dense(13, 1) == old_dense(priced, 13, 1)
    assert priced.dense(13, 1)[:4] == priced.dense(16, 1)[:4]  # linear, router, MoE, KV write: run at 16


@pytest.mark.parametrize("key", list(DEPLOYMENTS))
def test_curve_lookups_within_the_grid_are_the_array_lookups(derived, key):
    priced = fresh(derived, key)
    curves = [c for c, _ in priced._linear_curves or []] + [priced._moe] + [
        c for c in (priced._ar_custom, priced._ar_nccl, priced._gather, priced._scatter) if c is not None]
    rng = np.random.default_rng(7)
    for curve in curves:
        lo, hi = curve.xs[0], curve.xs[-1]
        sizes = list(curve.xs) + list(np.unique(np.geomspace(lo, hi, 300).round())) + list(rng.uniform(lo, hi, 200))
        for x in sizes:
            assert priced._curve_at("test", curve, x) == curve.many(x)[0]
        assert priced._curve_at("test", curve, hi * 3) == curve.many(hi * 3)[0]  # past the grid: scaled, counted
    assert priced.extrapolated == {"test": len(curves)}


def test_the_derived_curves_cache_is_the_tables_model(derived, tmp_path, monkeypatch):
    from backends.costmodel.optables import moe as moe_module
    from backends.costmodel.optables import tables as tables_module
    from backends.costmodel.optables.systems import require_package
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    model, hardware, data = resolve_model("Qwen3-30B-A3B"), resolve_hardware("H100-SXM"), require_package() / "data"
    first = moe_module.moe_table_model(model, hardware, "h100_sxm", data, cache=tmp_path)
    (path,) = (tmp_path / "moe").iterdir()
    assert path == moe_module.derived_cache_path(tmp_path, model, "h100_sxm", data, None, **dict(
        tp=1, dtype="bf16", kv_cache_dtype="auto", enable_expert_parallel=False, dp=1, distribution="auto"))
    assert first.derived() == derived["qwen30b"]

    def no_tables(*args, **kwargs):
        raise AssertionError("a cached model reads no table")

    monkeypatch.setattr(tables_module, "load_layout", no_tables)
    again = moe_module.moe_table_model(model, hardware, "h100_sxm", data, cache=tmp_path)
    assert again.derived() == first.derived() and again.cost_model_summary() == first.cost_model_summary()
    batch = batch_of([(1, 900), (1, 5000), (700, 0), (1, 12)])
    assert again.execute(batch) == first.execute(batch)
    for a, b in zip(again.decode_run([900, 5000, 12], 300), first.decode_run([900, 5000, 12], 300)):
        assert json.dumps(a, default=lambda x: x.tolist()) == json.dumps(b, default=lambda x: x.tolist())
    # Another deployment is another file; a file that cannot be read is derived afresh (and rewritten).
    assert moe_module.derived_cache_path(tmp_path, model, "h100_sxm", data, None, tp=2) != path
    monkeypatch.undo()
    path.write_text("{not json")
    assert moe_module.moe_table_model(model, hardware, "h100_sxm", data, cache=tmp_path).derived() == first.derived()
    assert json.loads(path.read_text())["derived"] == first.derived()
    assert [p.name for p in (tmp_path / "moe").iterdir()] == [path.name]  # no temporary file left
    # A file of this format that is JSON but not the curves (a key gone, a curve of the wrong kind: damaged,
    # edited) is derived afresh too; it was an internal error (KeyError: 'small', TypeError).
    whole = json.loads(path.read_text())
    for damage in (lambda d: d.pop("small"), lambda d: d.update(router=5), lambda d: d.update(small=["a", 1, 0]),
                   lambda d: d["collectives"].clear(), lambda d: d.update(moe={"xs": [1.0], "ys": None, "power": 1})):
        broken = json.loads(json.dumps(whole))
        damage(broken["derived"])
        path.write_text(json.dumps(broken))
        assert moe_module.moe_table_model(model, hardware, "h100_sxm", data, cache=tmp_path).derived() == first.derived()
        assert json.loads(path.read_text()) == whole


def test_the_cache_files_name_changes_with_the_tables_files(tmp_path):
    import os

    from backends.costmodel.optables.moe import derived_cache_path
    from backends.model_config import resolve_model

    table = tmp_path / "data" / "gpu" / "moe" / "vllm" / "0.1.0" / "moe_perf.parquet"
    table.parent.mkdir(parents=True)
    table.write_bytes(b"rows")
    model = resolve_model("Qwen3-30B-A3B")
    name = derived_cache_path(tmp_path / "cache", model, "gpu", tmp_path / "data", None, tp=1)
    assert derived_cache_path(tmp_path / "cache", model, "gpu", tmp_path / "data", None, tp=1) == name
    os.utime(table, ns=(1, 1))  # a table file replaced (another time, the same size)
    touched = derived_cache_path(tmp_path / "cache", model, "gpu", tmp_path / "data", None, tp=1)
    table.write_bytes(b"more rows")
    assert len({name, touched, derived_cache_path(tmp_path / "cache", model, "gpu", tmp_path / "data", None, tp=1)}) == 3
    (tmp_path / "perf_data_reuse_manifest.yaml").write_text("groups: []\n")  # the reuse manifest beside data/
    assert derived_cache_path(tmp_path / "cache", model, "gpu", tmp_path / "data", None, tp=1) not in {name, touched}
    assert derived_cache_path(tmp_path / "cache", model, "gpu", tmp_path / "data", "0.2.0", tp=1) != name


# What `__init__` sets beyond the curves, which a model restored from the cache must have the same.
STATE = ("system", "distribution", "sources", "notes", "_mla_reason", "moe_tp", "ep", "dp", "moe_group",
         "sequence_parallel_moe", "_fast")


def same_state(a, b) -> None:
    for name in STATE:
        assert getattr(a, name) == getattr(b, name), name
    assert (a._mla is None) == (b._mla is None) and a.cost_model_summary() == b.cost_model_summary()
    if a._mla is not None:
        assert a._rope_s_per_token == b._rope_s_per_token and a._mla.source == b._mla.source
        assert a._attention[0, "generation"] is a._mla.generation and b._attention[0, "generation"] is b._mla.generation
    assert a.derived() == b.derived()


@pytest.mark.parametrize("key", list(DEPLOYMENTS))
def test_a_model_restored_from_its_derived_curves_is_the_tables_model(from_tables, derived, key):
    """MLA's module grids, the distribution as priced, DP's collectives: all come back."""
    restored = fresh(derived, key)
    same_state(restored, from_tables[key])
    assert restored._fast  # the fast paths are taken for every deployment here, MLA's included
    if key == "deepseek-v3-tp8":
        assert "MLA module tables" in restored.sources["attention"] and restored.distribution == "power_law_1.01"
    batch = batch_of([(1, 900), (1, 5000), (700, 0), (300, 2000), (1, 12)])
    assert CostModel.execute(restored, batch) == CostModel.execute(from_tables[key], batch)


def test_auto_distributions_balanced_fallback_comes_back_from_the_cache(from_tables):
    """Where the family's skewed rows are not measured, `auto` takes the balanced rows and says so in
    notes: a model restored from its derived curves keeps both (and the distribution as priced)."""
    from dataclasses import replace

    from backends.costmodel.optables.moe import MoETableCostModel
    from backends.costmodel.optables.systems import read_layout_table, require_package
    from backends.costmodel.optables.tables import load_layout
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    data = require_package() / "data"
    full = read_layout_table(data, "h100_sxm", "moe", "vllm", "moe_perf", None)
    only_balanced = replace(full, frame=full.frame[full.frame.distribution == "balanced"])
    model, hw = resolve_model("Qwen3-30B-A3B"), resolve_hardware("H100-SXM")
    priced = MoETableCostModel(model, hw, load_layout(data, "h100_sxm"), moe_table=only_balanced)
    assert priced.distribution == "balanced"
    assert priced.notes == ["moe: no power_law_1.2 rows at this shape; priced balanced",
                            "GEMM lm_head n = 151936 is past the table's largest (65536): priced as 3 GEMMs of "
                            "lm_head n = 50645.3"]
    restored = MoETableCostModel(model, hw, None, derived=priced.derived())
    same_state(restored, priced)
    assert restored.derived()["distribution"] == "balanced"
    assert restored.dense(64, 0) == from_tables["qwen30b-balanced"].dense(64, 0)


def test_the_cache_files_name_says_the_distribution_asked_and_resolved_and_the_mla_shapes(tmp_path):
    import os

    from backends.costmodel.optables.moe import derived_cache_path, family_distribution
    from backends.model_config import resolve_model

    data = tmp_path / "systems" / "data"  # the package's layout: model_configs/ beside systems/
    (data / "gpu").mkdir(parents=True)
    qwen, deepseek = resolve_model("Qwen3-30B-A3B"), resolve_model("DeepSeek-V3")
    names = {d: derived_cache_path(tmp_path / "cache", qwen, "gpu", data, None, distribution=d)
             for d in ("auto", "balanced", family_distribution(qwen), "power-law:1.01")}
    # auto falls back to balanced where the family's rows are not measured, an asked power-law:1.2 is
    # refused there: not one file
    assert family_distribution(qwen) == "power-law:1.2" and len(set(names.values())) == 4
    # An MLA model's key holds the checkpoints' config.json files (the MLA tables' measured shapes).
    configs = tmp_path / "model_configs"
    configs.mkdir()
    config = configs / "deepseek-ai--DeepSeek-V3_config.json"
    config.write_text("{}")

    def name(model):
        return derived_cache_path(tmp_path / "cache", model, "gpu", data, None)

    before, qwen_before = name(deepseek), name(qwen)
    config.write_text('{"kv_lora_rank": 512}')
    os.utime(config, ns=(1, 1))
    assert name(deepseek) != before and name(qwen) == qwen_before
