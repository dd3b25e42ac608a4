"""A replay of a clean Azure file or a Mooncake file never imports pandas (its import is about a
third of a replay's second), yet reads, writes and draws exactly what the pandas code does: the
Azure reader without pandas against pd.to_datetime, one run's page against report_html's of a
one-row DataFrame, steps.parquet's arrays against pa.array's."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces.readers
from reports.digest import summary_row
from reports.html import report_html, run_report_html
from reports.outcomes import RequestOutcomes
from reports.run_tables import _arrow_from_numpy
from sim.app.cli import main
from sim.errors import ServesimError
from traces import AZURE_CONV_SAMPLE, MOONCAKE_SAMPLE, read_trace
from traces.builder import TraceBuilder
from traces.formats import CHUNK_ROWS
from traces.published import read_plain_azure
from traces.textfile import first_line, open_trace

ROOT = Path(__file__).resolve().parents[1]
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
AZURE_CODE_CUT = Path(__file__).parent / "data" / "traces" / "azure_code_2023_first100.csv"

# Run `sim replay` in a fresh interpreter and say whether pandas was imported by the end.
WRAPPER = """
import sys
from sim.app.cli import main
rc = main(sys.argv[1:])
print("PANDAS_LOADED" if "pandas" in sys.modules else "PANDAS_NOT_LOADED")
sys.exit(rc)
"""


@pytest.mark.parametrize("args", [
    [str(AZURE_CONV_SAMPLE)],
    [str(MOONCAKE_SAMPLE)],
    [str(MOONCAKE_SAMPLE), "--max-model-len", "16384"],  # some rejected: the summary counts their reasons
    [str(AZURE_CONV_SAMPLE), "--replicas", "2", "--limit", "200"],
], ids=["azure", "mooncake", "mooncake-rejections", "azure-two-replicas"])
def test_a_replay_never_imports_pandas(tmp_path, args):
    cmd = [sys.executable, "-c", WRAPPER, "replay", *args, "--policy", "chunked", "--out", str(tmp_path / "run"),
           "--quiet"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "PANDAS_NOT_LOADED"
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"report.html", "digest.json", "steps.parquet"}
    if "--max-model-len" in args:
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["reject_reasons"]


# The Azure reader without pandas.

def pandas_ns(stamps: list[str]) -> np.ndarray:
    """What the pandas reader (AzureRows) makes of zone-less stamps."""
    return pd.to_datetime(pd.Series(stamps), format="ISO8601").to_numpy().astype("datetime64[ns]").astype(np.int64)


def plain_ns(path: Path) -> np.ndarray | None:
    """The nanoseconds read_plain_azure gives the builder; None when it leaves the file to pandas."""
    builder = TraceBuilder(path, "azure", "TIMESTAMP")
    with open_trace(path) as handle:
        first, line = first_line(path, handle)
        position = handle.tell()
        if not read_plain_azure(builder, handle, first.split(","), line, CHUNK_ROWS):
            assert handle.tell() == position and not builder.arrival  # put back, nothing added
            return None
    return np.concatenate(builder.arrival)


def write_azure(tmp_path: Path, rows: list[str], name: str = "t.csv", end: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes((end.join([HEADER, *rows]) + end).encode())
    return path


@pytest.fixture
def pandas_reader(monkeypatch):
    """read_trace with every Azure file left to the pandas reader, as before the plain one."""
    def read(path, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(traces.readers, "read_plain_azure", lambda *args: False)
            return read_trace(path, **kwargs)
    return read


def same_trace(a, b) -> None:
    assert a.arrival_s.dtype == b.arrival_s.dtype and a.arrival_s.tobytes() == b.arrival_s.tobytes()
    assert a.prompt_tokens.dtype == b.prompt_tokens.dtype and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert a.output_tokens.dtype == b.output_tokens.dtype and np.array_equal(a.output_tokens, b.output_tokens)
    assert (a.warnings, a.dropped, a.format, a.source) == (b.warnings, b.dropped, b.format, b.source)


EDGE_STAMPS = [
    "2023-11-16 18:15:46",  # no fraction
    "2023-11-16 18:15:46.6",
    "2023-11-16 18:15:46.68",
    "2023-11-16 18:15:46.680",
    "2023-11-16 18:15:46.6805",
    "2023-11-16 18:15:46.68059",
    "2023-11-16 18:15:46.680590",
    "2023-11-16 18:15:46.6805900",  # Azure 2023's seven digits
    "2023-11-16 18:15:46.68059001",
    "2023-11-16 18:15:46.680590012",  # nanoseconds
    "2023-11-16 18:15:46.000000001",
    "2023-11-16 23:59:59.999999999",  # midnight rollover
    "2023-11-17 00:00:00",
    "2023-11-17 00:00:00.0000001",
    "2023-11-30 23:59:59.5",  # month end
    "2023-12-01 00:00:00.5",
    "2023-12-31 23:59:59.9999999",  # year end
    "2024-01-01 00:00:00.0000000",
    "2024-02-28 12:00:00",
    "2024-02-29 12:00:00",  # leap day
    "2024-03-01T12:00:00.25",  # ISO's T
    "2023-11-16 00:00:00",
]


def test_plain_reader_gives_pandas_nanoseconds_for_edge_stamps(tmp_path):
    path = write_azure(tmp_path, [f"{s},10,2" for s in EDGE_STAMPS])
    assert plain_ns(path).tolist() == pandas_ns(EDGE_STAMPS).tolist()


def test_plain_reader_gives_pandas_nanoseconds_for_random_stamps(tmp_path):
    rng = np.random.default_rng(0)
    ns = rng.integers(np.datetime64("1990-01-01", "ns").astype(np.int64), np.datetime64("2100-01-01", "ns").astype(np.int64),
                      3000)
    stamps = []
    for value, digits in zip(ns.tolist(), rng.integers(0, 10, len(ns)).tolist()):
        text = str(np.datetime64(value, "ns")).replace("T", " ")  # 2023-11-16 18:15:46.680590012
        stamps.append(text[:20 + digits] if digits else text[:19])  # 0 to 9 fraction digits
    path = write_azure(tmp_path, [f"{s},10,2" for s in stamps])
    assert plain_ns(path).tolist() == pandas_ns(stamps).tolist()


@pytest.mark.parametrize("path", [AZURE_CONV_SAMPLE, AZURE_CODE_CUT], ids=["conv-sample", "code-cut-crlf"])
def test_plain_reader_reads_the_published_cuts_as_pandas_does(path, pandas_reader):
    stamps = [line.split(",")[0] for line in path.read_text().splitlines()[1:]]
    assert plain_ns(path).tolist() == pandas_ns(stamps).tolist()
    same_trace(read_trace(path), pandas_reader(path))


@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_plain_reader_drops_sorts_and_warns_as_the_pandas_reader(tmp_path, pandas_reader, end):
    rows = ["2023-11-16 18:15:46.5,10,2", "2023-11-16 18:15:45.25,0,2", "2023-11-16 18:15:44,0007,3",
            "2023-11-16 18:15:47,5,0", "2023-11-16 18:15:43.1,8,1"]
    path = write_azure(tmp_path, rows, end=end)
    assert plain_ns(path) is not None
    t = read_trace(path, chunk_rows=2)
    same_trace(t, pandas_reader(path, chunk_rows=2))
    assert t.dropped == {"0 ContextTokens": 1, "0 GeneratedTokens": 1} and len(t.warnings) == 3
    path.write_bytes(path.read_bytes().rstrip())  # no final line end
    same_trace(read_trace(path), pandas_reader(path))


def test_plain_reader_reads_gzip(tmp_path, pandas_reader):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(AZURE_CODE_CUT.read_bytes()))
    assert plain_ns(path) is not None
    same_trace(read_trace(path), pandas_reader(path))


@pytest.mark.parametrize("row", [
    "2023-11-16 18:15:46.5+00:00,10,2",  # a zone
    "2023-11-16 18:15:46.5Z,10,2",
    "2023-11-16 18:15:46.1234567890,10,2",  # ten fraction digits
    "2023-02-30 18:15:46.5,10,2",  # no such date
    "2023-11-16 24:00:00,10,2",
    "2023-11-16 18:60:00,10,2",
    "2023-11-16 18:15:60,10,2",
    "1600-11-16 18:15:46.5,10,2",  # before pandas' nanoseconds
    "2300-11-16 18:15:46.5,10,2",
    "2023-11-16 18:15:46.,10,2",
    " 2023-11-16 18:15:46.5,10,2",
    '"2023-11-16 18:15:46.5",10,2',  # quoted
    "2023-11-16 18:15:46.5,10.0,2",
    "2023-11-16 18:15:46.5,-3,2",
    "2023-11-16 18:15:46.5,10,2,",  # a field too many
    "2023-11-16 18:15:46.5,10",
    "2023-11-16 18:15:46.5,3000000000,2",  # above MAX_TOKENS
    "",  # a blank line
    "soon,10,2",
])
def test_plain_reader_leaves_anything_unusual_to_pandas(tmp_path, pandas_reader, row):
    path = write_azure(tmp_path, ["2023-11-16 18:15:45,10,2", row, "2023-11-16 18:15:47,10,2"])
    assert plain_ns(path) is None
    try:
        expected = pandas_reader(path)
    except ServesimError as e:
        with pytest.raises(ServesimError) as got:
            read_trace(path)
        assert str(got.value) == str(e)  # the same message, file:line
    else:
        same_trace(read_trace(path), expected)


def test_plain_reader_leaves_other_headers_and_empty_files_to_pandas(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("ContextTokens,TIMESTAMP,GeneratedTokens\n10,2023-11-16 18:15:45,2\n")
    assert plain_ns(path) is None
    assert read_trace(path).prompt_tokens.tolist() == [10]
    path.write_text(f"{HEADER}\n")
    assert plain_ns(path) is None
    with pytest.raises(ServesimError, match="the trace has a header but no requests"):
        read_trace(path)


# One run's page and steps table, without pandas.

@pytest.mark.parametrize("args", [
    [str(AZURE_CONV_SAMPLE), "--limit", "80"],
    [str(MOONCAKE_SAMPLE), "--limit", "40", "--steps", "none"],
    [str(AZURE_CONV_SAMPLE), "--limit", "80", "--replicas", "2", "--rate-scale", "4"],
], ids=["azure", "mooncake", "two-replicas"])
def test_a_run_page_is_report_htmls_page_of_its_row(tmp_path, args):
    assert main(["replay", *args, "--out", str(tmp_path), "--quiet"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    digest = json.loads((tmp_path / "digest.json").read_text())
    page = (tmp_path / "report.html").read_text()
    assert page == run_report_html(summary, digest)
    trace = Path(summary["options"]["trace"]).name
    title = f"{summary['options']['scheduler']['policy']} on {trace}"
    options = summary["options"]
    subtitle = f"{options['model']} on {options['hardware']}, {options['backend']} backend"
    subtitle += "; trace " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in options["trace_transforms"].items())
    for dig in (digest, None, {**digest, "timeline": {"start_s": [], "num_waiting": []}}):
        frame = pd.DataFrame([summary_row(summary, dig)])
        assert run_report_html(summary, dig) == report_html(frame, title=title, subtitle=subtitle)


def test_steps_table_arrays_are_pa_arrays():
    for values in (np.arange(7, dtype=np.int64), np.arange(7, dtype=np.uint16), np.linspace(0, 1, 9, dtype=np.float32),
                   np.array([1.5, np.nan, np.inf]), np.array([True, False, True] * 5), np.arange(20.0)[::3],
                   np.array([], dtype=np.int64), np.array([], dtype=bool)):
        ours, theirs = _arrow_from_numpy(values), pa.array(values)
        assert ours.type == theirs.type and ours.null_count == theirs.null_count == 0
        assert ours.to_pylist() == theirs.to_pylist() or np.array_equal(ours.to_numpy(), theirs.to_numpy(), equal_nan=True)


def test_reject_reasons_are_ordered_as_pandas_orders_them():
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 5, 16, 17, 40, 200):
        for _ in range(20):
            outcomes = RequestOutcomes(None)
            outcomes.reject_reasons = {f"reason {i}": int(n) for i, n in enumerate(rng.integers(1, 4, size))}
            expected = pd.Series(outcomes.reject_reasons, dtype=np.int64).sort_values(ascending=False)
            got = outcomes.reject_reason_counts()
            assert list(got.items()) == [(k, int(v)) for k, v in expected.items()]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_plain_reader_puts_back_a_file_whose_late_chunk_is_unusual(tmp_path, pandas_reader, compress):
    """Chunks read cleanly, then one that is not: the pandas reader reads the whole file from its header."""
    rows = [f"2023-11-16 18:15:{s:02d}.5,10,2" for s in range(7)] + ["2023-11-16 18:15:50.5+00:00,10,2"]
    path = write_azure(tmp_path, rows)
    if compress:
        path.write_bytes(gzip.compress(path.read_bytes()))
    try:
        expected = pandas_reader(path, chunk_rows=3)
    except ServesimError as e:
        with pytest.raises(ServesimError) as got:
            read_trace(path, chunk_rows=3)
        assert str(got.value) == str(e)
    else:
        same_trace(read_trace(path, chunk_rows=3), expected)
    with open_trace(path) as handle:
        first, line = first_line(path, handle)
        position = handle.tell()
        assert not read_plain_azure(TraceBuilder(path, "azure", "TIMESTAMP"), handle, first.split(","), line, 3)
        assert handle.tell() == position


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("0123456789", max_size=9).map(str.encode), min_size=1, max_size=30),
       st.lists(st.text("0123456789", min_size=2, max_size=2).map(str.encode), min_size=1, max_size=30))
def test_plain_reader_reads_fractions_and_two_digit_fields_as_int_does(fractions, pairs):
    from traces.published import _nanoseconds, _two_digits

    assert _nanoseconds(tuple(fractions)).tolist() == [int(f.ljust(9, b"0")) if f else 0 for f in fractions]
    assert _nanoseconds((b"",) * 3).tolist() == [0, 0, 0]
    assert _two_digits(tuple(pairs)).tolist() == [int(p) for p in pairs]
