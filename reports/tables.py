"""The Parquet tables of sweeps and capacity searches, read back with the identity stored in them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from sim.errors import ServesimError

RESULTS = "results.parquet"  # a sweep's table; a capacity search's is probes.parquet
METADATA_KEY = b"servesim.sweep"  # the schema metadata key holding the table's identity (trace, grid, options)
KEY_COLUMNS = ("point", "status")  # every row's point and whether it finished: a table without them is no table


def read_table(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """A sweep or probe table and the identity stored with it."""
    table, identity = _read_arrow(path)
    frame = table.to_pandas()
    for column in frame.columns:  # list columns come back as numpy arrays; rows hold plain lists
        if frame[column].dtype == object:
            frame[column] = [v.tolist() if hasattr(v, "tolist") else v for v in frame[column]]
    return frame, identity


def read_rows(path: str | Path) -> tuple[list[dict], dict]:
    """The table's rows as plain dicts, each value as written (an int stays an int beside a
    missing value, which pandas would turn into a float), and the identity."""
    table, identity = _read_arrow(path)
    return table.to_pylist(), identity


def _read_arrow(path: str | Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ServesimError("pyarrow is missing (a servesim dependency): pip install pyarrow") from None
    path = Path(path)
    try:
        # One read of the whole file: the writer may replace it meanwhile, and two opens could see two files.
        table = pq.read_table(pa.BufferReader(path.read_bytes()))
    except FileNotFoundError:
        raise ServesimError(f"{path}: no such file") from None
    except Exception as e:
        raise ServesimError(f"{path}: not a readable Parquet table ({type(e).__name__}: {e})") from None
    metadata = table.schema.metadata or {}
    if METADATA_KEY not in metadata:
        raise ServesimError(f"{path}: not a servesim results table (no sweep metadata)")
    try:
        identity = json.loads(metadata[METADATA_KEY])
    except ValueError:  # not JSON, or not UTF-8
        identity = None
    if not _is_identity(identity):
        raise ServesimError(f"{path}: not a servesim results table (its sweep metadata is not the JSON object "
                            "servesim writes)")
    missing = [name for name in KEY_COLUMNS if name not in table.column_names]
    if missing:
        raise ServesimError(f"{path}: not a servesim results table (no {' or '.join(missing)} column)")
    return table, identity


def _is_identity(identity) -> bool:
    """The shape results_table.identity writes: {"trace_sha256": str, "axes": {name: [values]}, "fixed": {...}}."""
    if not isinstance(identity, dict):
        return False
    axes, fixed = identity.get("axes", {}), identity.get("fixed", {})
    return (isinstance(identity.get("trace_sha256", ""), str) and isinstance(fixed, dict) and isinstance(axes, dict)
            and all(isinstance(values, list) for values in axes.values()))
