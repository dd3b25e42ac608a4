"""AIConfigurator operator tables: find, load and check them, filtered to one system and framework.

A folder of tables holds, per system and framework version, four files named

    <system>__<framework>-<version>__<kind>_perf.parquet   (or .csv with the same columns)

with kind one of gemm, context_attention, generation_attention, custom_allreduce: the layout of
NVIDIA AIConfigurator's `systems/data/<system>/{gemm,attention,comm}/<framework>/<version>/`
flattened (see ../shared/gpu-data/SOURCES.md). `latency` is in milliseconds; this module keeps
the raw rows, converted to seconds; backends/opderive.py turns them into one model's curves.

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
from dataclasses import dataclass
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
GEMM_DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}  # servesim's name -> the tables' gemm_dtype
KV_DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}
_NAME = re.compile(r"^(?P<system>[^_]+(?:_[^_]+)*?)__(?P<framework>[A-Za-z]+)-(?P<version>[^_]+)__"
                   r"(?P<kind>" + "|".join(KINDS) + r")_perf\.(?P<ext>parquet|csv)$")


@dataclass(frozen=True)
class TableSet:
    """One system's four tables for one framework version (rows as read, latency in seconds)."""

    system: str
    framework: str
    version: str
    device: str  # what the GPU called itself when measured, e.g. "NVIDIA H100 80GB HBM3"
    files: dict  # kind -> Path
    gemm: pd.DataFrame
    context_attention: pd.DataFrame
    generation_attention: pd.DataFrame
    custom_allreduce: pd.DataFrame

    @property
    def source(self) -> dict:
        return {"system": self.system, "framework": self.framework, "framework_version": self.version,
                "device": self.device, "files": {k: Path(p).name for k, p in self.files.items()}}


def list_tables(folder: str | Path) -> dict[tuple[str, str, str], dict[str, Path]]:
    """(system, framework, version) -> {kind: path} of every table file in `folder`."""
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


def _read(path: Path, kind: str) -> pd.DataFrame:
    import pandas as pd  # here, not at import: a replay loading a profile never needs it

    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise ServesimError(f"{path}: cannot read the {kind} table: {e}") from None
    missing = [c for c in COLUMNS[kind] if c not in frame.columns]
    if missing:
        raise ServesimError(f"{path}: the {kind} table lacks column(s) {', '.join(missing)}")
    frame = frame.copy()
    frame["seconds"] = frame["latency"].astype(float) * 1e-3
    bad = frame[~(frame["seconds"] > 0)]
    if len(bad):
        raise ServesimError(f"{path}: {len(bad)} row(s) with a latency that is not positive "
                            f"(first at row {bad.index[0]})")
    return frame


def load_tables(folder: str | Path, system: str, framework: str = "vllm", version: str | None = None) -> TableSet:
    """The four tables of `system` for `framework` (and `version`; None: the only one there)."""
    found = list_tables(folder)
    matches = {k: v for k, v in found.items() if k[0] == system and k[1] == framework.lower()
               and (version is None or k[2] == version)}
    if not matches:
        have = ", ".join(sorted({f"{s} ({f}-{v})" for s, f, v in found})) or "none"
        want = f"{system} ({framework}{'-' + version if version else ''})"
        raise ServesimError(f"{folder}: no operator tables for {want}; tables there: {have}")
    if len(matches) > 1:
        versions = ", ".join(sorted(k[2] for k in matches))
        raise ServesimError(f"{folder}: {system} has tables for {framework} versions {versions}; choose one")
    (system, framework, version), files = next(iter(matches.items()))
    missing = [k for k in KINDS if k not in files]
    if missing:
        raise ServesimError(f"{folder}: {system} ({framework}-{version}) lacks the table(s) "
                            + ", ".join(f"{system}__{framework}-{version}__{k}_perf.parquet" for k in missing))
    frames = {k: _read(files[k], k) for k in KINDS}
    device = str(frames["gemm"]["device"].iloc[0]) if "device" in frames["gemm"].columns else system
    return TableSet(system, framework, version, device, files, **frames)


def systems_in(folder: str | Path) -> list[str]:
    """The systems that have tables in `folder` (for messages and `sim validate`'s skips)."""
    return sorted({k[0] for k in list_tables(folder)})
