"""Hostile trace files: a field over csv's default limit, CR-only and stray CR line ends, pipes,
FIFOs and devices, a first line with no end, nested or null Mooncake hash_ids, JSON nested too
deeply, Azure stamps outside pandas' nanosecond years. Each is read right, or refused with one
line naming the file and line (exit 2), never a traceback or a hang."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from sim.app.cli import main
from sim.errors import ServesimError
from traces import read_trace


def stats_error(capsys, path) -> str:
    """`sim trace stats PATH` exits 2 with one error line; the line, without its prefix."""
    assert main(["trace", "stats", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and err.count("\n") == 1, err
    return err.removeprefix("sim: error: ").strip()


def refused(path) -> str:
    with pytest.raises(ServesimError) as e:
        read_trace(path)
    return str(e.value)


# 1. A field longer than Python csv's default limit (131,072 characters).

def test_synth_hash_ids_over_csv_field_limit_read_back(tmp_path, capsys):
    path = tmp_path / "t.csv"
    assert main(["trace", "synth", str(path), "--num-requests", "2", "--rate", "1", "--prompt-len", "fixed:400000",
                 "--output-len", "fixed:5", "--turns", "uniform:2:2"]) == 0
    assert max(len(line) for line in path.read_text().splitlines()) > 131_072
    assert main(["trace", "stats", str(path)]) == 0
    trace = read_trace(path)
    assert len(trace) == 2 and all(len(ids) == -(-p // trace.hash_block_tokens)
                                                 for ids, p in zip(trace.hash_ids, trace.prompt_tokens))


def test_long_first_row_field_with_a_field_too_many_is_named(tmp_path):
    ids = " ".join(map(str, range(40_000)))
    path = tmp_path / "t.csv"
    path.write_text(f"arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens\n0,40000,5,{ids},1,9\n")
    assert refused(path) == f"{path}:2: expected 5 fields as in the header, saw 6"


def test_long_header_is_refused_in_one_short_line(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("x" * 300_000 + ",y\n1,2\n")
    message = stats_error(capsys, path)
    assert "unknown trace format" in message and len(message) < 1000


# 2. CR-only line ends (old Mac) are read as LF; a stray CR in the header is named.

CR_FILES = {
    "canonical": "arrival_s,prompt_tokens,output_tokens,hash_ids\n0,10,5,1\n1.5,600,7,1 2\n\n2,3,4,9\n",
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,10,5\n2023-11-16 18:15:47,3,4\n",
    "azure-zoned": "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00+00:00,10,5\n"
                   "2024-05-10 00:00:01+00:00,3,4\n",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0,ChatGPT,10,5,15,API\n"
                "2,GPT-4,3,4,7,API\n",
    "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5\n0.25,3,4\n",
    "mooncake": '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
                '{"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n',
}


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", list(CR_FILES))
def test_cr_only_line_ends_read_as_lf(tmp_path, name, gz):
    suffix = ".jsonl" if name == "mooncake" else ".csv"
    lf, cr = tmp_path / f"lf{suffix}", tmp_path / f"cr{suffix}"
    lf.write_bytes(CR_FILES[name].encode())
    data = CR_FILES[name].replace("\n", "\r").encode()
    if gz:
        cr = cr.with_name(cr.name + ".gz")
        data = gzip.compress(data)
    cr.write_bytes(data)
    want, got = read_trace(lf), read_trace(cr)
    for column in ("arrival_s", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(got, column), getattr(want, column)), column
    assert [ids.tolist() for ids in got.hash_ids or []] == [ids.tolist() for ids in want.hash_ids or []]


@pytest.mark.parametrize("content, message", [
    # a CR-only file names its bad line as an LF file would
    (b"arrival_s,prompt_tokens,output_tokens\r0,10,5\r1,ten,5\r", ":3: prompt_tokens is not a number: 'ten'"),
    # a stray CR in the header is named
    (b"arrival_s,prompt_tokens,output_tokens\r,request_id\n0,10,5,a\n",
     ":1: a carriage return (CR) inside the header line; save the file with one kind of line end"),
    # a stray CR in a row ends it, as pandas reads it
    (b"arrival_s,prompt_tokens,output_tokens\n0,10\r,5\n1,2,3\n", ":3: arrival_s is missing"),
])
def test_carriage_returns_where_they_do_not_belong_are_named_by_line(tmp_path, capsys, content, message):
    path = tmp_path / "t.csv"
    path.write_bytes(content)
    assert stats_error(capsys, path) == f"{path}{message}"


# 3. Pipes, FIFOs and devices are refused before they are opened; a first line with no end is not read whole.

def test_fifo_without_writer_is_refused_not_waited_on(tmp_path, capsys):
    path = tmp_path / "fifo.csv"
    os.mkfifo(path)
    assert stats_error(capsys, path) == (f"{path}: not a regular file (a pipe, a device...); "
                                         f"save the trace to a file first")


def test_pipe_is_refused(capsys):
    read, write = os.pipe()
    try:
        os.write(write, b"arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
        path = Path(f"/dev/fd/{read}")
        if not path.exists():
            pytest.skip("no /dev/fd")
        assert stats_error(capsys, path).endswith(": not a regular file (a pipe, a device...); "
                                                  "save the trace to a file first")
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_devices_are_refused(capsys, device):
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    assert stats_error(capsys, device) == (f"{device}: not a regular file (a pipe, a device...); "
                                           f"save the trace to a file first")


def test_first_line_without_end_is_refused_after_a_megabyte(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_bytes(b"arrival_s," + b"x" * (3 << 20))
    assert stats_error(capsys, path) == (f"{path}:1: the line is longer than 1,048,576 bytes: not a CSV header "
                                         f"or JSON (or the file has no line ends)")


def test_json_first_line_over_a_megabyte_is_read(tmp_path):
    ids = list(range(200_000))
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 512 * len(ids), "output_length": 5,
                                "hash_ids": ids}) + "\n")
    assert path.stat().st_size > 1 << 20
    assert read_trace(path).hash_ids[0].tolist() == ids


def test_json_first_line_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr("traces.textfile.HEAD_BYTES", 1024)
    monkeypatch.setattr("traces.textfile.JSON_LINE_BYTES", 4096)
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "x": "' + "y" * 10_000 + '"}\n')
    assert refused(path) == f"{path}:1: the line is longer than 4,096 bytes: not a trace"


# 4. Mooncake hash_ids: nested, null, nested too deeply.

ROW = '"timestamp": 1, "input_length": 1000, "output_length": 5'


@pytest.mark.parametrize("ids,shown", [
    ("[[1, 2], [3]]", "[[1, 2], [3]]"),
    ("[[1], [2]]", "[[1], [2]]"),  # lists of one length: a 2-d array, not two ids
    ("null", "null"),
    ('["1", "2"]', '["1", "2"]'),
    ("[1.5, 2]", "[1.5, 2]"),
    ("[" * 900 + "]" * 900, "[" * 40),
])
def test_mooncake_hash_ids_not_a_flat_list_are_refused(tmp_path, capsys, ids, shown):
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{{ROW}, "hash_ids": {ids}}}\n')
    assert stats_error(capsys, path) == (f"{path}:1: hash_ids must be a list of whole numbers, each a 64-bit integer, "
                                         f"got {shown}")


def test_mooncake_hash_ids_missing_after_earlier_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{{ROW}, "hash_ids": [1, 2]}}\n{{{ROW}}}\n')
    assert refused(path) == f"{path}:2: missing field 'hash_ids' (earlier lines have it)"


def test_mooncake_hash_ids_after_a_first_line_without_them_are_refused(tmp_path):
    """Found by a review with odd traces: the first line decided, and a later line's hash_ids were
    dropped without a word (no prefix-cache hits where the file says prompts share blocks)."""
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{{ROW}}}\n{{{ROW}}}\n{{{ROW}, "hash_ids": [1, 2]}}\n')
    assert refused(path) == f"{path}:3: has hash_ids and {path}:1 has none: give every line hash_ids, or none"


@pytest.mark.parametrize("line", [2, 3])
def test_mooncake_json_nested_too_deeply(tmp_path, capsys, line):
    path = tmp_path / "t.jsonl"
    good = f'{{{ROW}, "hash_ids": [1, 2]}}\n'
    deep = f'{{{ROW}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    path.write_text(good * (line - 1) + deep)
    assert stats_error(capsys, path) == f"{path}:{line}: JSON nested too deeply to read"


def test_vllm_bench_json_nested_too_deeply(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text('{\n"start_times": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    assert stats_error(capsys, path) == f"{path}: JSON nested too deeply to read"


# 5. Azure stamps outside pandas' nanosecond years (1677-2262) are named as written.

@pytest.mark.parametrize("stamps,line", [
    (["9999-12-31 23:59:59", "2023-11-16 18:15:47"], 2),
    (["2023-11-16 18:15:47", "2263-01-01 00:00:00"], 3),
    (["2023-11-16 18:15:47", "1600-01-01 00:00:00"], 3),
    (["2023-11-16 18:15:47+00:00", "9999-12-31 23:59:59+00:00"], 3),
    (["2024-05-10 00:00:00+00:00", "2262-04-11 23:00:00-05:00"], 3),  # in 2262 as written, past it in UTC
])
def test_azure_stamps_outside_nanosecond_years_are_named(tmp_path, capsys, stamps, line):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},10,10\n" for s in stamps))
    assert stats_error(capsys, path) == (f"{path}:{line}: TIMESTAMP {stamps[line - 2]!r} is outside the times "
                                         f"servesim reads (1677-09-22 to 2262-04-11: nanoseconds since 1970 in "
                                         f"64 bits)")
