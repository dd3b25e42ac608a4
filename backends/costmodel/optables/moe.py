"""A mixture-of-experts model's step priced from the tables package's measured tables, operator by operator.

`MoETableCostModel` is the MoE roofline (backends/costmodel/roofline.py, `MoERooflineCostModel`) with
each operator a measured table prices replaced by the table's time; an operator no table prices
stays the roofline's, and `sources` says which, per operator (summary.json's `cost_model`):

- moe: the fused-MoE kernel from `moe_perf` (vLLM's tables) at the model's exact shape (hidden,
  moe_intermediate_size, top-k, experts), MoE TP and EP, expert dtype and token distribution
  (`--moe-distribution`: by default, `auto`, the family's skewed routing, `family_distribution`;
  or balanced, or power-law:ALPHA for the skewed ones measured),
  log-log in tokens between grid points, exact on them. The kernel is the one vLLM 0.33 picks on
  Hopper (vllm/model_executor/layers/fused_moe/oracle/fp8.py, `_get_priority_backends`: block fp8
  runs Triton under TP and FlashInfer CUTLASS under EP), else the one the tables measured most.
  A shape the table does not hold is the roofline's (never interpolated across models).
  Tokens: the MoE layer of a DP > 1 deployment sees every DP rank's tokens (the dispatch gathers
  them): a DP group's lockstep step prices it once from every rank's tokens (`dp_moe_parts`,
  backends/costmodel/roofline.py; sim/data_parallel.py), and a step priced alone (`execute`)
  takes every rank as loaded as this one.
- linear: attention's QKV and O projections, the dense MLPs and the shared experts from the GEMM
  table (`gemm_curve`, the operator-table model's own) in the checkpoint's dtype. An MLA model's
  linear stays the roofline's; where its MLA module tables price attention (below), its
  projections are in them and linear is the roofline's dense MLPs and shared experts alone. (Not
  from the GEMM table: its block-fp8 rows on H200 take 57 to 90 us at every m up to 64, e.g. n 512,
  k 7168, where the per-tensor fp8 kernel takes 10 us and the whole MLA module, three block-fp8
  GEMMs among its kernels, takes about 150 us under a CUDA graph: a floor of their collection that
  vLLM's CUDA-graph decode does not pay.)
- attention: full-attention GQA layers from the context and generation attention tables (as the
  dense operator model prices them); sliding-window layers from the rows measured at the layer's
  window (`window_size`), at the window's KV length; MLA layers from the MLA module tables
  (backends/costmodel/optables/mla.py: the whole layer, its projections, norms, RoPE and KV-cache
  write included, so that linear, kv_write and elementwise leave them out: nothing counted twice),
  else the roofline's.
- allreduce: two per layer under TP, vLLM's custom all-reduce table up to 8 MiB, NCCL's table past it.
- dispatch and combine (DP > 1): vLLM's default all2all backend, `allgather_reducescatter`
  (vllm/config/parallel.py, `all2all_backend`; vllm/distributed/device_communicators/all2all.py,
  `AgRsAll2AllManager`): `dispatch` all-gathers each member's hidden states (bf16), top-k
  weights (fp32) and top-k ids (int32) over the MoE group (the DP group, or the tp x dp EP group
  under sequence-parallel MoE); `combine` reduce-scatters the MoE output (bf16, every rank's
  tokens) back (`MoERooflineCostModel.dp_moe_parts` says how). Both from the NCCL table
  (`all_gather`, `reduce_scatter` among the group's GPUs, message_size in 2-byte elements as
  collect_nccl.py stores them), the roofline's ring where the table has no rows.

Interpolation: exact on grid points, log-log between them; tokens past a curve's last point are
scaled linearly (counted in `extrapolated`, per operator, and said in summary.json) and sizes
below the first are clamped to it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from backends.costmodel.frame import StepAggregates
from backends.costmodel.optables.interp import Curve, Grid, fill_rows_by_scaling
from backends.costmodel.optables.mla import MLAModule, MLATables, mla_module
from backends.costmodel.roofline import MoERooflineCostModel, ring_seconds
from sim.errors import ServesimError

# servesim's expert dtypes (ModelConfig.linear_dtypes) -> moe_perf's moe_dtype
MOE_DTYPES = {"bf16": "bfloat16", "fp8": "fp8", "fp8-block": "fp8_block", "mxfp4": "w4a16_mxfp4", "int4": "int4_wo"}
# servesim's weight dtypes -> gemm_perf's gemm_dtype
LINEAR_DTYPES = {"bf16": "bfloat16", "fp8": "fp8", "fp8-block": "fp8_block"}
DISTRIBUTION = re.compile(r"^power-law:(?P<alpha>\d+(\.\d+)?)$")
ACTIVATION_BYTES = 2  # bf16 hidden states
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 2**20  # vLLM's custom all-reduce takes messages up to 8 MiB (derive.py)


def check_moe_distribution(flag: str, value: str) -> None:
    if value not in ("auto", "balanced") and DISTRIBUTION.match(value) is None:
        raise ServesimError(f"{flag} {value!r}: give auto, balanced or power-law:ALPHA (e.g. power-law:1.2)")


def family_distribution(model) -> str:
    """`--moe-distribution auto`: how a MoE family's router spreads a step's tokens over its experts.
    A trained router is skewed (some experts take many more tokens than others), so a step's
    fused-MoE kernel waits on its busiest experts when many tokens run (slower than balanced) and
    reads fewer experts' weights when few do (a decode step: faster than balanced). The moe_perf
    tables measure that skew as a power law of exponent ALPHA; AIConfigurator, whose tables these
    are, prices every MoE model with one (its `workload_distribution` default, "power_law"): alpha
    1.01 for the DeepSeek family (aiconfigurator_core/sdk/models/deepseek.py, `_power_law_alpha`;
    servesim's MLA models: DeepSeek-V3/R1, Kimi K2) and 1.2 for the others (sdk/models/moe.py:
    Qwen3-MoE, Mixtral, gpt-oss, MiniMax)."""
    return "power-law:1.01" if model.kv_lora_rank else "power-law:1.2"


def table_distribution(value: str) -> str:
    """--moe-distribution's value (not auto) as moe_perf names it: balanced, power_law_1.2."""
    check_moe_distribution("--moe-distribution", value)
    m = DISTRIBUTION.match(value)
    return "balanced" if m is None else f"power_law_{m.group('alpha')}"


@dataclass(frozen=True)
class MoEShape:
    """What one moe_perf lookup is keyed by (the table's own columns)."""

    hidden_size: int
    inter_size: int
    topk: int
    num_experts: int
    moe_tp_size: int
    moe_ep_size: int
    moe_dtype: str
    distribution: str


def moe_kernel(kernels: list[str], moe_dtype: str, ep: int) -> str:
    """The fused-MoE kernel vLLM runs on Hopper, among those measured (see the module doc)."""
    if moe_dtype == "fp8_block":
        want = "flashinfer_cutlass" if ep > 1 else "triton"
        for k in kernels:
            if want in k:
                return k
    return kernels[0]


def moe_curve(frame, shape: MoEShape) -> tuple[str, np.ndarray, np.ndarray] | str:
    """(kernel, tokens, seconds) of the fused MoE layer at `shape`; a reason string where the
    table does not hold that shape (the caller falls back to the roofline and says why)."""
    f = frame
    rows = f[(f["hidden_size"] == shape.hidden_size) & (f["inter_size"] == shape.inter_size)
             & (f["topk"] == shape.topk) & (f["num_experts"] == shape.num_experts)]
    if rows.empty:
        return (f"no moe_perf rows for hidden {shape.hidden_size}, inter {shape.inter_size}, top-{shape.topk} of "
                f"{shape.num_experts} experts")
    rows = rows[rows["moe_dtype"] == shape.moe_dtype]
    if rows.empty:
        return f"no moe_perf rows in {shape.moe_dtype} for this model's shape"
    rows = rows[(rows["moe_tp_size"] == shape.moe_tp_size) & (rows["moe_ep_size"] == shape.moe_ep_size)]
    if rows.empty:
        return f"no moe_perf rows at MoE TP {shape.moe_tp_size}, EP {shape.moe_ep_size}"
    rows = rows[rows["distribution"] == shape.distribution]
    if rows.empty:
        return f"no moe_perf rows with the {shape.distribution} token distribution"
    counts = rows["kernel_source"].value_counts()
    kernel = moe_kernel([str(k) for k in counts.index], shape.moe_dtype, shape.moe_ep_size)
    curve = rows[rows["kernel_source"] == kernel].groupby("num_tokens")["seconds"].mean().sort_index()
    return kernel, curve.index.to_numpy(dtype=np.float64), curve.to_numpy(dtype=np.float64)


def nccl_curve(frame, op: str, num_gpus: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(message bytes, seconds) of one NCCL collective among num_gpus GPUs in half precision
    (message_size counts 2-byte elements), or None where the table has no such rows."""
    if frame is None:
        return None
    rows = frame[(frame["op_name"] == op) & (frame["num_gpus"] == num_gpus) & (frame["nccl_dtype"] == "half")]
    if rows.empty:
        return None
    curve = rows.groupby("message_size")["seconds"].mean().sort_index()
    return curve.index.to_numpy(dtype=np.float64) * ACTIVATION_BYTES, curve.to_numpy(dtype=np.float64)


class MoETableCostModel(MoERooflineCostModel):
    """The MoE roofline with each operator a table measures priced from the table (module doc)."""

    name = "costmodel"

    def __init__(self, model, hardware, tables, tp: int = 1, dtype: str = "bf16", kv_cache_dtype: str = "auto",
                 enable_expert_parallel: bool = False, dp: int = 1, distribution: str = "auto",
                 moe_table=None, mla_tables: MLATables | str | None = None):
        """`tables`: a TableSet of the system (load_layout: gemm, attention, custom all-reduce, NCCL);
        `moe_table`: the system's moe_perf LayoutTable (read_layout_table), or None; `mla_tables`: its
        MLA module tables (mla.read_mla_tables), None where it has none, or why they cannot be read."""
        self._tables_ready = False
        super().__init__(model, hardware, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                         enable_expert_parallel=enable_expert_parallel, dp=dp)
        self.system = tables.system
        auto = distribution == "auto"
        if auto:
            distribution = family_distribution(model)
        self.distribution = table_distribution(distribution)
        self.sources: dict[str, str] = {}
        self.notes: list[str] = []
        self.extrapolated: dict[str, int] = {}
        m = model
        self._moe = self._linear = self._attention = None
        # moe
        if not m.num_experts:
            pass
        elif moe_table is None:
            self.sources["moe"] = f"roofline: {tables.system} has no moe_perf table for vLLM"
        else:
            shape = MoEShape(m.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok, m.num_experts,
                             self.moe_tp, self.ep, MOE_DTYPES.get(self.experts_dtype, self.experts_dtype),
                             self.distribution)
            found = moe_curve(moe_table.frame, shape)
            if isinstance(found, str) and auto and not isinstance(
                    balanced := moe_curve(moe_table.frame, replace(shape, distribution="balanced")), str):
                # The family's skew is not measured at this shape, the balanced one is: take it, and say so.
                self.notes.append(f"moe: no {shape.distribution} rows at this shape; priced balanced")
                found, shape = balanced, replace(shape, distribution="balanced")
                self.distribution = "balanced"
            if isinstance(found, str):
                self.sources["moe"] = f"roofline: {found} ({Path(moe_table.path).name} vLLM {moe_table.version})"
            else:
                kernel, xs, ys = found
                self._moe = Curve(xs, ys)
                self.sources["moe"] = (f"moe_perf vLLM {moe_table.version} ({moe_table.how}): {kernel}, "
                                       f"{shape.moe_dtype}, MoE TP {shape.moe_tp_size} EP {shape.moe_ep_size}, "
                                       f"{shape.distribution}; tokens {int(xs[0])}..{int(xs[-1])}")
        if m.num_experts and not auto and not self.distribution == "balanced" and self._moe is None:
            raise ServesimError(f"--moe-distribution {distribution} is a distribution the moe_perf tables measured; "
                                f"{self.sources['moe']}")
        self._mla: MLAModule | None = None
        self._mla_reason = ""
        if m.kv_lora_rank:
            self._derive_mla(tables.system, mla_tables, kv_cache_dtype)
        self._linear_curves = self._derive_linear(tables)
        self._derive_attention(tables, kv_cache_dtype)
        self._derive_collectives(tables)
        self._by_tokens: dict[int, tuple] = {}  # dense()'s table parts by token count
        self._tables_ready = True
        self._dense_cache.clear()

    # ---- derivation

    def _derive_mla(self, system: str, mla_tables: MLATables | str | None, kv_cache_dtype: str) -> None:
        """The MLA module tables' grids for this model (mla.py), or the reason they cannot price it."""
        m = self.model
        if mla_tables is None:
            self._mla_reason = f"{system} has no MLA module tables for vLLM"
        elif isinstance(mla_tables, str):
            self._mla_reason = mla_tables
        else:
            found = mla_module(mla_tables, m, self._heads, self.weights_dtype, kv_cache_dtype)
            if isinstance(found, str):
                self._mla_reason = f"{found} ({mla_tables.describe})"
            else:
                self._mla = found
                q_k_width = (self._heads + self._kv_heads) * m.qk_rope_head_dim  # the roofline's RoPE (elementwise)
                self._rope_s_per_token = m.num_hidden_layers * ACTIVATION_BYTES * 2 * q_k_width / self._bytes_s

    def _gemm_rows(self, tables, dtype: str):
        from backends.costmodel.optables.derive import kernels_by_preference

        name = LINEAR_DTYPES.get(dtype)
        g = tables.gemm
        rows = g[g["gemm_dtype"] == name] if name is not None else g.iloc[:0]
        kernels = kernels_by_preference(tables, "gemm", rows) if not rows.empty else []
        if not kernels:
            return None, None
        return kernels[0], rows[rows["kernel_source"] == kernels[0]]

    def _derive_linear(self, tables) -> list[tuple[Curve, int]] | None:
        """(curve, layers) of every linear GEMM the roofline's `linear` counts, or None (roofline)."""
        from backends.costmodel.optables.derive import gemm_curve

        m, tp, h = self.model, self.tp, self.model.hidden_size
        if m.kv_lora_rank:
            if self._mla is None:
                self.sources["linear"] = f"roofline: MLA's projections (no MLA module table prices them: {self._mla_reason})"
            else:  # see the module doc: the gemm table's block-fp8 rows were not measured as vLLM runs them
                self.sources["linear"] = ("roofline: the dense MLPs and shared experts, as before (MLA's projections "
                                          "in attention's MLA module tables)")
            return None
        kernel, rows = self._gemm_rows(tables, self.weights_dtype)
        if rows is None:
            self.sources["linear"] = f"roofline: no {self.weights_dtype} GEMM rows on {tables.system}"
            return None
        nh, nkv, hd = self._heads, self._kv_heads, m.head_dim
        shapes = [((nh + 2 * nkv) * hd, h, m.num_hidden_layers, "qkv"), (h, nh * hd, m.num_hidden_layers, "o")]
        if m.num_dense_mlp_layers:
            i = m.intermediate_size // tp
            shapes += [(2 * i, h, m.num_dense_mlp_layers, "dense gate_up"), (h, i, m.num_dense_mlp_layers, "dense down")]
        if m.num_experts and m.shared_expert_intermediate_size:
            s = m.shared_expert_intermediate_size // tp
            shapes += [(2 * s, h, m.num_moe_layers, "shared gate_up"), (h, s, m.num_moe_layers, "shared down")]
        curves = []
        for n, k, layers, what in shapes:
            ms, seconds = gemm_curve(rows, n, k, what, self.notes)
            curves.append((Curve(ms.astype(np.float64), seconds), layers))
        self.sources["linear"] = f"gemm_perf {tables.versions.get('gemm', ('?',))[0]}: {kernel}"
        return curves

    def _derive_attention(self, tables, kv_cache_dtype: str) -> None:
        from backends.costmodel.optables.derive import _attention_grid, attention_kernel

        m = self.model
        if m.kv_lora_rank:
            if self._mla is None:
                self.sources["attention"] = f"roofline: MLA ({self._mla_reason})"
                return
            self._attention = {(0, "generation"): self._mla.generation}  # the decodes' lookups, as GQA's
            self.sources["attention"] = self._mla.source
            self.sources["kv_write"] = "in attention (the MLA module tables write the latents to the KV cache)"
            self.sources["elementwise"] = "roofline, less MLA's RoPE (in attention's MLA module tables)"
            return
        kv = "fp8" if kv_cache_dtype == "fp8" else "bf16"
        grids = {}
        for window in sorted({0} | ({m.sliding_window} if self._sliding_layers else set())):
            for kind, length, offset in (("context", "isl", 0), ("generation", "step", 1)):
                frame = getattr(tables, f"{kind}_attention")
                try:
                    kernel = attention_kernel(tables, kind, kv, m.head_dim)
                except ServesimError as e:
                    self.sources["attention"] = f"roofline: {e}"
                    return
                rows = frame[(frame["kernel_source"] == kernel) & (frame["window_size"] == window)
                             & (frame["kv_cache_dtype"] == {"bf16": "bfloat16", "fp8": "fp8"}[kv])
                             & (frame["head_dim"] == m.head_dim) & (frame["num_heads"] == self._heads)
                             & (frame["num_key_value_heads"] == self._kv_heads)]
                if rows.empty:
                    self.sources["attention"] = (f"roofline: no {kind} attention rows for {self._heads} heads, "
                                                 f"{self._kv_heads} KV heads, head_dim {m.head_dim}, window {window}")
                    return
                batch, lengths, grid = _attention_grid(rows, length, offset)
                full, _ = fill_rows_by_scaling(np.asarray(batch, dtype=np.float64), grid)
                power = 2.0 if kind == "context" else 1.0
                grids[window, kind] = Grid(batch, lengths, full, power_b=power)
        self._attention = grids
        windows = f"; sliding layers at window {m.sliding_window}" if self._sliding_layers else ""
        self.sources["attention"] = (f"attention tables {tables.versions.get('generation_attention', ('?',))[0]}"
                                     f"{windows}")

    def _derive_collectives(self, tables) -> None:
        self._ar_custom = self._ar_nccl = self._gather = self._scatter = None
        if self.tp > 1:
            a = tables.custom_allreduce
            rows = None if a is None else a[(a["num_gpus"] == self.tp) & a["kernel_source"].str.contains("graph")]
            if rows is not None and not rows.empty:
                c = rows.groupby("message_size")["seconds"].mean().sort_index()
                self._ar_custom = Curve(c.index.to_numpy(dtype=np.float64) * ACTIVATION_BYTES, c.to_numpy())
            self._ar_nccl = nccl_curve(tables.nccl, "all_reduce", self.tp)
            if self._ar_custom is None and self._ar_nccl is None:
                self.sources["allreduce"] = f"roofline: no all-reduce table for {self.tp} GPUs on {tables.system}"
            else:
                self.sources["allreduce"] = ("custom all-reduce table (CUDA graph) up to 8 MiB" if self._ar_custom
                                             else "no custom all-reduce table") + (
                    ", NCCL table past it" if self._ar_nccl is not None else ", the roofline's ring past it")
        if self.dp > 1 and self.model.num_experts:
            g = self.moe_group
            group = f"among {g} GPUs ({'the EP group, sequence-parallel MoE' if self.sequence_parallel_moe else 'the DP group'})"
            self._gather = nccl_curve(tables.nccl, "all_gather", g)
            self._scatter = nccl_curve(tables.nccl, "reduce_scatter", g)
            how = "vLLM's allgather_reducescatter (AgRsAll2AllManager)"
            self.sources["dispatch"] = (f"NCCL all_gather table {group}, {how}" if self._gather is not None
                                        else f"roofline: a ring over the link {group} (no NCCL all_gather table), {how}")
            self.sources["combine"] = (f"NCCL reduce_scatter table {group}, {how}" if self._scatter is not None
                                       else f"roofline: a ring over the link {group} (no NCCL reduce_scatter table), "
                                       f"{how}")

    # ---- pricing

    def _count(self, op: str, scaled) -> None:
        n = int(np.count_nonzero(scaled))
        if n:
            self.extrapolated[op] = self.extrapolated.get(op, 0) + n

    def _curve_at(self, op: str, curve: Curve, x):
        t, scaled = curve.many(x)
        self._count(op, scaled)
        return t

    def _pair(self, op: str, pair, size):
        xs, ys = pair
        t, scaled = Curve(xs, ys).many(np.maximum(size, 1.0))
        self._count(op, scaled)
        return t

    def _ring(self, size, n: int):
        return ring_seconds(self.hardware, size, n)

    def _dense_moe(self, t):
        if getattr(self, "_tables_ready", False):
            return 0.0  # `_token_parts` prices it
        return super()._dense_moe(t)

    def moe_seconds(self, t):
        if self._moe is None or not getattr(self, "_tables_ready", False):
            return super().moe_seconds(t)
        return self.model.num_moe_layers * self._curve_at("moe", self._moe, t)

    def dispatch_seconds(self, num_bytes: float) -> float:
        if self._gather is None:
            return super().dispatch_seconds(num_bytes)
        return float(self._pair("dispatch", self._gather, num_bytes))

    def combine_seconds(self, num_bytes: float) -> float:
        if self._scatter is None:
            return super().combine_seconds(num_bytes)
        return float(self._pair("combine", self._scatter, num_bytes))

    def dense(self, t: int, num_logits: int) -> tuple:
        linear, router, moe, kv_write, elementwise, lm_head, allreduce = super().dense(t, num_logits)
        if not getattr(self, "_tables_ready", False):
            return linear, router, moe, kv_write, elementwise, lm_head, allreduce
        by_tokens = self._by_tokens.get(t)
        if by_tokens is None:
            by_tokens = self._by_tokens[t] = self._token_parts(t, linear, moe, allreduce)
        linear, moe, allreduce = by_tokens
        if self._mla is not None:  # the module tables hold MLA's KV-cache write and RoPE (mla.py)
            kv_write = 0.0
            elementwise = elementwise - t * self._rope_s_per_token
        return linear, router, moe, kv_write, elementwise, lm_head, allreduce

    def _token_parts(self, t: int, linear, moe, allreduce) -> tuple:
        """(linear, moe, allreduce) of t tokens from the tables (the roofline's where none)."""
        m, h = self.model, self.model.hidden_size
        tokens = max(t, 1)
        if self._linear_curves is not None:
            linear = sum(layers * self._curve_at("linear", c, tokens) for c, layers in self._linear_curves)
            linear = float(linear) if t else 0.0
        elif self._mla is not None:  # the roofline's dense MLPs and shared experts (MLA's projections: attention)
            linear = max(0.0, float(linear - m.num_hidden_layers * self._attention_linear(t)))
        if m.num_experts and self.dp == 1:
            moe = float(self.moe_seconds(tokens)) if t else 0.0
        elif m.num_experts:  # every DP rank as loaded as this one: the kernel, dispatch and combine
            moe = self.lockstep_moe_seconds(t)
        if self.tp > 1 and (self._ar_custom is not None or self._ar_nccl is not None):
            size = t * h * ACTIVATION_BYTES
            if self._ar_custom is not None and size <= CUSTOM_ALLREDUCE_MAX_BYTES:
                one = self._curve_at("allreduce", self._ar_custom, max(size, 1))
            elif self._ar_nccl is not None:
                one = self._pair("allreduce", self._ar_nccl, size)
            else:
                one = self._ring(size, self.tp)
            allreduce = float(2 * m.num_hidden_layers * one) if t else 0.0
        return linear, moe, allreduce

    def _window_attention(self, window: int, q: int, c: int) -> float:
        """One layer's attention of one request from the tables at `window` (0: full attention)."""
        kv = c if window == 0 else min(c, window + q - 1)
        if q == 1:
            t, scaled = self._attention[window, "generation"].at(1, kv)
            self._count("attention", [scaled])
            return t
        pairs = q * (kv - q) + q * (q + 1) / 2.0 if kv >= q else q * (q + 1) / 2.0
        isl = (math.sqrt(8.0 * pairs + 1.0) - 1.0) / 2.0
        t, scaled = self._attention[window, "context"].at(1, isl)
        read, scaled_read = self._attention[window, "generation"].at(1, kv)
        self._count("attention", [scaled, scaled_read])
        return max(t, read)

    def request_seconds(self, q: int, c: int) -> float:
        if self._attention is None or not getattr(self, "_tables_ready", False):
            return super().request_seconds(q, c)
        if self._mla is not None:
            return self._chunks_attention([(q, c)])
        total = 0.0
        if self._full_layers:
            total += self._full_layers * self._window_attention(0, q, c)
        if self._sliding_layers:
            total += self._sliding_layers * self._window_attention(self.model.sliding_window, q, c)
        return total

    def _chunks_attention(self, chunks: list[tuple[int, int]]) -> float:
        """Every layer's attention of a step's prefill chunks: MLA's as one batch from the module
        tables (mla.MLAModule.chunks), GQA's each on its own (request_seconds)."""
        if self._mla is None:
            return sum(self.request_seconds(q, c) for q, c in chunks)
        if not chunks:
            return 0
        t, off = self._mla.chunks(chunks)
        if off:
            self.extrapolated["attention"] = self.extrapolated.get("attention", 0) + off
        return self.model.num_hidden_layers * t

    def _decodes_attention(self, window: int, kv_lens: list[int]) -> float:
        """One layer's attention of a step's decodes as one batch at their mean KV length (the
        generation table's batch x KV length grid, as the dense operator model prices them)."""
        if not kv_lens:
            return 0.0
        t, scaled = self._attention[window, "generation"].at(len(kv_lens), sum(kv_lens) / len(kv_lens))
        self._count("attention", [scaled])
        return t

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        if self._attention is None:
            return super().parts(agg, chunks, dense)
        if not self.decodes_from_sums:  # sliding layers: `chunks` are every request's (q, c)
            parts = super().parts(agg, [], dense)
            decodes = [c for q, c in chunks if q == 1]
            w = self.model.sliding_window
            attention = sum(self.request_seconds(q, c) for q, c in chunks if q != 1)
            if self._full_layers:
                attention += self._full_layers * self._decodes_attention(0, decodes)
            if self._sliding_layers:
                attention += self._sliding_layers * self._decodes_attention(w, [min(c, w) for c in decodes])
            parts["attention"] = attention
            return parts
        # Full-attention GQA: the decodes as one batch at their mean KV length (the generation
        # table's batch x KV length grid, as the dense operator model prices them), each prefill
        # chunk on its own.
        parts = super().parts(agg, [], dense)
        if np.ndim(agg.num_decodes) == 0 and np.ndim(agg.decode_sum_context) == 0:  # one step: scalar lookups
            n0 = int(agg.num_decodes)
            attention = 0.0
            if n0:
                t0, scaled0 = self._attention[0, "generation"].at(n0, max(agg.decode_sum_context / n0, 1.0))
                self._count("attention", [scaled0])
                attention = self.model.num_hidden_layers * t0
            parts["attention"] = attention + self._chunks_attention(chunks)
            return parts
        n = np.asarray(agg.num_decodes, dtype=np.float64)
        mean = np.asarray(agg.decode_sum_context, dtype=np.float64) / np.maximum(n, 1.0)
        t, scaled = self._attention[0, "generation"].many(np.maximum(n, 1.0), np.maximum(mean, 1.0))
        self._count("attention", scaled & (n > 0))
        decodes = self.model.num_hidden_layers * np.where(n > 0, t, 0.0)
        others = self._chunks_attention(chunks)
        attention = decodes + others
        parts["attention"] = float(attention) if np.ndim(attention) == 0 else attention
        return parts

    def cost_model_summary(self) -> dict:
        """summary.json's `cost_model`: the table or roofline that priced each operator, and what was scaled."""
        out = {"kind": "operator tables (MoE)", "system": self.system, "operators": dict(self.sources)}
        for op in ("router", "kv_write", "elementwise", "lm_head", "overhead"):
            out["operators"].setdefault(op, "roofline")
        if self.extrapolated:
            out["scaled_past_grid"] = dict(self.extrapolated)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def max_tokens_per_s(cost_model, max_tokens: int) -> float:
    """The most tokens per second a step of at most `max_tokens` tokens allows with its linear
    layers, router, MoE layers and all-reduces alone (attention and the rest come on top), for the
    MoE roofline or table model (`dense`): `sim validate`'s physical check, as
    OperatorModel.max_gemm_tokens_per_s is the dense model's."""
    sizes = sorted({2 ** i for i in range(max(int(max_tokens), 1).bit_length())} | {max(int(max_tokens), 1)})
    best = 0.0
    for t in sizes:
        linear, router, moe, _, _, _, allreduce = cost_model.dense(t, 0)
        best = max(best, t / float(linear + router + moe + allreduce))
    return best


def moe_table_model(model, hardware, system: str, data_dir: Path, tp: int = 1, dtype: str = "bf16",
                    kv_cache_dtype: str = "auto", enable_expert_parallel: bool = False, dp: int = 1,
                    distribution: str = "auto", vllm_version: str | None = None) -> MoETableCostModel:
    """The table-priced model of `system`'s vLLM tables (each at `vllm_version` or the nearest;
    None: the newest) in the package's layout under `data_dir`."""
    from backends.costmodel.optables.mla import read_mla_tables
    from backends.costmodel.optables.systems import read_layout_table
    from backends.costmodel.optables.tables import load_layout

    tables = load_layout(data_dir, system, "vllm", vllm_version)
    moe_table = read_layout_table(data_dir, system, "moe", "vllm", "moe_perf", vllm_version) \
        if model.num_experts else None
    mla_tables = read_mla_tables(data_dir, system, vllm_version) if model.kv_lora_rank else None
    return MoETableCostModel(model, hardware, tables, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                             enable_expert_parallel=enable_expert_parallel, dp=dp, distribution=distribution,
                             moe_table=moe_table, mla_tables=mla_tables)
