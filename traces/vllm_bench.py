"""vLLM's benchmark results as a trace: the JSON document `vllm bench serve --save-result
--save-detailed` writes (vllm/benchmarks/serve.py, `benchmark`'s result dict), whose per-request
lists give each request's send time (`start_times`, seconds on the client's clock), prompt tokens
(`input_lens`) and output tokens (`output_lens`). A replay of it sends every request when the
measured client did, so its requests.csv (request_id: the request's position in the lists, from 0)
sits beside the file's own measured `ttfts` and `itls`, request for request.

Requests the client counted as failed (a non-empty entry of `errors` where that list is as long as
the others; an output of 0 tokens) are dropped and counted, as every reader drops what cannot be
replayed. A result saved without --save-detailed has no per-request lists, and is refused saying so.
"""

from __future__ import annotations

import json
from typing import BinaryIO

import numpy as np

from sim.errors import ServesimError
from traces.builder import TraceBuilder
from traces.formats import VLLM_BENCH, json_count, json_number
from traces.textfile import decode

MAX_BYTES = 2**31  # a result document larger than this is not one benchmark's


def read_vllm_bench(builder: TraceBuilder, handle: BinaryIO, first: str, first_line: int) -> None:
    path = builder.path
    builder.entries = True
    builder.request_ids = []
    rest = handle.read(MAX_BYTES)
    if handle.read(1):
        raise ServesimError(f"{path}: more than {MAX_BYTES:,} bytes: not one vLLM benchmark result")
    text = first + "\n" + decode(path, first_line + 1, rest)
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServesimError(f"{path}:{e.lineno + first_line - 1}: not valid JSON ({e.msg} at column {e.colno})") \
            from None
    if not isinstance(result, dict):
        raise ServesimError(f"{path}: expected one JSON object (vLLM's bench serve result), got {type(result).__name__}")
    missing = [name for name in VLLM_BENCH if name not in result]
    if missing:
        raise ServesimError(f"{path}: a vLLM bench serve result without {', '.join(missing)}: its per-request lists "
                            f"are saved with --save-result --save-detailed")
    lists = {name: result[name] for name in VLLM_BENCH}
    for name, values in lists.items():
        if not isinstance(values, list):
            raise ServesimError(f"{path}: {name} must be a list, got {json.dumps(values)[:40]}")
    n = len(lists["start_times"])
    for name, values in lists.items():
        if len(values) != n:
            raise ServesimError(f"{path}: {name} has {len(values)} entries and start_times {n}: one per request each")
    if n == 0:
        raise ServesimError(f"{path}: the result holds no requests")
    arrival, prompt, output = (
        np.array([check(builder.at(i), name, v) for i, v in enumerate(lists[name])], dtype=dtype)
        for name, check, dtype in (("start_times", json_number, np.float64), ("input_lens", json_count, np.int64),
                                   ("output_lens", json_count, np.int64)))
    positions = np.arange(n, dtype=np.int64)
    keep = np.ones(n, dtype=bool)
    errors = result.get("errors")
    if isinstance(errors, list) and len(errors) == n:
        failed = np.array([bool(e) for e in errors])
        builder.drop("a failed request (errors)", failed, positions)
        keep &= ~failed
    keep = builder.keep_nonzero(keep, {"input_lens": prompt, "output_lens": output}, positions)
    order = np.argsort(arrival, kind="stable")  # concurrent clients' sends, in the order they were made
    builder.add(arrival[order], prompt[order], output[order], positions[order], keep=keep[order],
                request_ids=[str(i) for i in order.tolist()])
    kept = order[keep[order]]
    builder.measured = measured(builder, result, n, kept, output)


def measured(builder: TraceBuilder, result: dict, n: int, kept: np.ndarray, output: np.ndarray) -> dict[str, np.ndarray]:
    """The kept requests' (`kept`: positions in the lists) measured TTFT and TPOT in seconds, as
    vLLM's bench serve defines them (vllm/benchmarks/serve.py, `calculate_metrics`): TTFT its
    `ttfts`, TPOT (E2E - TTFT) / (output - 1) from its `e2els`, else the sum of its `itls` over
    output - 1; NaN where the file does not say (or the output is one token)."""
    ttft = np.full(len(kept), np.nan)
    tpot = np.full(len(kept), np.nan)
    ttfts, e2els, itls = result.get("ttfts"), result.get("e2els"), result.get("itls")
    if not (isinstance(ttfts, list) and len(ttfts) == n):
        return {"ttft_s": ttft, "tpot_s": tpot}
    for j, i in enumerate(kept.tolist()):
        ttft[j] = json_number(builder.at(i), "ttfts", ttfts[i])
        if output[i] < 2:
            continue
        if isinstance(e2els, list) and len(e2els) == n:
            tpot[j] = (json_number(builder.at(i), "e2els", e2els[i]) - ttft[j]) / (output[i] - 1)
        elif isinstance(itls, list) and len(itls) == n:
            gaps = itls[i] if isinstance(itls[i], list) else [itls[i]]
            tpot[j] = sum(json_number(builder.at(i), "itls", g) for g in gaps) / (output[i] - 1)
    return {"ttft_s": ttft, "tpot_s": tpot}

