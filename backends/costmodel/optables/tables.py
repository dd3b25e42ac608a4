"""AIConfigurator operator tables: find, load and check them, filtered to one system and framework.

A folder of tables holds, per system and framework version, four files named

    <system>__<framework>-<version>__<kind>_perf.parquet   (or .csv with the same columns)

with kind one of gemm, context_attention, generation_attention, custom_allreduce: the layout of
NVIDIA AIConfigurator's `systems/data/<system>/{gemm,attention,comm}/<framework>/<version>/`
flattened (see ../shared/gpu-data/SOURCES.md). `latency` is in milliseconds; this module keeps
the raw rows, converted to seconds; backends/costmodel/optables/derive.py turns them into one model's curves.

Kernels, as vLLM 0.24 picks them on Hopper (H100, H200):
- bf16 GEMMs: `torch.nn.functional.linear` (UnquantizedLinearMethod, vllm/model_executor/layers/linear.py).
- fp8 GEMMs (per-tensor scaled checkpoints and `--quantization fp8`): `CutlassFP8ScaledMMLinearKernel`,
  the `fp8` rows (vllm/model_executor/layers/quantization/kernels/scaled_mm/cutlass.py); the
  `fp8_block` rows are block-quantized checkpoints (DeepSeek-style), not priced here.
- attention: FlashAttention 3, `vllm_flash_attn_fa3` (vllm/v1/attention/backends/fa_utils.py,
  get_flash_attn_version: SM90 prefers FA3; FA4 is Blackwell's).
- all-reduce: vLLM's custom all-reduce, `vLLM_custom_graph` inside CUDA graphs and
  `vLLM_custom_eager` outside them (vllm/distributed/device_communicators/custom_all_reduce.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sim.errors import ServesimError

if TYPE_CHECKING:
    import pandas as pd

KINDS = ("gemm", "context_attention", "generation_attention", "custom_allreduce")
ATTENTION_COLUMNS = ("kernel_source", "batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim",
                     "kv_cache_dtype", "step", "window_size", "latency")
COLUMNS = {
    "gemm": ("kernel_source", "gemm_dtype", "m", "n", "k", "latency"),
    "context_attention": ATTENTION_COLUMNS,
    "generation_attention": ATTENTION_COLUMNS,
    "custom_allreduce": ("kernel_source", "num_gpus", "message_size", "latency"),
}
KERNELS = {
    ("gemm", "bf16"): "torch.nn.functional.linear",
    ("gemm", "fp8"): "CutlassFP8ScaledMMLinearKernel",
    ("attention", None): "vllm_flash_attn_fa3",
    ("allreduce", "graph"): "vLLM_custom_graph",
    ("allreduce", "eager"): "vLLM_custom_eager",
}
GEMM_DTYPES = {"bf16": "bfloat16", "fp8": "fp8", "fp4": "nvfp4"}  # servesim's name -> the tables' gemm_dtype
KV_DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}
_NAME = re.compile(r"^(?P<system>[^_]+(?:_[^_]+)*?)__(?P<framework>[A-Za-z]+)-(?P<version>[^_]+)__"
                   r"(?P<kind>" + "|".join(KINDS) + r")_perf\.(?P<ext>parquet|csv)$")


@dataclass(frozen=True)
class TableSet:
    """One system's tables for one framework (rows as read, latency in seconds). A table the
    source lacks is None: the derivation refuses it, by name, only where the run reads it (the
    all-reduce under TP > 1). `versions`: kind -> the framework version its rows were read from,
    and how it was chosen; `nccl`: the system's NCCL table (all-reduce rows), where there is one."""

    system: str
    framework: str
    version: str
    device: str  # what the GPU called itself when measured, e.g. "NVIDIA H100 80GB HBM3"
    files: dict  # kind -> Path
    gemm: pd.DataFrame
    context_attention: pd.DataFrame
    generation_attention: pd.DataFrame
    custom_allreduce: pd.DataFrame | None
    nccl: pd.DataFrame | None = None
    # TensorRT-LLM's custom all-reduce rows (the system's newest TRT-LLM version), where there are
    # any: the kernel vLLM's FlashInfer all-reduce fusion runs (backends/costmodel/optables/derive.py,
    # derive_allreduce), read only where a deployment turns that fusion on.
    fused_allreduce: pd.DataFrame | None = None
    versions: dict = field(default_factory=dict)  # kind -> (version, how chosen)
    data_dir: Path | None = None  # the layout's data folder (its reuse manifest is beside it)
    asked_version: str | None = None  # the framework version asked for (None: the newest)

    @property
    def source(self) -> dict:
        out = {"system": self.system, "framework": self.framework, "framework_version": self.version,
               "device": self.device, "files": {k: Path(p).name for k, p in self.files.items()}}
        if self.versions:  # each kind's own version and how it was chosen (as asked, the nearest, the newest)
            out["asked_version"] = self.asked_version
            out["table_versions"] = {k: v for k, (v, _) in self.versions.items()}
            out["table_version_choice"] = {k: how for k, (_, how) in self.versions.items()}
        return out

    def version_note(self) -> str:
        """One line: which version's tables each kind was read from, and why."""
        if not self.versions:
            return f"{self.framework} {self.version} tables"
        parts = [f"{k} {v} ({how})" for k, (v, how) in self.versions.items()]
        return f"{self.system} {self.framework} tables: " + "; ".join(parts)

    def kernel_allowed(self, kind: str, kernel: str) -> bool:
        if self.data_dir is None:
            return True
        from backends.costmodel.optables.systems import TABLES, kernel_allowed

        table = "nccl_perf" if kind == "nccl" else TABLES[kind][1]
        return kernel_allowed(self.data_dir, table, kernel, self.framework)


def list_tables(folder: str | Path) -> dict[tuple[str, str, str], dict[str, Path]]:
    """(system, framework, version) -> {kind: path} of every table file in `folder` (flat names)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ServesimError(f"{folder}: no such folder of operator tables")
    found: dict[tuple[str, str, str], dict[str, Path]] = {}
    for path in sorted(folder.iterdir()):
        match = _NAME.match(path.name)
        if match is None:
            continue
        key = (match["system"], match["framework"].lower(), match["version"])
        kinds = found.setdefault(key, {})
        if match["kind"] in kinds and kinds[match["kind"]].suffix == ".parquet":
            continue  # a parquet file wins over a CSV copy
        kinds[match["kind"]] = path
    return found


KIND_OF_TABLE = {f"{k}_perf": k for k in KINDS}


def read_frame(path: Path, table: str) -> pd.DataFrame:
    """One table file (parquet or CSV) with a `seconds` column; `table` is its kind (gemm ...) or
    its file stem (gemm_perf, nccl_perf, moe_perf ...): a known kind's columns are checked."""
    import pandas as pd  # here, not at import: a replay loading a profile never needs it

    kind = KIND_OF_TABLE.get(table, table)
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise ServesimError(f"{path}: cannot read the {kind} table: {e}") from None
    missing = [c for c in COLUMNS.get(kind, ("latency",)) if c not in frame.columns]
    if kind in ("context_attention", "generation_attention") and "window_size" in missing:
        missing.remove("window_size")  # older tables (A100's) have no sliding windows: all rows are full
    if missing:
        raise ServesimError(f"{path}: the {kind} table lacks column(s) {', '.join(missing)}")
    frame = frame.copy()
    if "window_size" not in frame.columns and kind in ("context_attention", "generation_attention"):
        frame["window_size"] = 0
    frame["seconds"] = frame["latency"].astype(float) * 1e-3
    bad = frame[~(frame["seconds"] > 0)]
    if len(bad):
        raise ServesimError(f"{path}: {len(bad)} row(s) with a latency that is not positive "
                            f"(first at row {bad.index[0]})")
    return frame


_read = read_frame


def is_layout(folder: str | Path) -> bool:
    from backends.costmodel.optables.systems import find_data_dir

    return find_data_dir(folder) is not None


def load_tables(folder: str | Path, system: str, framework: str = "vllm", version: str | None = None) -> TableSet:
    """The tables of `system` for `framework` from `folder`, flat files or the package's layout:
    each kind at `version` if there, else the nearest version there is (None: the newest)."""
    from backends.costmodel.optables.systems import find_data_dir

    data_dir = find_data_dir(folder) if Path(folder).is_dir() else None
    if data_dir is not None:
        return load_layout(data_dir, system, framework, version)
    found = list_tables(folder)
    matches = {k: v for k, v in found.items() if k[0] == system and k[1] == framework.lower()}
    if not matches:
        have = ", ".join(sorted({f"{s} ({f}-{v})" for s, f, v in found})) or "none"
        want = f"{system} ({framework}{'-' + version if version else ''})"
        raise ServesimError(f"{folder}: no operator tables for {want}; tables there: {have}")
    from backends.costmodel.optables.systems import choose_version

    asked = version
    chosen, how = choose_version([k[2] for k in matches], asked)
    (system, framework, version), files = next((k, v) for k, v in matches.items() if k[2] == chosen)
    missing = [k for k in KINDS if k not in files and k != "custom_allreduce"]
    if missing:
        raise ServesimError(f"{folder}: {system} ({framework}-{version}) lacks the table(s) "
                            + ", ".join(f"{system}__{framework}-{version}__{k}_perf.parquet" for k in missing))
    frames = {k: (_read(files[k], k) if k in files else None) for k in KINDS}
    device = str(frames["gemm"]["device"].iloc[0]) if "device" in frames["gemm"].columns else system
    versions = {k: (version, how) for k in files} if asked is not None and how != "as asked" else {}
    return TableSet(system, framework, version, device, files, **frames, versions=versions, asked_version=asked)


def load_layout(data_dir: Path, system: str, framework: str = "vllm", version: str | None = None) -> TableSet:
    """A system's tables from a folder in the package's layout (backends/costmodel/optables/systems.py), each kind at
    `version` or the nearest version that kind has, reuse.yaml followed; the NCCL table (the
    system's newest) where there is one."""
    from backends.costmodel.optables.systems import TABLES, layout_systems, read_layout_table

    if not (data_dir / system).is_dir():
        have = ", ".join(layout_systems(data_dir, framework)) or "none"
        raise ServesimError(f"{data_dir}: no operator tables for system {system}; systems there: {have}")
    frames, files, versions = {}, {}, {}
    for kind, (family, table) in TABLES.items():
        read = read_layout_table(data_dir, system, family, framework, table, version)
        if read is None:
            if kind != "custom_allreduce":  # read only under TP > 1, refused there by name
                raise ServesimError(f"{data_dir / system / family / framework}: {system} has no {table} table for "
                                    f"{framework} (any version)")
            frames[kind] = None
            continue
        frames[kind], files[kind], versions[kind] = read.frame, read.path, (read.version, read.how)
    nccl = read_layout_table(data_dir, system, "comm", "nccl", "nccl_perf", None)
    if nccl is not None:
        files["nccl"] = nccl.path
    fused = read_layout_table(data_dir, system, "comm", "trtllm", "custom_allreduce_perf", None)
    if fused is not None:
        files["fused_allreduce"] = fused.path
    gemm_version = versions["gemm"][0]
    device = str(frames["gemm"]["device"].iloc[0]) if "device" in frames["gemm"].columns else system
    return TableSet(system, framework, gemm_version, device, files, **frames,
                    nccl=None if nccl is None else nccl.frame,
                    fused_allreduce=None if fused is None else fused.frame, versions=versions, data_dir=data_dir,
                    asked_version=version)


def systems_in(folder: str | Path) -> list[str]:
    """The systems that have tables in `folder` (for messages and `sim validate`'s skips)."""
    from backends.costmodel.optables.systems import find_data_dir, layout_systems

    data_dir = find_data_dir(folder) if Path(folder).is_dir() else None
    if data_dir is not None:
        return layout_systems(data_dir)
    return sorted({k[0] for k in list_tables(folder)})
