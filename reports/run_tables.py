"""A run's tables (requests, steps) written as they grow, and read back.

A table is written in batches of columns (numpy arrays of equal length, or lists):

- `parquet` (the default): each batch is one row group of `NAME.parquet`; a table of millions of
  rows never has to be in memory whole, and reading it back costs a fraction of CSV's.
- `csv`: `NAME.csv`, byte for byte what `pandas.DataFrame.to_csv(path, index=False)` writes for
  the whole table (numbers as Python's repr, a missing value as an empty field, text quoted only
  where it must be), without pandas.

`read_run_table(folder, name)` finds `NAME.parquet` or `NAME.csv` and returns a DataFrame.
pyarrow is imported only when a Parquet table is written or read.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from sim.errors import ServesimError

FORMATS = ("parquet", "csv")
CSV_CHUNK_ROWS = 65536


class TableWriter:
    """Writes a table to `path` batch by batch; the first batch fixes the columns and their types."""

    def __init__(self, path: str | Path, fmt: str = "parquet"):
        if fmt not in FORMATS:
            raise ServesimError(f"unknown table format {fmt!r}; choose one of {', '.join(FORMATS)}")
        self.path = Path(path)
        self.format = fmt
        self.num_rows = 0
        self._names: list[str] | None = None
        self._parquet = None  # pyarrow.parquet.ParquetWriter, opened at the first batch
        self._csv = None

    def write(self, columns: dict) -> None:
        """Append one batch of rows; `columns` maps each column name to its values."""
        names = list(columns)
        if self._names is None:
            self._names = names
        elif names != self._names:
            raise ValueError(f"{self.path}: columns {names} differ from the first batch's {self._names}")
        num_rows = len(next(iter(columns.values()))) if columns else 0
        if self.format == "parquet":
            self._write_parquet(columns)
        else:
            self._write_csv(columns, num_rows)
        self.num_rows += num_rows

    def _write_parquet(self, columns: dict) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({name: _arrow(values) for name, values in columns.items()})
        if self._parquet is None:
            # Dictionary encoding only for text (status, reasons: few distinct values). For numbers it
            # made the steps table's write 4x slower (0.19 s against 0.04 s for the Azure hour's
            # 431,657 steps) for a file 15% smaller.
            text = [field.name for field in table.schema if pa.types.is_string(field.type)]
            self._parquet = pq.ParquetWriter(self.path, table.schema, use_dictionary=text)
        elif not table.schema.equals(self._parquet.schema):
            # (a cast imports pyarrow.compute, 26 ms of a replay's start: only where types differ)
            table = table.cast(self._parquet.schema)
        self._parquet.write_table(table, row_group_size=max(len(table), 1))

    def _write_csv(self, columns: dict, num_rows: int) -> None:
        if self._csv is None:
            self._csv = open(self.path, "w", newline="")  # noqa: SIM115 (open across batches; closed by close())
            self._csv.write(",".join(columns) + "\n")
        for start in range(0, num_rows, CSV_CHUNK_ROWS):
            texts = [_csv_texts(values[start:start + CSV_CHUNK_ROWS]) for values in columns.values()]
            # Text is quoted where it needs, as pandas does (a lone empty field too: one column).
            if len(texts) == 1 or any(isinstance(t, list) and _needs_quoting(t) for t in texts):
                csv.writer(self._csv, lineterminator="\n").writerows(zip(*texts))
            else:
                self._csv.write("\n".join(map(",".join, zip(*texts))) + "\n")

    def close(self) -> None:
        """Finish the file (a table that got no batch is not written)."""
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None
        if self._csv is not None:
            self._csv.close()
            self._csv = None


def _csv_texts(values):
    """A column's fields as pandas writes them: numbers as Python's repr, NaN and None as empty.
    Text columns come back as a list (their fields may need quoting), numbers as an iterator."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
        if values.dtype.kind == "f":
            missing = np.isnan(values)
            if missing.all():  # (a part a run does not have: the API server's without a client)
                return iter([""] * len(values))
            if missing.any():
                texts = list(map(repr, values.tolist()))
                for i in np.flatnonzero(missing).tolist():
                    texts[i] = ""
                return iter(texts)
        return map(repr, values.tolist())
    if all(type(v) is int for v in values):  # a column of counts given as a list (no bools, no None)
        return map(repr, values)
    return ["" if v is None else v if isinstance(v, str) else _float_text(v) for v in values]


def _needs_quoting(texts: list[str]) -> bool:
    """Whether csv.writer (minimal quoting, "\\n" line ends) may quote any of these fields: one
    holding a comma, a quote or a line feed (a carriage return too, which Python 3.11's does
    not quote: left to csv.writer, to be safe). Without any, its rows are the fields joined by commas."""
    joined = "".join(texts)
    return any(c in joined for c in ',"\r\n')


def _float_text(value) -> str:
    if isinstance(value, np.generic):
        value = value.item()
    return "" if math.isnan(value) else repr(value)


def _arrow(values):
    import pyarrow as pa

    if isinstance(values, np.ndarray) and values.dtype.kind in "iufb":
        if values.ndim == 1 and values.dtype.isnative:
            return _arrow_from_numpy(values)
        return pa.array(values)
    return pa.array(list(values) if not isinstance(values, list) else values)


def _arrow_from_numpy(values: np.ndarray):
    """The Arrow array pa.array(values) makes of a 1-D array of numbers or bools (no nulls: a NaN
    stays a NaN), from its buffer: pa.array imports pandas (when installed) to check whether the
    values are pandas', about a third of a second that a replay writing its steps table needn't spend."""
    import pyarrow as pa

    if values.dtype.kind == "b":
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(np.packbits(values, bitorder="little"))])
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def write_table(folder: str | Path, name: str, columns: dict, fmt: str = "parquet",
                chunk_rows: int = 1 << 20) -> Path:
    """Write a whole table (columns of equal length) in row groups of `chunk_rows`."""
    writer = TableWriter(Path(folder) / f"{name}.{fmt}", fmt)
    try:
        num_rows = len(next(iter(columns.values())))
        for start in range(0, max(num_rows, 1), chunk_rows):
            writer.write({k: v[start:start + chunk_rows] for k, v in columns.items()})
    finally:
        writer.close()
    return writer.path


def find_table(folder: str | Path, name: str) -> Path | None:
    """`folder/NAME.parquet` or `folder/NAME.csv`, whichever exists (Parquet first)."""
    for fmt in FORMATS:
        path = Path(folder) / f"{name}.{fmt}"
        if path.exists():
            return path
    return None


def read_run_table(folder: str | Path, name: str, columns: list[str] | None = None):
    """The table `name` of a run folder as a DataFrame (only `columns` if given)."""
    import pandas as pd

    path = find_table(folder, name)
    if path is None:
        raise ServesimError(f"{folder}: holds no {name}.parquet or {name}.csv")
    if path.suffix == ".csv":
        return pd.read_csv(path, usecols=columns)
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=columns).to_pandas()
