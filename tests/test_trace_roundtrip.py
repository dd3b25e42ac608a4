"""Convert then read back gives the same requests (hypothesis), for written and published traces."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.app.cli import main
from tests.test_trace_readers import BURSTGPT, VIDUR, same_requests
from traces import AZURE_CONV_SAMPLE, MOONCAKE_SAMPLE, read_trace, writers
from traces.trace import Trace
from traces.writers import _pieces, write_canonical

ID_TEXT = st.text(alphabet="abcXYZ019_-., \"'", min_size=1, max_size=8).filter(lambda s: s == s.strip())


@st.composite
def traces(draw):
    n = draw(st.integers(1, 25))
    times = sorted(draw(st.lists(st.floats(0, 1e7, allow_nan=False, allow_infinity=False), min_size=n, max_size=n)))
    arrival = np.array(times) - times[0]
    prompt = np.array(draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n)), dtype=np.int64)
    output = np.array(draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n)), dtype=np.int64)
    request_ids = draw(st.none() | st.lists(ID_TEXT, min_size=n, max_size=n, unique=True))
    hash_ids, block = None, 512
    if draw(st.booleans()):
        block = draw(st.sampled_from([1, 16, 512]))
        hash_ids = [np.array(draw(st.lists(st.integers(0, 2**40), min_size=math.ceil(p / block),
                                           max_size=math.ceil(p / block))), dtype=np.int64)
                    for p in prompt.tolist()]
    priority = draw(st.none() | st.lists(st.integers(-5, 5), min_size=n, max_size=n))
    return Trace(arrival, prompt, output, request_ids, hash_ids, block, source="hypothesis",
                 priority=None if priority is None else np.array(priority, dtype=np.int64))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(trace=traces(), gz=st.booleans(), chunk_rows=st.sampled_from([1, 4, 1000]),
       max_ids=st.sampled_from([1, 7, 1 << 20]))
def test_write_then_read_gives_the_same_requests(tmp_path, monkeypatch, trace, gz, chunk_rows, max_ids):
    monkeypatch.setattr(writers, "MAX_IDS_PER_PIECE", max_ids)  # pieces cut by hash ids too
    path = tmp_path / ("t.csv.gz" if gz else "t.csv")
    write_canonical(trace, path, chunk_rows=chunk_rows)
    back = read_trace(path, chunk_rows=chunk_rows)
    assert back.format == "canonical" and not back.warnings
    same_requests(back, trace)


@settings(max_examples=60, deadline=None)
@given(trace=traces(), chunk_rows=st.integers(1, 6), max_ids=st.integers(1, 40))
def test_pieces_cover_every_row_once_within_their_limits(trace, chunk_rows, max_ids):
    writers.MAX_IDS_PER_PIECE, before = max_ids, writers.MAX_IDS_PER_PIECE
    try:
        pieces = _pieces(trace, chunk_rows)
    finally:
        writers.MAX_IDS_PER_PIECE = before
    assert pieces[0][0] == 0 and pieces[-1][1] == len(trace)
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    for start, end in pieces:
        assert 0 < end - start <= chunk_rows
        if trace.hash_ids is not None and end - start > 1:  # one row alone may hold more ids
            assert sum(len(ids) for ids in trace.hash_ids[start:end]) <= max_ids


def test_convert_published_traces_keeps_their_requests(tmp_path, capsys):
    for source in (MOONCAKE_SAMPLE, AZURE_CONV_SAMPLE, BURSTGPT, VIDUR):
        out = tmp_path / (Path(source).stem + ".csv")
        assert main(["trace", "convert", str(source), str(out)]) == 0
        assert f"to {out}" in capsys.readouterr().out
        same_requests(read_trace(out), read_trace(source))
    header = (tmp_path / "mooncake_synthetic_last200.csv").read_text().splitlines()[0]
    assert header == "arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens"
