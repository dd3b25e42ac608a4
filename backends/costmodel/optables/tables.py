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
    import numpy as np
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


def _scan(folder: str | Path) -> dict[tuple[str, str, str], dict[str, list[Path]]]:
    """(system, framework, version) -> {kind: the table files} in `folder` (flat names): one file a
    kind, or two where a table is there as both .csv and .parquet (refused where it is read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ServesimError(f"{folder}: no such folder of operator tables")
    found: dict[tuple[str, str, str], dict[str, list[Path]]] = {}
    for path in sorted(folder.iterdir()):
        match = _NAME.match(path.name)
        if match is None:
            continue
        key = (match["system"], match["framework"].lower(), match["version"])
        found.setdefault(key, {}).setdefault(match["kind"], []).append(path)
    return found


def list_tables(folder: str | Path) -> dict[tuple[str, str, str], dict[str, Path]]:
    """(system, framework, version) -> {kind: path} of every table file in `folder` (flat names)."""
    return {key: {kind: paths[-1] for kind, paths in kinds.items()}  # sorted: the .parquet of two files
            for key, kinds in _scan(folder).items()}


KIND_OF_TABLE = {f"{k}_perf": k for k in KINDS}


# Columns that count or size something, checked in any table that has them: whole numbers of at
# least 1 (at least 0 for `step` and `window_size`; a window of 0 is no window).
SIZE_COLUMNS = {c: 1 for c in ("m", "n", "k", "batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim",
                               "num_gpus", "message_size", "num_tokens", "hidden_size", "inter_size", "topk",
                               "num_experts", "moe_tp_size", "moe_ep_size", "tp_size")}
SIZE_COLUMNS.update(step=0, window_size=0)
TEXT_COLUMNS = ("kernel_source", "gemm_dtype", "kv_cache_dtype")  # must not be empty where a table has them
MEASURED = ("latency", "power", "power_limit")  # what a row measures; the other columns are its key
# Rows with the same key are repeated measurements, averaged by the derivation. The published tables
# repeat some points with up to 4.2x between the times (NCCL's small messages); rows further apart
# than this are not noise: the table is refused.
DUPLICATE_SPREAD = 10.0
# Text columns with one value on all or most rows of a published table: left out of the cheap first grouping.
SAME_TEXT = ("framework", "version", "device", "op_name")


def _row(path: Path, i: int) -> str:
    """Data row i (from 0) of a table file, as a message names it: rows count from 1; a CSV's line too."""
    return f"row {i + 1} (line {i + 2})" if path.suffix == ".csv" else f"row {i + 1}"


def _value(value) -> str:
    """A cell as a message shows it: text quoted, numbers plain."""
    value = value.item() if hasattr(value, "item") else value
    return repr(value) if isinstance(value, str) else str(value)


def read_frame(path: Path, table: str) -> pd.DataFrame:
    """One table file (parquet or CSV) with a `seconds` column; `table` is its kind (gemm ...) or
    its file stem (gemm_perf, nccl_perf, moe_perf ...): a known kind's columns are checked. Every
    table's sizes, times and repeated points are checked (`check_frame`)."""
    import pandas as pd  # here, not at import: a replay loading a profile never needs it

    kind = KIND_OF_TABLE.get(table, table)
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path, low_memory=False)
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
    return check_frame(frame, path, kind)


def check_frame(frame: pd.DataFrame, path: Path, kind: str) -> pd.DataFrame:
    """`frame` (read from `path`) checked, with sizes made integers and a `seconds` column added.
    Refused, naming the row, column and value: no rows; a size (SIZE_COLUMNS) that is not a whole
    number at least its minimum; an empty TEXT_COLUMNS cell; a latency that is not a positive finite
    number; two rows with the same key whose latencies are more than DUPLICATE_SPREAD apart."""
    import numpy as np
    import pandas as pd

    if len(frame) == 0:
        raise ServesimError(f"{path}: the {kind} table has no rows")
    for column, least in SIZE_COLUMNS.items():
        if column not in frame.columns:
            continue
        raw = frame[column]
        values = raw if raw.dtype.kind in "iu" else pd.to_numeric(raw, errors="coerce").astype(float)
        bad = (values < least).to_numpy()
        if values.dtype.kind == "f":
            # past 2**53 a float is no exact whole number
            bad = bad | ~(np.isfinite(values) & (values == np.floor(values)) & (values <= 2**53)).to_numpy()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ServesimError(f"{path}: {_row(path, i)}, column {column}: {_value(raw.iloc[i])} is not a whole number "
                                f"of at least {least}")
        if values.dtype.kind == "f":
            frame[column] = values.astype("int64")
    for column in TEXT_COLUMNS:
        if column in frame.columns and frame[column].isna().any():
            i = int(np.flatnonzero(frame[column].isna().to_numpy())[0])
            raise ServesimError(f"{path}: {_row(path, i)}, column {column}: empty")
    latency = pd.to_numeric(frame["latency"], errors="coerce").astype(float)
    bad = ~(np.isfinite(latency) & (latency > 0)).to_numpy()
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ServesimError(f"{path}: {_row(path, i)}, column latency: {_value(frame['latency'].iloc[i])} is not a "
                            f"positive time (ms)")
    _check_repeats(frame, latency, path)
    frame["seconds"] = latency * 1e-3
    return frame


def _far_rows(keys: np.ndarray, times: np.ndarray) -> np.ndarray:
    """The positions of the rows whose group (the rows with the same `keys` value) has times more
    than DUPLICATE_SPREAD apart (largest over smallest), in order."""
    import numpy as np

    order = np.argsort(keys)
    ordered, spans = keys[order], times[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    if len(starts) == len(keys):  # no two rows alike
        return starts[:0]
    far = np.maximum.reduceat(spans, starts) > DUPLICATE_SPREAD * np.minimum.reduceat(spans, starts)
    return np.sort(order[np.repeat(far, np.diff(np.r_[starts, len(keys)]))])


def _check_repeats(frame: pd.DataFrame, latency: pd.Series, path: Path) -> None:
    """Refuse rows with the same key (every column but MEASURED) whose latencies are more than
    DUPLICATE_SPREAD apart, naming both rows, the key and the two latencies.

    Hashing every text cell is slow on large tables, so rows are first grouped coarsely, by their
    numbers and the lengths of their texts but those of SAME_TEXT (rows with the same key are in
    the same group); only the groups whose times spread too far are grouped again by the key."""
    import numpy as np

    key = [c for c in frame.columns if c not in MEASURED]
    times = latency.to_numpy()
    coarse = np.zeros(len(frame), dtype=np.uint64)
    for column in (c for c in key if c not in SAME_TEXT):
        values = frame[column]
        try:
            if values.dtype.kind in "iub":
                part = values.to_numpy().astype(np.uint64)
            elif values.dtype.kind == "f":
                part = values.to_numpy(dtype=np.float64)
                part = np.where(np.isnan(part), 0.0, part + 0.0).view(np.uint64)  # -0.0 as 0.0, NaNs alike
            else:
                part = values.str.len().fillna(-1).to_numpy(dtype=np.int64).view(np.uint64)
        except (AttributeError, TypeError, ValueError):
            continue  # left out of the coarse groups: they are only coarser
        coarse = coarse * np.uint64(0x9E3779B97F4A7C15) + part  # a large odd factor mixes the columns into one number
    rows = _far_rows(coarse, times)
    if len(rows) == 0:
        return
    try:
        exact = frame.iloc[rows].groupby(key, dropna=False, sort=False).ngroup().to_numpy()
    except TypeError:  # a column of lists or the like: no derivation reads it
        return
    far = _far_rows(exact, times[rows])
    if len(far) == 0:
        return
    members = rows[exact == exact[far[0]]]
    i, j = sorted((members[np.argmin(times[members])], members[np.argmax(times[members])]))
    shown = [c for c in key if frame[c].nunique(dropna=False) > 1] or key  # not those the same on every row
    point = ", ".join(f"{c}={_value(frame[c].iloc[i])}" for c in shown)
    raise ServesimError(f"{path}: {_row(path, i)} and {_row(path, j)} measure the same point ({point}) with "
                        f"latencies {times[i]:g} and {times[j]:g} ms, more than {DUPLICATE_SPREAD:g}x apart")


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
    found = _scan(folder)
    matches = {k: v for k, v in found.items() if k[0] == system and k[1] == framework.lower()}
    if not matches:
        have = ", ".join(sorted({f"{s} ({f}-{v})" for s, f, v in found})) or "none"
        want = f"{system} ({framework}{'-' + version if version else ''})"
        raise ServesimError(f"{folder}: no operator tables for {want}; tables there: {have}")
    from backends.costmodel.optables.systems import choose_version

    asked = version
    chosen, how = choose_version([k[2] for k in matches], asked)
    (system, framework, version), found_files = next((k, v) for k, v in matches.items() if k[2] == chosen)
    for paths in found_files.values():
        if len(paths) > 1:
            raise ServesimError(f"{paths[0]} and {paths[1].name}: one table in two files; keep one")
    files = {k: paths[0] for k, paths in found_files.items()}
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
