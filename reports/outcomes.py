"""Per-request outcomes, streamed: the requests table written in batches, the summary's counters and
latency sketches updated as requests leave the engine, so memory does not grow with the trace.

A replay reports each request once, when it finishes or is rejected, with its position in the
trace's arrival order (and, if it finished, its tokens' times). Requests finish out of order;
a reorder buffer holds each outcome until every earlier position has been reported, so the table
and the sketches see the requests in arrival order, exactly as a table built at the end would.
The buffer holds only the requests that finished while an earlier one was still in the engine.
The inter-token gaps of many requests are computed at once (every TIMES_BATCH token times), by
the same subtraction as each request's alone, and sketched GAP_BATCH at a time.

Columns (vLLM's serving-benchmark definitions; times in seconds from the first arrival):
request_id, arrival_s, prompt_tokens, output_tokens, status, first_scheduled_s, first_token_s,
finish_s, num_preemptions, prefix_hit_tokens, reject_reason, ttft_s, e2e_s, tpot_s,
scheduling_delay_s, then TTFT in parts (`ttft_parts`, docs/async-scheduling.md): ttft_api_server_s,
ttft_queue_s, ttft_async_wait_s, ttft_prefill_s, client_ttft_s. A missing time is NaN. Goodput counts the
finished requests within every limit of the SLO (sim.config.SLO: ttft, tpot, e2e, scheduling delay and tbt, a
request's longest gap between tokens).

With vLLM's --stream-interval N > 1 (`stream_interval`) a streaming client receives a request's tokens in
chunks (`stream_chunk_times`): the gaps between chunks are the client's inter-token latencies (`client_itl`,
as vLLM's bench records them), and a tbt limit judges a request's longest gap between chunks, as the client
sees the stream. The engine's gaps between tokens (`itl`) and the table's columns do not change.
"""

from __future__ import annotations

import math
import re
from itertools import chain
from struct import pack

import numpy as np

from reports.quantiles import EXACT_LIMIT, StreamingQuantiles
from reports.run_tables import TableWriter
from sim.config import SLO

REQUEST_COLUMNS = ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "status", "first_scheduled_s",
                   "first_token_s", "finish_s", "num_preemptions", "prefix_hit_tokens", "reject_reason",
                   "ttft_s", "e2e_s", "tpot_s", "scheduling_delay_s",
                   "ttft_api_server_s", "ttft_queue_s", "ttft_async_wait_s", "ttft_prefill_s", "client_ttft_s")
# A request's TTFT in parts, in the order they add up (ttft_parts).
TTFT_PARTS = ("ttft_api_server", "ttft_queue", "ttft_async_wait", "ttft_prefill")
# A rejection's reason counted with the others of its kind: the figures of the request (its tokens, the
# requests unfinished) read N; an HTTP status and the run's own limits ("the limit is 32", "--max-model-len
# 4096"), the same for every request, are kept.
FIGURE_OF_A_REQUEST = re.compile(r"(?<!HTTP )(?<!limit is )(?<!--max-model-len )(?<!\d)\d+")
# Their names on the terminal and in report.html (the wait is the host's time before the launch, and under
# asynchronous scheduling the step already queued ahead: not asynchronous scheduling's alone)
TTFT_PART_LABELS = {"ttft_api_server": "API server", "ttft_queue": "queueing", "ttft_async_wait": "wait for the GPU",
                    "ttft_prefill": "prefill"}
LATENCIES = ("ttft", "tpot", "e2e", "scheduling_delay")  # per finished request; ITL is per token gap
CLIENT_LATENCIES = ("client_ttft", "client_e2e")  # from the client's send, where an API server is modelled
SLO_METRICS = {"delay": "scheduling_delay", "tbt": "tbt"}  # an SLO key's metric, where the names differ
BATCH_ROWS = 65536  # outcomes per batch (a row group of the Parquet table)
GAP_BATCH = 1 << 20  # inter-token gaps sketched at a time
TIMES_BATCH = 1 << 16  # token times turned into gaps at a time
FINISHED = "finished"
REJECTED = "rejected"


class RequestOutcomes:
    """Collects outcomes; `writer` (optional) receives the requests table batch by batch."""

    def __init__(self, slo: SLO | None = None, writer: TableWriter | None = None, batch_rows: int = BATCH_ROWS,
                 exact_limit: int = EXACT_LIMIT, extra_columns: tuple[str, ...] = (), stream_interval: int = 1):
        """`extra_columns`: more columns of the requests table, after the standard ones (a cluster's
        replica of each request), their values given to `add`; `stream_interval`: vLLM's --stream-interval
        (above 1: the client's gaps between chunks are sketched as `client_itl`, and judge a tbt limit)."""
        self.slo = slo or SLO()
        self.stream_interval = stream_interval
        self.extra_columns = extra_columns
        self.writer = writer
        self.batch_rows = batch_rows
        self.sketches = {name: StreamingQuantiles(exact_limit) for name in LATENCIES}
        self.ttft_part_sketches = {name: StreamingQuantiles(exact_limit) for name in TTFT_PARTS}
        # TTFT (the parts' sum) and E2E from the client's send, where an API server is modelled
        self.client_sketches = {name: StreamingQuantiles(exact_limit) for name in CLIENT_LATENCIES}
        self.itl = StreamingQuantiles(exact_limit)
        self.client_itl = StreamingQuantiles(exact_limit)  # gaps between streamed chunks (stream_interval > 1)
        self.num_requests = 0
        self.num_completed = 0
        self.num_rejected = 0
        self.num_good = 0  # completed within every SLO
        self.total_prompt_tokens = 0  # of completed requests
        self.total_output_tokens = 0
        self.first_arrival_s = math.inf
        self.last_finish_s = -math.inf  # of completed requests
        self.reject_reasons: dict[str, int] = {}  # digits replaced by N, in order of first appearance
        self._pending: dict[int, tuple] = {}  # position -> (row, token times), waiting for earlier positions
        self._next_position = 0
        self._rows: list[list] = []
        self._gaps: list[np.ndarray] = []  # inter-token gaps of the rows taken, not yet sketched
        self._num_gaps = 0
        self._times: list = []  # token times of the latest rows taken, their gaps not yet computed
        self._times_rows: list[list] = []  # the rows of those token times (their longest gap goes there)
        self._num_times = 0
        self._chunk_gaps: list[np.ndarray] = []  # gaps between chunks of the rows taken, not yet sketched
        self._chunks: list = []  # chunk times of the latest rows taken (stream_interval > 1), as _times

    def add(self, position: int, request, token_times=None, extra: tuple = ()) -> None:
        """A request left the engine (finished or rejected); `token_times`: a finished request's
        tokens' times, in order (a list or an array; their gaps are computed with other requests',
        in bulk); `extra`: its values of `extra_columns`."""
        row = [request.request_id, request.arrival_s, request.num_prompt_tokens, request.max_tokens,
               request.status.value, request.first_scheduled_s, request.first_token_s, request.finish_s,
               request.num_preemptions, request.num_prefix_hit_tokens, request.reject_reason or "",
               None,  # [11]: the longest gap (for a tbt SLO), set with the gaps
               getattr(request, "first_step_start_s", None), getattr(request, "client_sent_s", None),
               None,  # [14]: the longest gap between streamed chunks (stream_interval > 1), set with the gaps
               *extra]
        if token_times is not None and len(token_times) < 2:
            token_times = None  # no gap
        if position != self._next_position:
            self._pending[position] = (row, token_times)
            return
        self._take(row, token_times)
        pending = self._pending
        if pending:
            while self._next_position in pending:
                self._take(*pending.pop(self._next_position))

    def _take(self, row: list, times) -> None:
        self._rows.append(row)
        if times is not None:
            self._times.append(times)
            self._times_rows.append(row)
            if self.stream_interval > 1:
                self._chunks.append(stream_chunk_times(times, self.stream_interval))
            num_times = len(times)
            self._num_times += num_times
            self._num_gaps += num_times - 1
            if self._num_times >= TIMES_BATCH:
                self._gaps_of_times()
            if self._num_gaps >= GAP_BATCH:
                self._sketch_gaps()
        self._next_position += 1
        if len(self._rows) >= self.batch_rows:
            self._flush()

    def _gaps_of_times(self) -> None:
        """The gaps of the requests given by their token times (`_times`), in one pass: each
        request's gaps, one after the other, and its longest gap into its row; the same of their
        streamed chunks' times where the stream interval is above 1."""
        lists, rows = self._times, self._times_rows
        if not lists:
            return
        self._times, self._times_rows, self._num_times = [], [], 0
        gaps, longest = _gaps_and_longest(lists)
        for row, value in zip(rows, longest):
            row[11] = value
        self._gaps.append(gaps)
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            gaps, longest = _gaps_and_longest(chunks)
            for row, value in zip(rows, longest):
                row[14] = value
            self._chunk_gaps.append(gaps)

    def _sketch_gaps(self) -> None:
        self._gaps_of_times()
        if self._gaps:
            self.itl.add(np.concatenate(self._gaps), copy=False)  # a new array, the sketch's to keep
            self._gaps, self._num_gaps = [], 0
        if self._chunk_gaps:
            self.client_itl.add(np.concatenate(self._chunk_gaps), copy=False)
            self._chunk_gaps = []

    def _flush(self) -> None:
        if not self._rows:
            return
        self._gaps_of_times()  # the rows' longest gaps
        columns = dict(zip((*REQUEST_COLUMNS[:11], "longest_gap_s", "first_step_start_s", "client_sent_s",
                            "longest_chunk_gap_s", *self.extra_columns), zip(*self._rows)))
        self._rows = []
        arrival = np.array(columns["arrival_s"], dtype=np.float64)
        output = np.array(columns["output_tokens"], dtype=np.int64)
        times = {name: np.array(columns[name], dtype=np.float64)  # None -> NaN
                 for name in ("first_scheduled_s", "first_token_s", "finish_s", "longest_gap_s")}
        longest_gap = times.pop("longest_gap_s")
        if self.stream_interval > 1:  # a tbt limit judges the gaps the client sees: between streamed chunks
            longest_gap = np.array(columns["longest_chunk_gap_s"], dtype=np.float64)
        ttft = times["first_token_s"] - arrival
        e2e = times["finish_s"] - arrival
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(output > 1, (e2e - ttft) / (output - 1), np.nan)
        latencies = {"ttft": ttft, "e2e": e2e, "tpot": tpot, "scheduling_delay": times["first_scheduled_s"] - arrival,
                     "tbt": longest_gap}
        parts = ttft_parts(arrival, times["first_scheduled_s"], np.array(columns["first_step_start_s"], dtype=np.float64),
                           times["first_token_s"], np.array(columns["client_sent_s"], dtype=np.float64), ttft)
        if self.writer is not None:
            table = {name: columns[name] for name in REQUEST_COLUMNS[:11]}
            table.update(arrival_s=arrival, output_tokens=output, **times)
            table.update({f"{name}_s": latencies[name] for name in ("ttft", "e2e", "tpot", "scheduling_delay")})
            table.update(parts)
            table.update({name: np.asarray(columns[name]) for name in self.extra_columns})
            self.writer.write(table)
        client_sent = np.array(columns["client_sent_s"], dtype=np.float64)
        from_send = {"ttft": parts["client_ttft_s"], "e2e": times["finish_s"] - client_sent}  # NaN without a client
        # (the run starts at its first send where a client is modelled, as vLLM's benchmark clocks it)
        self._count(columns, np.fmin(arrival, client_sent), output, times["finish_s"], latencies, from_send)
        done = np.array(columns["status"]) == FINISHED
        for name in TTFT_PARTS:
            self.ttft_part_sketches[name].add(parts[f"{name}_s"][done])
        if not np.isnan(client_sent).all():  # (NaN, a request without a client, is left out)
            self.client_sketches["client_ttft"].add(from_send["ttft"][done])
            self.client_sketches["client_e2e"].add(from_send["e2e"][done])

    def _count(self, columns: dict, arrival: np.ndarray, output: np.ndarray, finish: np.ndarray,
               latencies: dict[str, np.ndarray], from_send: dict[str, np.ndarray]) -> None:
        """Counts, sketches and goodput of a batch of outcomes. Goodput judges TTFT and E2E from the
        client's send where an API server is modelled (`from_send`, NaN elsewhere), as a client's
        benchmark does (vLLM's bench serve --goodput)."""
        status = np.array(columns["status"])
        done = status == FINISHED
        self.num_requests += len(status)
        self.num_completed += int(done.sum())
        self.first_arrival_s = min(self.first_arrival_s, float(arrival.min()))  # (or send: _flush)
        if done.any():
            self.last_finish_s = max(self.last_finish_s, float(finish[done].max()))
        self.total_output_tokens += int(output[done].sum())
        self.total_prompt_tokens += int(np.array(columns["prompt_tokens"], dtype=np.int64)[done].sum())
        for name in LATENCIES:
            self.sketches[name].add(latencies[name][done])
        self._sketch_gaps()
        good = done.copy()
        for name, limit in self.slo.limits().items():
            values = latencies[SLO_METRICS.get(name, name)]
            if name in from_send:
                values = np.where(np.isnan(from_send[name]), values, from_send[name])
            good &= np.isnan(values) | (values <= limit)  # TPOT and TBT are undefined for one-token outputs
        self.num_good += int(good.sum())
        for reason in np.array(columns["reject_reason"], dtype=object)[status == REJECTED].tolist():
            self.num_rejected += 1
            key = FIGURE_OF_A_REQUEST.sub("N", reason)
            self.reject_reasons[key] = self.reject_reasons.get(key, 0) + 1

    def close(self) -> None:
        """Write what is left; every position from 0 up must have been reported."""
        if self._pending:
            raise RuntimeError(f"internal error: request outcomes missing before position {min(self._pending)}")
        self._flush()
        if self.writer is not None:
            self.writer.close()

    def duration_s(self, start_s: float | None = None) -> float:
        """`start_s` (default: the first arrival, or client send) to the last finish; 0 when nothing finished."""
        start = self.first_arrival_s if start_s is None else start_s
        return self.last_finish_s - start if self.num_completed else 0.0

    def reject_reason_counts(self) -> dict[str, int]:
        """Rejections by reason, most frequent first, as pandas orders them (pd.Series(counts)
        .sort_values(ascending=False), whose nargsort is done here without importing pandas: the
        counts reversed, argsorted by numpy's quicksort, the order reversed back)."""
        if not self.reject_reasons:
            return {}
        reasons = list(self.reject_reasons)
        counts = np.fromiter(self.reject_reasons.values(), dtype=np.int64, count=len(reasons))
        backwards = np.arange(len(counts))[::-1]
        order = backwards[counts[::-1].argsort(kind="quicksort")][::-1]
        return {reasons[i]: int(counts[i]) for i in order.tolist()}


def stream_chunk_times(times, interval: int):
    """When a streaming client receives a request's tokens (`times`, each token's time, a list or an array)
    where vLLM's API server sends them `interval` at a time (--stream-interval N): the times of the tokens
    that complete a send, in order (a list for a list, an array for an array).

    vLLM (0.33 and 0.34), vllm/v1/engine/output_processor.py: `RequestState.make_request_output`, called by
    `OutputProcessor.process_outputs` for each engine-core output (one new token a step here), with a
    streaming client's RequestOutputKind.DELTA and stream_interval > 1, returns an output only when the
    request finished, or nothing was sent yet (`sent_tokens_offset == 0`: its first token), or at least N
    tokens gathered since the last send (`num_output_tokens() - sent_tokens_offset >= stream_interval`); the
    output carries every token since the last send. The interval is the server's
    (`SchedulerConfig.stream_interval`), raised by a request's own `stream_interval` (`RequestState.
    from_new_request`: the larger of the two), which vLLM's bench does not send. So the sends complete tokens
    1, 1 + N, 1 + 2N, ... and the last: indices 0, N, 2N, ... and len - 1 here. Each becomes one SSE message
    of the completions stream (vllm/entrypoints/openai/completion/serving.py), one chunk to the client.
    A non-streaming request (FINAL_ONLY) gets its one output at the finish whatever N is; nothing here
    changes its figures. Interval 1: `times` itself."""
    if interval == 1 or len(times) < 2:
        return times
    last = len(times) - 1
    if isinstance(times, list):
        return times[::interval] + ([times[last]] if last % interval else [])
    times = np.asarray(times, dtype=np.float64)
    return np.append(times[::interval], times[last:]) if last % interval else times[::interval]


def _gaps_and_longest(lists: list) -> tuple[np.ndarray, list[float]]:
    """The gaps between consecutive times of each list (each at least two times long), one list's after
    another's, and each list's longest gap."""
    counts = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    if all(type(times) is list for times in lists):
        # Packed as C doubles by struct: the same values, in two thirds of np.fromiter's time.
        flat = np.frombuffer(b"".join([pack(f"{len(times)}d", *times) for times in lists]))
    else:
        flat = np.fromiter(chain.from_iterable(lists), dtype=np.float64, count=int(counts.sum()))
    ends = np.cumsum(counts)  # each request's times end here in `flat`
    # The differences across two requests (one's last time to the next one's first) go.
    within = np.ones(len(flat) - 1, dtype=bool)
    within[ends[:-1] - 1] = False
    gaps = (flat[1:] - flat[:-1])[within]  # np.diff's own subtraction, as each request's alone
    longest = np.maximum.reduceat(gaps, ends - counts - np.arange(len(lists)))  # each one's first gap
    return gaps, longest.tolist()


def ttft_parts(arrival: np.ndarray, first_scheduled: np.ndarray, first_step_start: np.ndarray,
               first_token: np.ndarray, client_sent: np.ndarray, ttft: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Each request's TTFT in parts, from its timestamps (arrays, NaN where a time is missing):

    - ttft_api_server_s: the client's send (`client_sent`) to the engine's arrival; NaN without an API server;
    - ttft_queue_s: arrival to first scheduled;
    - ttft_async_wait_s: first scheduled to the GPU start of the first step that scheduled it
      (`first_step_start`; NaN: taken as the first scheduled time, a wait of 0);
    - ttft_prefill_s: that start to the first token;
    - client_ttft_s: the client's send to the first token (NaN without an API server).

    The parts add up exactly, left to right in that order, to client_ttft_s where a client is given and
    to `ttft` (first token minus arrival) otherwise. The prefill is the total less the others, which almost
    always makes the sum exact; where its rounding does not (parts of very different magnitudes), the parts
    move by a few units in the last place until it is (_exact_sum)."""
    if ttft is None:
        ttft = first_token - arrival
    queue = first_scheduled - arrival
    start = np.where(np.isnan(first_step_start), first_scheduled, first_step_start)
    wait = start - first_scheduled
    has_client = ~np.isnan(client_sent)
    api = arrival - client_sent  # NaN without a client
    client_ttft = first_token - client_sent
    lead = np.where(has_client, api, 0.0)
    total = np.where(has_client, client_ttft, ttft)
    prefill = total - ((lead + queue) + wait)
    off = np.flatnonzero((((lead + queue) + wait) + prefill != total) & np.isfinite(total))
    for i in off.tolist():  # rare: the rounding of the sum lands off the total (see _exact_sum)
        own = [queue[i], wait[i], first_token[i] - start[i]]
        if has_client[i]:
            api[i], queue[i], wait[i], prefill[i] = _exact_sum([api[i], *own], float(total[i]))
        else:
            queue[i], wait[i], prefill[i] = _exact_sum(own, float(total[i]))
    return {"ttft_api_server_s": api, "ttft_queue_s": queue, "ttft_async_wait_s": wait, "ttft_prefill_s": prefill,
            "client_ttft_s": client_ttft}


def _exact_sum(parts: list[float], total: float) -> list[float]:
    """Floats within a few units in the last place of `parts` whose sum, left to right, is exactly `total`.
    From the last part back: keep the part and find the float partial sum before it that the part brings
    exactly to the target (one of the few floats around target - part); where none does (the exact sum
    falls half-way between two floats, a tie rounded away), the part moves by one unit in its last place.
    The first part is the partial sum left."""
    xs = [float(x) for x in parts]
    target = total
    for k in range(len(xs) - 1, 0, -1):
        x, found = xs[k], None
        for _ in range(8):
            s = target - x
            for candidate in (s, math.nextafter(s, math.inf), math.nextafter(s, -math.inf),
                              math.nextafter(math.nextafter(s, math.inf), math.inf),
                              math.nextafter(math.nextafter(s, -math.inf), -math.inf)):
                if candidate + x == target:
                    found = candidate
                    break
            if found is not None:
                break
            x = math.nextafter(x, math.inf)
        if found is None:
            raise AssertionError(f"internal error: TTFT parts {parts} do not add up to {total}")
        xs[k], target = x, found
    xs[0] = target
    return xs


def outcomes_from_result(result, slo: SLO | None = None, writer: TableWriter | None = None,
                         stream_interval: int = 1) -> RequestOutcomes:
    """The outcomes of a finished in-memory replay (`SimResult`, with every token time);
    `stream_interval`: vLLM's --stream-interval (RequestOutcomes)."""
    outcomes = RequestOutcomes(slo, writer, stream_interval=stream_interval)
    for position, r in enumerate(result.requests):
        outcomes.add(position, r, result.tokens_of(position).tolist() if r.finish_s is not None else None)
    outcomes.close()
    return outcomes
