"""MLA attention (DeepSeek-V3/R1, Kimi K2) priced from the tables package's MLA module tables.

The tables: `systems/data/<system>/mla/vllm/<version>/mla_context_module_perf` and
`mla_generation_module_perf` (read with `read_layout_table`, the version asked for or the nearest,
reuse.yaml followed). What one row measures (AIConfigurator's collector/vllm/collect_mla_module.py,
ai-dynamo/aiconfigurator at 0e741b2, `run_mla_module`): the forward of one vLLM
`DeepseekV2MLAAttention` module (vllm/model_executor/models/deepseek_v2.py, whose forward is
`MultiHeadLatentAttentionWrapper.forward`, vllm/model_executor/layers/mla.py), built from the
checkpoint's own config.json with `num_attention_heads` set to the row's `num_heads`, at `tp_size` 1,
under a CUDA graph (not torch.compile'd):

- `fused_qkv_a_proj` (hidden -> q_lora_rank + kv_lora_rank + qk_rope_head_dim; replicated on every
  GPU in a TP deployment, so the same at any TP), `q_a_layernorm`, `kv_a_layernorm`;
- `q_b_proj` (q_lora_rank -> heads x (qk_nope + qk_rope)), RoPE on q's and k's rope parts;
- the MLA attention layer: the KV-cache write of the latents, then for a prefill the context's
  latents up-projected by `kv_b_proj` and attention in the heads' dimensions (the prefill backend,
  FLASH_ATTN on Hopper), for a decode the absorbed `W_UK` / `W_UV` products around the latent
  attention (the decode backend: FLASH_ATTN_MLA over a bf16 KV cache, FLASHMLA over fp8 on Hopper);
- `o_proj` (heads x v_head_dim -> hidden), with no all-reduce (`tp_size` 1).

So a row at `num_heads` = the model's heads / TP is one GPU's MLA layer of a TP deployment, from
its hidden states to o_proj's partial sums, less the all-reduce after it (priced on its own, as
for every layer). `kernel_source` is the backend vLLM itself ran for the row: the prefill backend,
or the decode backend where vLLM ran a short query as a decode (FLASH_ATTN_MLA takes queries of up
to 512 tokens down the decode path: vllm/v1/attention/backends/mla/flashattn_mla.py,
`reorder_batch_threshold`); one row per cell.

Columns: `batch_size`, `isl` and `step`: a context row is `batch_size` requests of `isl` new tokens
each after a prefix of `step` tokens (every published row has `step` 0); a generation row is
`batch_size` decodes, each of a sequence of `step` tokens counting the decoded one (the collector's
`seq_lens = [seq_len]`, `query_lens = [1]`, logged as `step = seq_len`): the KV length it attends is
`step` itself. `num_heads` the query heads on the GPU; `mla_dtype` the prefill query's compute
dtype (bfloat16: vLLM quantizes it to fp8 only when asked, `use_prefill_query_quantization`, on
SM100); `kv_cache_dtype` bfloat16 or fp8; `gemm_type` the projections' dtype (bfloat16, fp8_block,
nvfp4); `model` the checkpoint whose config the module was built from.

How servesim prices a step's MLA layers (`MLAModule`), as AIConfigurator's SDK uses the same tables
(sdk/models/deepseek.py: `MLAModule` replaces the layer's down-scale, q_b_proj, kv_b_proj,
attention and o_proj ops):

- a step's decodes: the generation table at (number of decodes, their mean KV length), as the GQA
  attention tables are read;
- a step's prefill chunks: the context table as one batch of n chunks, each at its full length
  c = prefix + q with AIConfigurator's prefix correction (its `query_context_mla_module_table`:
  module(b, prefix + s) x ((prefix + s)^2 - prefix^2) / (prefix + s)^2), each chunk a 1/n share:
  (1 / n) x sum_i T(n, c_i) x (c_i^2 - p_i^2) / c_i^2, which is the table's own time for n equal
  chunks without a prefix;
- a mixed step is the two lookups added (vLLM runs the step's tokens through one module forward;
  here the projections' weights are read once for the decodes and once for the chunks).

Interpolation: `Grid` (log-log, exact on grid points); lengths past a grid's last point are scaled
(decodes linearly in KV length, chunks as the square of the length) and counted in
`scaled_past_grid`; cells the triangular tables lack (large batches at long lengths) are the
column's largest measured batch scaled linearly in batch, as for the GQA tables.

A model is priced from the rows of a checkpoint with its own MLA shape only (hidden size, q and kv
LoRA ranks, head dims: `MLA_SHAPE`), read from the package's `model_configs/` (or servesim's preset
of the same name); its heads per GPU, GEMM dtype and KV dtype must be measured: anything else is a
stated reason, and the operators stay the roofline's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from backends.costmodel.optables.interp import Grid, fill_rows_by_scaling

if TYPE_CHECKING:
    from backends.costmodel.optables.systems import LayoutTable

FAMILY = "mla"
TABLES = ("mla_context_module_perf", "mla_generation_module_perf")
# DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the same layout of rows for the whole sparse layer
# (AIConfigurator's ContextDSAModule / GenerationDSAModule, sdk/operations/dsa.py: the down and up
# projections, the indexer's wq_b, wk and weights_proj, its fp8 logits and top-k, the sparse MLA
# attention and o_proj), under systems/data/<system>/sparse_attention/vllm/<version>/. A generation
# row's `step` is the context before the decoded token (the SDK reads a decode at sequence s from the
# row at step s - 1), so its KV length is step + 1.
DSA_FAMILY = "sparse_attention"
DSA_TABLES = ("dsa_context_module_perf", "dsa_generation_module_perf")
MLA_SHAPE = ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
GEMM_TYPES = {"bf16": "bfloat16", "fp8-block": "fp8_block"}  # servesim's weight dtypes -> the tables' gemm_type
PREFILL_COMPUTE = "bfloat16"  # mla_dtype: vLLM's prefill query runs in the model's dtype unless asked otherwise


@dataclass(frozen=True)
class MLATables:
    """A system's two MLA module tables (one vLLM version each) and the MLA shape of each checkpoint
    they measured (None where its config.json is not at hand)."""

    context: LayoutTable
    generation: LayoutTable
    shapes: dict
    data_dir: Path | None = None
    note: str = ""  # why these rows and not the system's own nearest (`read_mla_tables`)
    sparse: bool = False  # DeepSeek sparse attention's DSA module tables (DSA_TABLES), not MLA's

    @property
    def describe(self) -> str:
        c, g = self.context, self.generation
        if c.version == g.version:
            said = f"{Path(c.path).name}, {Path(g.path).name} vLLM {c.version} ({c.how})"
        else:
            said = f"{Path(c.path).name} vLLM {c.version} ({c.how}), {Path(g.path).name} vLLM {g.version} ({g.how})"
        return f"{said}; {self.note}" if self.note else said

    @property
    def after_collector_fix(self) -> bool:
        return collected_after_fix(self.context) and collected_after_fix(self.generation)


# AIConfigurator's MLA module collector timed, before its fused-op fix (ai-dynamo/aiconfigurator#1423),
# "the never-in-serving native chain" of RMSNorm ops: the package's own note on B200's rows, re-collected
# on 2026-07-27 with the fix (systems/data/b200_sxm/mla/vllm/0.24.0/collection_meta.yaml, +34% before it
# at its anchor). The legacy rows of the same GPU show it at small batches: GB200's vLLM 0.24 decode
# module (16 heads, batch 1) takes 86 us, B200's re-collected one 42 us; GB300's 0.24 rows 87 us, its
# 0.27 rows (collected 2026-08-18) 38 us. A table's collection_meta.yaml says which it is: the fix's
# `norm_dispatch`, or a `collected_at` from the fix on; a table without the file is taken as it is.
COLLECTOR_FIX = "2026-07-27"


def collected_after_fix(table: LayoutTable) -> bool:
    """Whether an MLA module table was collected with the fused-op fix (see COLLECTOR_FIX)."""
    return _file_after_fix(Path(table.path), table.table)


def _file_after_fix(path: Path, table: str) -> bool:
    """`collected_after_fix` of the table file at `path`, from its folder's collection_meta.yaml."""
    from backends.costmodel.optables.systems import _yaml

    meta = path.parent / "collection_meta.yaml"
    if not meta.is_file():
        return True
    entry = ((_yaml(meta) or {}).get("tables") or {}).get(table) or {}
    return bool(entry.get("norm_dispatch")) or str(entry.get("collected_at") or "") >= COLLECTOR_FIX


def model_shape(fields) -> tuple[int, ...]:
    """MLA_SHAPE of a ModelConfig (or a config.json's dict); q_lora_rank None is 0."""
    get = fields.get if isinstance(fields, dict) else lambda f: getattr(fields, f)
    return tuple(int(get(f) or 0) for f in MLA_SHAPE)


def measured_shape(name: str, data_dir: Path | None) -> tuple[int, ...] | None:
    """The MLA shape of the checkpoint `name` (the tables' `model`): the package's
    model_configs/<org>--<name>_config.json (beside systems/), else servesim's preset of that name."""
    if data_dir is not None:
        path = Path(data_dir).parent.parent / "model_configs" / f"{name.replace('/', '--')}_config.json"
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError):
                return None
            raw = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
            return model_shape(raw) if raw.get("kv_lora_rank") else None
    from backends.presets import MODELS

    preset = MODELS.get(name.split("/")[-1])
    return model_shape(preset) if preset is not None and preset.get("kv_lora_rank") else None


def read_mla_tables(data_dir: Path, system: str, version: str | None, sparse: bool = False) -> MLATables | str | None:
    """The system's MLA module tables at `version` (or the nearest); None where it has neither, a
    reason where it has one but not the other. Where they predate the collector's fix (COLLECTOR_FIX),
    tables collected with it are taken instead, said in `note`: the system's own at the nearest
    version that has them, else those of a system with the same GPU (the package's gpu.sm_version:
    B300 and GB300, B200 and GB200), nearest version first; else the system's own, said too."""
    from backends.costmodel.optables.systems import table_versions, versions_by_nearness

    if sparse:  # DeepSeek sparse attention's DSA module tables, the system's own, as they are
        return _read_mla_tables(data_dir, system, version, sparse=True)
    own = _read_mla_tables(data_dir, system, version)
    if not isinstance(own, MLATables) or own.after_collector_fix:
        return own
    why = (f"{system}'s rows (vLLM {own.generation.version}) predate AIConfigurator's fused-op collector fix "
           "(ai-dynamo/aiconfigurator#1423), which timed an RMSNorm chain vLLM does not serve")
    for donor in [system, *same_gpu_systems(data_dir, system)]:
        files = {t: table_versions(Path(data_dir), donor, FAMILY, "vllm", t) for t in TABLES}
        # A version's tables are read only where both files' collection_meta.yaml say they have the fix.
        fixed = [v for v in files[TABLES[1]]
                 if v in files[TABLES[0]] and all(_file_after_fix(files[t][v][0], t) for t in TABLES)]
        for v, _ in (versions_by_nearness(fixed, version) if fixed else []):
            tables = _read_mla_tables(data_dir, donor, v)
            if isinstance(tables, MLATables) and tables.after_collector_fix:
                how = f"{donor}'s" + ("" if donor == system else f", the same GPU as {system}")
                return replace(tables, context=replace(tables.context, how=how),
                               generation=replace(tables.generation, how=how), note=f"collected with the fix: {why}")
    return replace(own, note=f"{why}; no rows collected with it for this GPU: taken as they are")


def same_gpu_systems(data_dir: Path, system: str) -> list[str]:
    """The other systems under `data_dir` with MLA tables whose GPU has `system`'s compute
    capability (gpu.sm_version), by name; [] where the package does not state it."""
    from backends.costmodel.optables.systems import system_sm_version

    sm = system_sm_version(system)
    if sm is None or not Path(data_dir).is_dir():
        return []
    return [other.name for other in sorted(Path(data_dir).iterdir())
            if other.name != system and (other / FAMILY / "vllm").is_dir() and system_sm_version(other.name) == sm]


def _read_mla_tables(data_dir: Path, system: str, version: str | None, sparse: bool = False) -> MLATables | str | None:
    from backends.costmodel.optables.systems import read_layout_table

    family, tables = (DSA_FAMILY, DSA_TABLES) if sparse else (FAMILY, TABLES)
    context, generation = (read_layout_table(data_dir, system, family, "vllm", t, version) for t in tables)
    if context is None and generation is None:
        return None
    if context is None or generation is None:
        have = (context or generation).table  # type: ignore[union-attr]
        return f"{system} has {have} but not the other {'DSA' if sparse else 'MLA'} module table"
    names = sorted(set(context.frame["model"].astype(str)) | set(generation.frame["model"].astype(str)))
    return MLATables(context, generation, {n: measured_shape(n, data_dir) for n in names}, data_dir, sparse=sparse)


def fill_interior_cells(batch: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, int]:
    """A module table's cells missing between two measured batches of their column (B200's DSA
    generation rows lack batch 4 at step 8), interpolated log-log between the nearest measured
    batch below and above, as `Grid` reads between grid points; and how many. Cells past a
    column's last measured batch are left to `fill_rows_by_scaling`."""
    grid = np.array(grid, dtype=np.float64)
    count = 0
    for col in range(grid.shape[1]):
        measured = np.flatnonzero(~np.isnan(grid[:, col]))
        holes = np.setdiff1d(np.arange(measured[0], measured[-1]), measured) if len(measured) > 1 else []
        for i in holes:
            lo, hi = measured[measured < i][-1], measured[measured > i][0]
            w = np.log(batch[i] / batch[lo]) / np.log(batch[hi] / batch[lo])
            grid[i, col] = np.exp(np.log(grid[lo, col]) + w * (np.log(grid[hi, col]) - np.log(grid[lo, col])))
            count += 1
    return grid, count


def _grid(rows, length: str, power_b: float, interior: bool = False) -> Grid | str:
    """The rows' batch x length grid; with `interior`, cells missing between measured batches are
    interpolated (`fill_interior_cells`: the DSA tables; the MLA tables' holes still send the
    operator to the roofline, as before)."""
    piv = rows.groupby(["batch_size", length])["seconds"].mean().unstack(length).sort_index()
    piv = piv.reindex(sorted(piv.columns), axis=1)
    batch = np.asarray(piv.index.tolist(), dtype=np.float64)
    cells = fill_interior_cells(batch, piv.to_numpy())[0] if interior else piv.to_numpy()
    try:
        full, _ = fill_rows_by_scaling(batch, cells)
    except ValueError as e:
        return f"the rows do not make a grid of batch x {length} ({e})"
    return Grid(batch, [float(c) for c in piv.columns], full, power_b=power_b)


class MLAModule:
    """One GPU's MLA layer from the module tables (module doc): `decodes` and `chunks` give one
    layer's seconds; `source` says what was read."""

    def __init__(self, context: Grid, generation: Grid, source: str):
        self.context, self.generation, self.source = context, generation, source

    def decodes(self, n: int, mean_kv: float) -> tuple[float, bool]:
        """One layer's seconds of n > 0 decodes at a mean KV length, and whether off the grid."""
        return self.generation.at(n, mean_kv)

    def decodes_many(self, n: np.ndarray, mean_kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.generation.many(n, mean_kv)

    def chunks(self, chunks) -> tuple[float, int]:
        """One layer's seconds of a step's prefill chunks, (q new tokens, c tokens of context after
        the step) each, as one batch of n (module doc); and how many lookups were off the grid."""
        n = len(chunks)
        total, off = 0.0, 0
        for q, c in chunks:
            t, scaled = self.context.at(n, c)
            p = c - q
            total += t if p == 0 else t * (c * c - p * p) / (c * c)
            off += scaled
        return total / n, off


def mla_module(tables: MLATables, model, heads: int, weights_dtype: str, kv_cache_dtype: str) -> MLAModule | str:
    """The module grids for `model` at `heads` query heads a GPU, its projections in `weights_dtype`
    and its KV cache in `kv_cache_dtype` ('fp8' or not), or the reason the tables cannot price it."""
    from backends.costmodel.optables.systems import kernel_allowed

    what = "DSA" if tables.sparse else "MLA"
    if bool(getattr(model, "index_topk", 0)) != tables.sparse:  # sparse and dense MLA layers are other modules
        return (f"the {what} module tables price {'sparse' if tables.sparse else 'dense'} MLA layers, not this "
                f"model's {'dense' if tables.sparse else 'sparse'} ones")
    want = model_shape(model)
    same = [n for n, s in tables.shapes.items() if s == want]
    if not same:
        measured = ", ".join(f"{n} {dict(zip(MLA_SHAPE, s)) if s else '(shape unknown)'}"
                             for n, s in tables.shapes.items())
        return f"the {what} module tables measured {measured}, not this model's {dict(zip(MLA_SHAPE, want))}"
    gemm = GEMM_TYPES.get(weights_dtype)
    kv = "fp8" if kv_cache_dtype == "fp8" else "bfloat16"
    grids = {}
    kernels = {}
    for layout, length, power in ((tables.context, "isl", 2.0), (tables.generation, "step", 1.0)):
        f = layout.frame
        rows = f[f["model"].astype(str).isin(same) & (f["mla_dtype"] == PREFILL_COMPUTE)]
        if length == "isl":
            rows = rows[rows["step"] == 0]
        elif tables.sparse:  # the DSA generation rows' step is the context before the decoded token
            rows = rows.assign(step=rows["step"] + 1)
        if gemm is None or rows[rows["gemm_type"] == gemm].empty:
            have = ", ".join(sorted(str(x) for x in rows["gemm_type"].unique())) or "none"
            return f"no {what} module rows with {weights_dtype} projections (gemm_type there: {have})"
        rows = rows[rows["gemm_type"] == gemm]
        if rows[rows["kv_cache_dtype"] == kv].empty:
            have = ", ".join(sorted(str(x) for x in rows["kv_cache_dtype"].unique()))
            return f"no {what} module rows over a {kv} KV cache (kv_cache_dtype there: {have})"
        rows = rows[rows["kv_cache_dtype"] == kv]
        if rows[rows["num_heads"] == heads].empty:
            have = ", ".join(str(int(x)) for x in sorted(rows["num_heads"].unique()))
            return f"no {what} module rows at {heads} heads a GPU (num_heads there: {have})"
        rows = rows[rows["num_heads"] == heads]
        if tables.data_dir is not None:
            rows = rows[[kernel_allowed(tables.data_dir, layout.table, str(k)) for k in rows["kernel_source"]]]
        grid = _grid(rows, length, power, interior=tables.sparse)
        if isinstance(grid, str):
            return f"{layout.table}: {grid}"
        grids[length] = grid
        kernels[length] = "/".join(sorted(str(k) for k in rows["kernel_source"].unique()))
    ctx, gen = grids["isl"], grids["step"]
    layer = ("the layer from its hidden states to o_proj (q/kv down and up projections, norms, RoPE, KV-cache write, "
             + ("the indexer's projections, fp8 logits and top-k, sparse attention)" if tables.sparse else "attention)"))
    source = (f"{what} module tables {tables.describe}: {layer}; {', '.join(same)} rows, {heads} heads a GPU, "
              f"{gemm} GEMMs, {kv} KV; context {kernels['isl']} (batch {int(ctx.xa[0])}..{int(ctx.xa[-1])}, "
              f"isl {int(ctx.xb[0])}..{int(ctx.xb[-1])}), generation {kernels['step']} (batch "
              f"{int(gen.xa[0])}..{int(gen.xa[-1])}, KV {int(gen.xb[0])}..{int(gen.xb[-1])})")
    return MLAModule(ctx, gen, source)
