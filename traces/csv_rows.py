"""CSV traces parsed in chunks of rows, and the checks every numeric column goes through.

pandas parses each chunk (its fast C parser); a row's file line is kept beside it so that every
problem names `file:line`. pandas names a later row with a field too many, but cuts the first
row short with a ParserWarning: that row is checked here before pandas reads it. pandas is
imported when the first chunk is parsed, not with this module: a replay of a file read without
it (Mooncake's JSON Lines, a clean Azure CSV) never pays for the import.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from sim.errors import ServesimError
from traces.formats import MAX_TOKENS, TEXT_COLUMNS, csv_fields

if TYPE_CHECKING:
    import pandas as pd  # imported where a chunk is parsed: a replay of a clean Azure or Mooncake file never needs it


@dataclass
class Chunk:
    """One chunk of CSV rows and the file line of each."""

    path: Path
    frame: pd.DataFrame
    lines: np.ndarray  # [rows] int64, 1-based file line of each row

    def where(self, row: int) -> str:
        return f"{self.path}:{int(self.lines[row])}"

    def column(self, name: str) -> pd.Series:
        if name not in self.frame.columns:
            raise ServesimError(f"{self.path}: missing column {name!r} (the header has "
                                f"{','.join(self.frame.columns)})")
        return self.frame[name]

    def text(self, name: str) -> pd.Series:
        return self.column(name).astype(str).str.strip()

    def numbers(self, name: str) -> np.ndarray:
        """A numeric column as float64: every value present, a finite number, not negative."""
        import pandas as pd

        col = self.column(name)
        if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
            values = col.to_numpy(dtype=np.float64)  # pandas parsed every value: none is missing
        else:
            text = col.astype(str).str.strip()
            values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
            bad = np.isnan(values)
            if bad.any():
                row = int(np.argmax(bad))
                what = "missing" if text.iloc[row] == "" else f"not a number: {text.iloc[row]!r}"
                raise ServesimError(f"{self.where(row)}: {name} is {what}")
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            row = int(np.argmax(bad))
            what = "must be finite" if not np.isfinite(values[row]) else "must not be negative"
            raise ServesimError(f"{self.where(row)}: {name} {what}, got {col.iloc[row]}")
        return values

    def counts(self, name: str) -> np.ndarray:
        """A token-count column as int64: whole numbers from 0 to MAX_TOKENS."""
        values = self.numbers(name)
        frac = values != np.floor(values)
        if frac.any():
            row = int(np.argmax(frac))
            raise ServesimError(f"{self.where(row)}: {name} must be a whole number, got {self.column(name).iloc[row]}")
        big = values > MAX_TOKENS
        if big.any():
            row = int(np.argmax(big))
            raise ServesimError(f"{self.where(row)}: {name} is {self.column(name).iloc[row]}, more tokens than any "
                                f"model takes (at most 2**31 = {MAX_TOKENS:,})")
        return values.astype(np.int64)


def csv_chunks(path: Path, handle: BinaryIO, header: list[str], header_line: int,
               chunk_rows: int) -> Iterator[Chunk]:
    """The data rows in chunks, blank lines left out; a row's line is header_line + 1 + its index."""
    import pandas as pd

    _check_first_row(path, handle, header, header_line)
    text_columns = {name: str for name in header if name in TEXT_COLUMNS}
    reader = pd.read_csv(handle, header=None, names=header, index_col=False, skip_blank_lines=False,
                         keep_default_na=False, dtype=text_columns, chunksize=chunk_rows, encoding="utf-8")
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", pd.errors.ParserWarning)  # never printed: an error names it
                warnings.simplefilter("ignore", pd.errors.DtypeWarning)  # each column is checked as text too
                frame = next(reader)
        except StopIteration:
            return
        except pd.errors.ParserError as e:
            raise ServesimError(_parser_error(path, str(e).strip(), header_line)) from None
        except pd.errors.ParserWarning as e:
            raise ServesimError(f"{path}:{header_line + 1}: not a readable CSV row ({str(e).strip()})") from None
        except UnicodeDecodeError:
            raise ServesimError(f"{path}: not a text file (not UTF-8)") from None
        frame = _without_blank_rows(frame)
        yield Chunk(path, frame, frame.index.to_numpy(dtype=np.int64) + header_line + 1)


# The most of the first row read to count its fields: a cut row has no more fields than the whole.
FIRST_ROW_BYTES = 1 << 24


def _check_first_row(path: Path, handle: BinaryIO, header: list[str], header_line: int) -> None:
    """The row after the header, read and put back (plain and gzip files can seek back)."""
    position = handle.tell()
    raw = handle.readline(FIRST_ROW_BYTES)
    handle.seek(position)
    fields = csv_fields(raw.decode("utf-8", errors="replace"))
    if len(fields) > len(header):
        raise ServesimError(f"{path}:{header_line + 1}: expected {len(header)} fields as in the header, "
                            f"saw {len(fields)}")


def _parser_error(path: Path, message: str, header_line: int) -> str:
    """pandas counts lines from the one after the header; name the file's line instead."""
    m = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", message)
    if m:
        expected, line, saw = (int(g) for g in m.groups())
        return f"{path}:{line + header_line}: expected {expected} fields as in the header, saw {saw}"
    return f"{path}: not a readable CSV file ({message})"


def _without_blank_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of a blank line have every field empty; a chunk with a numeric column has none."""
    import pandas as pd

    if len(frame.columns) == 0 or any(pd.api.types.is_numeric_dtype(frame[c]) for c in frame.columns):
        return frame
    blank = np.ones(len(frame), dtype=bool)
    for name in frame.columns:
        blank &= (frame[name].astype(str).str.strip() == "").to_numpy()
    return frame[~blank] if blank.any() else frame
