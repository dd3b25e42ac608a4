"""NVIDIA AIPerf's per-request records as a trace: the JSON Lines file `profile_export.jsonl` that
`aiperf profile` writes (ai-dynamo/aiperf, docs/tutorials/working-with-profile-exports.md; the record is
`MetricRecordInfo`, src/aiperf/common/models/record_models.py). Each line is one request:

    {"metadata": {"request_start_ns": ..., "benchmark_phase": "profiling", "turn_index": 0, ...},
     "metrics": {"input_sequence_length": {"value": 550, "unit": "tokens"},
                 "output_sequence_length": {"value": 9, "unit": "tokens"},
                 "time_to_first_token": {"value": 4.9, "unit": "ms"},
                 "request_latency": {"value": 297.5, "unit": "ms"}, ...},
     "error": null}

A request is sent at its `request_start_ns` (the client's clock, nanoseconds since 1970) with
`input_sequence_length` prompt tokens and `output_sequence_length` output tokens (reasoning tokens
included). AIPerf writes a record when its request finishes, so the file is in finishing order; the
replay sends the requests in the order they were sent. Its requests.csv's request_id is the record's
line in the file, and each request's prediction sits beside AIPerf's measurement of it (AIPerf's
metrics reference): TTFT `time_to_first_token`, E2E `request_latency`, TPOT its inter-token latency
(E2E - TTFT) / (OSL - 1), as vLLM's client defines TPOT too.

A failed request (a record with an `error`, a cancelled one) is dropped and counted, as every reader
drops what cannot be replayed. A record of another phase than `profiling` (a warm-up request) is
replayed, for it loaded the server, but not compared; a later turn of a multi-turn conversation
(`turn_index` > 0) is replayed as a prompt of its own, and a warning says that the prompts it shares
with its conversation's earlier turns are not known to this replay.
"""

from __future__ import annotations

import json
from typing import BinaryIO

import numpy as np

from sim.errors import ServesimError
from traces.builder import TraceBuilder
from traces.formats import AIPERF, json_count, json_line, json_number, latency_s
from traces.textfile import text_lines

SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}  # AIPerf's time units
MAX_NS = 2**63 - 1  # an int64 nanosecond stamp (the year 2262)
# How far a TTFT may pass its E2E and be the same time: one written in another unit than the other
# (1.3 ms and 0.0013 s) differs from it in the last bits once both are in seconds.
SAME_TIME = 1e-9


def read_aiperf(builder: TraceBuilder, handle: BinaryIO, first: str, first_line: int) -> None:
    path = builder.path
    builder.arrival_per_s = 1e9
    builder.request_ids = []
    rows: list[tuple[int, int, int, int, float, float, bool]] = []  # (start ns, prompt, output, line, ttft, e2e, compared)
    warmup: tuple[int, int] | None = None  # (records, first line) of another phase than profiling
    later_turns: tuple[int, int] | None = None

    for where, line_no, text in text_lines(path, handle, first, first_line):
        record = _record(where, text)
        metadata, metrics, error = record["metadata"], record["metrics"], record.get("error")
        if error is not None or metadata.get("was_cancelled") is True:
            builder.drop("an error (the record's error)" if error is not None else "a cancellation",
                          np.array([True]), np.array([line_no]))
            continue
        if not isinstance(metrics, dict):
            raise ServesimError(f"{where}: metrics must be a JSON object for a request without an error, "
                                f"got {json.dumps(metrics)[:40]}")
        start = metadata.get("request_start_ns")
        if start is None:
            raise ServesimError(f"{where}: missing field 'metadata.request_start_ns' (when the client sent the request)")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= MAX_NS:
            raise ServesimError(f"{where}: metadata.request_start_ns must be a whole number of nanoseconds since "
                                f"1970, got {json.dumps(start)[:40]}")
        prompt = json_count(where, "input_sequence_length", _value(where, metrics, "input_sequence_length", "tokens"))
        output = json_count(where, "output_sequence_length", _value(where, metrics, "output_sequence_length", "tokens"))
        ttft = _seconds(where, metrics, "time_to_first_token")
        e2e = _seconds(where, metrics, "request_latency")
        if np.isfinite(ttft) and np.isfinite(e2e) and ttft > e2e * (1 + SAME_TIME):
            raise ServesimError(f"{where}: time_to_first_token {ttft * 1e3:g} ms is past its request_latency "
                                f"{e2e * 1e3:g} ms: the first token cannot come after the last")
        if prompt == 0 or output == 0:  # (dropped before it is counted below as replayed)
            name = "input_sequence_length" if prompt == 0 else "output_sequence_length"
            builder.drop(f"0 {name}", np.array([True]), np.array([line_no]))
            continue
        phase = metadata.get("benchmark_phase", "profiling")
        compared = phase == "profiling"
        if not compared:
            warmup = (1, line_no) if warmup is None else (warmup[0] + 1, warmup[1])
        turn = metadata.get("turn_index", 0)
        if turn not in (0, None):
            later_turns = (1, line_no) if later_turns is None else (later_turns[0] + 1, later_turns[1])
        rows.append((start, prompt, output, line_no, ttft, e2e, compared))
    if warmup is not None:
        builder.warnings.append(f"{path}:{warmup[1]}: {warmup[0]} record(s) of another benchmark phase than profiling "
                                "(warm-up requests): replayed, for they loaded the server, but not compared")
    if later_turns is not None:
        builder.warnings.append(f"{path}:{later_turns[1]}: {later_turns[0]} record(s) are later turns of multi-turn "
                                "conversations (turn_index > 0): each is replayed as a prompt of its own, so the "
                                "prompt it shares with its conversation's earlier turns finds no cached prefix here")
    if not rows:
        return
    rows.sort(key=lambda row: row[0])  # the file is in finishing order; the client sent them in this one
    columns = list(zip(*rows))
    start_ns, prompts, outputs, lines = (np.array(c, dtype=np.int64) for c in columns[:4])
    builder.add(start_ns, prompts, outputs, lines, request_ids=[str(line) for line in lines.tolist()])
    compared = np.array(columns[6], dtype=bool)
    ttfts = np.where(compared, np.array(columns[4], dtype=np.float64), np.nan)
    e2es = np.where(compared, np.array(columns[5], dtype=np.float64), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpots = np.where(outputs >= 2, np.maximum(e2es - ttfts, 0.0) / (outputs - 1), np.nan)  # (SAME_TIME)
    measured = {name: values for name, values in (("ttft_s", ttfts), ("tpot_s", tpots), ("e2e_s", e2es))
                if np.isfinite(values).any()}
    builder.measured = measured or None


def _record(where: str, text: str) -> dict:
    """One line's record: a JSON object with `metadata` (an object) and `metrics`."""
    record = json_line(where, text)
    if not isinstance(record, dict):
        raise ServesimError(f"{where}: expected an AIPerf record (a JSON object with {', '.join(AIPERF)}), "
                            f"got {text[:40]!r}")
    for name in AIPERF:
        if name not in record:
            raise ServesimError(f"{where}: missing field {name!r} (an AIPerf record has {', '.join(AIPERF)})")
    if not isinstance(record["metadata"], dict):
        raise ServesimError(f"{where}: metadata must be a JSON object, got {json.dumps(record['metadata'])[:40]}")
    return record


def _value(where: str, metrics: dict, name: str, unit: str):
    """A metric's value where its unit is `unit` (AIPerf's `{"value": ..., "unit": ...}`)."""
    if name not in metrics:
        raise ServesimError(f"{where}: missing metric {name!r}")
    metric = metrics[name]
    if not isinstance(metric, dict) or "value" not in metric:
        raise ServesimError(f"{where}: {name} must be an object with a value, got {json.dumps(metric)[:40]}")
    if metric.get("unit", unit) != unit:
        raise ServesimError(f"{where}: {name} is in {json.dumps(metric['unit'])[:20]}, expected {unit}")
    return metric["value"]


def _seconds(where: str, metrics: dict, name: str) -> float:
    """A latency metric in seconds (NaN where the record has none: a non-streaming request has no TTFT);
    0, or out of the range a client measures (traces.formats.latency_s), refused."""
    metric = metrics.get(name)
    if metric is None:
        return float("nan")
    if not isinstance(metric, dict) or "value" not in metric:
        raise ServesimError(f"{where}: {name} must be an object with a value, got {json.dumps(metric)[:40]}")
    unit = metric.get("unit", "ms")
    if not isinstance(unit, str) or unit not in SECONDS:
        raise ServesimError(f"{where}: {name} is in {json.dumps(unit)[:20]}; expected one of {', '.join(SECONDS)}")
    value = json_number(where, name, metric["value"])
    if value == 0:
        raise ServesimError(f"{where}: {name} is 0 for a request that did not fail: AIPerf measures more")
    return latency_s(where, name, float(value) * SECONDS[unit], f"{value:g} {unit}")
