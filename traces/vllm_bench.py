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
from sim.jsonable import DuplicateKeyError, loads_unique
from traces.builder import TraceBuilder
from traces.formats import VLLM_BENCH, json_count, json_error, json_number, latency_s
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
        result = loads_unique(text)
    except DuplicateKeyError as e:
        raise ServesimError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ServesimError(f"{path}:{e.lineno + first_line - 1}: not valid JSON ({json_error(e)})") \
            from None
    except RecursionError:
        raise ServesimError(f"{path}: JSON nested too deeply to read") from None
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
    if isinstance(errors, list) and len(errors) != n and any(errors):  # failed ones listed apart: not matched
        builder.warnings.append(f"{path}: errors has {len(errors)} entries for {n} requests, so they cannot be "
                                "matched to requests; a failed request is known by its 0 output tokens alone")
    elif errors is not None:
        errors = per_request_list(builder, result, "errors", n)
        failed = np.array([bool(e) for e in errors])
        builder.drop("an error (in the result's errors)", failed, positions)
        keep &= ~failed
    keep = builder.keep_nonzero(keep, {"input_lens": prompt, "output_lens": output}, positions)
    order = np.argsort(arrival, kind="stable")  # concurrent clients' sends, in the order they were made
    builder.add(arrival[order], prompt[order], output[order], positions[order], keep=keep[order],
                request_ids=[str(i) for i in order.tolist()])
    kept = order[keep[order]]
    builder.measured = measured(builder, result, n, kept, output) or None


def per_request_list(builder: TraceBuilder, result: dict, name: str, n: int) -> list | None:
    """The result's per-request list `name` (None where the result has none, or null); one of
    another length, or not a list, is refused: it cannot be matched to the requests."""
    values = result.get(name)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} entries" if isinstance(values, list) else json.dumps(values)[:40]
        raise ServesimError(f"{builder.path}: {name} must be a list with one entry per request ({n}), got {got}")
    return values


def measured(builder: TraceBuilder, result: dict, n: int, kept: np.ndarray, output: np.ndarray) -> dict[str, np.ndarray]:
    """The kept requests' (`kept`: positions in the lists) measured latencies in seconds, as vLLM's
    bench serve defines them (vllm/benchmarks/serve.py, `calculate_metrics`): TTFT its `ttfts`; E2E
    its `latencies` (the name the saved result gives `RequestFuncOutput.latency`; `e2els` in some
    tools' copies); TPOT (E2E - TTFT) / (output - 1), else the sum of its `itls` over output - 1;
    and, where the server reported its own per-request metrics (`server_ttfts`, vLLM's
    `time_to_first_token_ms` on the final streamed chunk), the server's TTFT. NaN where the file
    does not say (a null server entry; TPOT of a one-token output). A list that is not one entry per
    request, and a request that did not fail with a TTFT or E2E of 0 or a TTFT past its E2E, are
    refused naming it: vLLM's client cannot measure them."""
    out = {name: np.full(len(kept), np.nan) for name in ("ttft_s", "tpot_s", "e2e_s", "server_ttft_s")}
    ttfts, itls, server = (per_request_list(builder, result, name, n) for name in ("ttfts", "itls", "server_ttfts"))
    e2e_name = "latencies" if result.get("latencies") is not None else "e2els"
    e2els = per_request_list(builder, result, e2e_name, n)
    for j, i in enumerate(kept.tolist()):
        where = builder.at(i)
        if server is not None and server[i] is not None:
            out["server_ttft_s"][j] = positive(where, "server_ttfts", server[i])
        if e2els is not None:
            out["e2e_s"][j] = positive(where, e2e_name, e2els[i])
        if ttfts is None:
            continue
        out["ttft_s"][j] = ttft = positive(where, "ttfts", ttfts[i])
        if e2els is not None and ttft > out["e2e_s"][j]:
            raise ServesimError(f"{where}: ttfts {ttft:g} s is past its {e2e_name} {out['e2e_s'][j]:g} s: the first "
                                "token cannot come after the last")
        if output[i] < 2:
            continue
        if e2els is not None:
            out["tpot_s"][j] = (out["e2e_s"][j] - ttft) / (output[i] - 1)
        elif itls is not None:
            gaps = itls[i] if isinstance(itls[i], list) else [itls[i]]
            out["tpot_s"][j] = sum(json_number(builder.at(i), "itls", g) for g in gaps) / (output[i] - 1)
    return {name: values for name, values in out.items() if np.isfinite(values).any()}


def positive(where: str, name: str, value) -> float:
    """A measured latency of a request that did not fail: a number above 0."""
    value = json_number(where, name, value)
    if value == 0:
        raise ServesimError(f"{where}: {name} is 0 for a request that did not fail: vLLM's client measures more")
    return latency_s(where, name, float(value), f"{value:g} s")
