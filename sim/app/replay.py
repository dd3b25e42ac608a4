"""One replay: trace + options -> simulated requests and steps -> a run folder.

`replay` keeps every request and token time in memory (tests, sweeps, compare, bench); `replay_to`
writes the run folder as the replay goes and keeps only what is in flight (`sim replay`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from sim.app.options import ReplayOptions, before_vllm
from sim.app.plan import RunPlan
from sim.arrivals import ApiServers, RequestStream, TraceArrivals, simulate, through_api_servers
from sim.cluster import Cluster
from sim.data_parallel import ClosedLoopClients, DataParallelGroup, DPResult
from sim.disagg import DisaggregatedCluster, PrefillEngine
from sim.engine import Engine, SimResult, TokenTimes
from sim.request import Request
from sim.step_log import BATCH_ROWS, StepLog
from traces.trace import Trace

__all__ = ["ReplayOptions", "make_cluster", "make_dp_group", "make_requests", "replay", "replay_to", "write_run"]


def request_maker(trace: Trace, as_lists: bool = False) -> Callable[[int], Request]:
    """make(j): the request of the trace's row j (the one way a trace row becomes a Request).
    `as_lists`: the columns are read as Python lists, converted once (for making every row: a numpy
    element read one at a time costs several times more); else from the arrays (rows made as they
    arrive, in bounded memory). The same values either way."""
    arrival, ids, hash_ids, block_tokens = trace.arrival_s, trace.request_ids, trace.hash_ids, trace.hash_block_tokens
    prompt, output, priority = trace.prompt_tokens, trace.output_tokens, trace.priority
    if as_lists:
        arrival, prompt, output = arrival.tolist(), prompt.tolist(), output.tolist()
        priority = None if priority is None else priority.tolist()

    def make(j: int) -> Request:
        return Request(j, str(j) if ids is None else ids[j], float(arrival[j]), int(prompt[j]), int(output[j]),
                       hash_ids=None if hash_ids is None else hash_ids[j], hash_block_tokens=block_tokens,
                       priority=0 if priority is None else int(priority[j]))

    sent = trace.client_sent_s
    if sent is None:
        return make

    def make_sent(j: int) -> Request:
        r = make(j)
        r.client_sent_s = float(sent[j])
        return r

    return make_sent


# Trace formats whose times are a client's sends, before vLLM's API server (`--api-server auto`)
CLIENT_SEND_FORMATS = ("vllm-bench", "aiperf", "sim-bench")  # (sim bench's requests are sent by vLLM's client too)
API_SERVER_MIN_VERSION = (0, 15)  # the first vLLM to start one API server per data-parallel rank by default


def default_api_servers(dp: int, vllm_version: str | None) -> int:
    """vLLM's API servers in front of `dp` engine ranks: --api-server-count defaults to the
    data-parallel size from vLLM 0.15 (vllm/entrypoints/cli/serve.py, ServeSubcommand.cmd: internal
    load balancing), one before; a version not given (or not a release) is taken as the newest."""
    return 1 if before_vllm(vllm_version, API_SERVER_MIN_VERSION) else dp


def api_server_count(options: ReplayOptions) -> int:
    """The API servers of a run (`default_api_servers` for --dp and --vllm-version). A cluster's
    replicas are servers of their own, each with its API servers (a disaggregated cluster's requests
    enter through its prefill replicas'); they are pooled here, a request taken by the first free."""
    cluster = options.cluster
    replicas = cluster.num_prefill_replicas if cluster.is_disaggregated else cluster.num_replicas
    return default_api_servers(options.dp, options.vllm_version) * replicas


def models_api_server(options: ReplayOptions, trace: Trace) -> bool:
    return options.api_server == "on" or (options.api_server == "auto" and trace.format in CLIENT_SEND_FORMATS)


def with_api_server(trace: Trace, options: ReplayOptions) -> Trace:
    """The trace as the engine sees it behind vLLM's API server (`--api-server`): its times are
    the clients' sends (kept as `client_sent_s`), each request reaching the engine once a server
    has handled it (sim/arrivals.py, through_api_servers), for the time `sim validate` prices
    (ClientOverhead: a fixed part and the prompt's tokenisation). Unchanged where it does not apply
    or was applied already."""
    if not models_api_server(options, trace) or trace.client_sent_s is not None or not len(trace):
        return trace
    seconds = api_server_time().seconds(trace.prompt_tokens.astype(np.float64))  # (per request, as an array)
    arrival = through_api_servers(trace.arrival_s, seconds, api_server_count(options))
    return replace(trace, arrival_s=arrival, client_sent_s=trace.arrival_s)


def api_server_time():
    """What the API server takes over a request: `sim validate`'s ClientOverhead, its stated figures."""
    from backends.costmodel.optables.profile import ClientOverhead

    return ClientOverhead()


def api_servers(count: int = 1) -> ApiServers:
    """`count` API servers for a closed loop of clients (sim bench), each request priced by `api_server_time`."""
    client = api_server_time()
    return ApiServers(lambda r: client.seconds(r.num_prompt_tokens), count)


def api_server_entry(options: ReplayOptions, trace: Trace) -> dict | None:
    """summary.json's account of the API server, where one is modelled."""
    if not models_api_server(options, trace):
        return None
    client = api_server_time()
    return {"servers": api_server_count(options), "fixed_s": client.fixed_s,
            "per_prompt_token_s": client.per_prompt_token_s, "source": client.source,
            "why": "on" if options.api_server == "on" else f"auto: the times of the {trace.format} trace are its client's sends"}


def make_requests(trace: Trace) -> list[Request]:
    """The trace's requests, in trace order."""
    make = request_maker(trace, as_lists=True)
    return [make(j) for j in range(len(trace))]


def replay(trace: Trace, plan: RunPlan, progress: Callable[[float, int], None] | None = None,
           fast_forward: bool = True) -> SimResult:
    """Simulate the trace with the plan (sim.app.plan.resolve(options, backend) makes it).
    `fast_forward=False` steps every decode step one by one (same answers, slower; see
    sim/fast_forward.py)."""
    trace = with_api_server(trace, plan.options)
    requests = sorted(make_requests(trace), key=lambda r: (r.arrival_s, r.index))  # arrival order, ties in trace order
    if plan.options.dp > 1:
        return make_dp_group(plan, requests, fast_forward, progress).run()
    if not plan.options.cluster.is_single:
        return make_cluster(plan, requests, fast_forward, progress).run()
    engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), TokenTimes(requests),
                    plan.max_model_len, fast_forward=fast_forward, progress=progress)
    return simulate(engine, TraceArrivals(requests, engine))


def make_cluster(plan: RunPlan, requests: list[Request], fast_forward: bool = True,
                 progress: Callable[[float, int], None] | None = None) -> Cluster:
    """The plan's replicas, each an engine with its own policy, KV cache and step log, behind its
    router. The replicas of a pool share the pool's backend: the cost model keeps no state between
    steps."""
    token_times = TokenTimes(requests)
    cluster = plan.options.cluster

    def engine(pool: RunPlan, engine_class=Engine) -> Engine:
        return engine_class(pool.make_policy(), pool.backend, pool.make_block_manager(), token_times,
                            pool.max_model_len, fast_forward=fast_forward)

    if not cluster.is_disaggregated:
        built = Cluster(requests, token_times, plan.make_router(), progress)
        for _ in range(cluster.num_replicas):
            built.add_replica(engine(plan))
        return built
    prefill, decode = plan.pools
    built = DisaggregatedCluster(requests, token_times, plan.make_router(0), plan.make_router(1), plan.kv_link(),
                                 prefill.model.kv_bytes_per_token(kv_cache_dtype=prefill.options.kv_cache_dtype), progress)
    for _ in range(cluster.num_prefill_replicas):
        built.add_prefill_replica(engine(prefill, PrefillEngine))
    for _ in range(cluster.num_decode_replicas):
        built.add_decode_replica(engine(decode))
    return built


def make_dp_group(plan: RunPlan, requests: list[Request], fast_forward: bool = True,
                  progress: Callable[[float, int], None] | None = None,
                  clients: ClosedLoopClients | None = None) -> DataParallelGroup:
    """The plan's --dp engine ranks (sim/data_parallel.py), each with its own policy, KV cache
    (`plan.num_blocks`, one rank's: kv_capacity with dp) and step log, sharing the backend. A
    mixture of experts' ranks step in lockstep, one step at a time; a dense model's each on its own.
    `clients`: a closed loop of clients (`sim validate`) instead of `requests`' arrival times."""
    token_times = TokenTimes(requests)
    lockstep = bool(plan.model.num_experts)
    graphs = tuple(plan.cuda_graph_sizes)  # the sizes the server captures (sim.config.cuda_graph_sizes)
    group = DataParallelGroup(requests, token_times, plan.options.dp, lockstep, progress, graphs, clients)
    for _ in range(plan.options.dp):
        group.add_rank(Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), token_times,
                              plan.max_model_len, fast_forward=fast_forward and not lockstep))
    return group


def write_run(out: Path, result: SimResult, plan: RunPlan, trace: Trace, extra: dict | None = None,
              start_s: float | None = None, steps: str = "parquet", requests: str = "csv",
              step_batch_rows: int = BATCH_ROWS) -> dict:
    """Write an in-memory result's run folder (the requests and steps tables, summary.json,
    digest.json, report.html) whole or not at all; return the summary. `extra`: more summary
    entries (sim bench's); `start_s`: see reports.metrics.summarize; `steps`: parquet, csv or none;
    `requests`: csv or parquet; the steps table is written in row groups of `step_batch_rows`."""
    from sim.app.run_folder import write_run_folder

    if isinstance(result, DPResult):
        extra = {**(extra or {}), "data_parallel": result.summary()}
    return write_run_folder(out, result, run_options(plan, trace), plan.options.slo, steps, requests,
                            step_batch_rows, {**(extra or {}), **plan_entries(plan)}, start_s,
                            plan.options.scheduler.stream_interval)


def replay_to(out: Path, trace: Trace, plan: RunPlan, steps: str = "parquet", requests: str = "csv",
              progress: Callable[[float, int], None] | None = None, fast_forward: bool = True,
              step_batch_rows: int = BATCH_ROWS) -> dict:
    """Replay the trace and write its run folder as the replay goes, in bounded memory: requests are
    made as they arrive, their outcomes written and sketched as they end, the steps written in
    batches. The same files as `write_run(out, replay(...))`; returns the summary."""
    from sim.app.run_folder import RunFolder

    if plan.options.dp > 1:  # every rank's steps in one table: kept in memory, written at the end
        return write_run(out, replay(trace, plan, progress, fast_forward), plan, trace, steps=steps,
                         requests=requests, step_batch_rows=step_batch_rows)
    trace = with_api_server(trace, plan.options)
    folder = RunFolder(out, run_options(plan, trace), plan.options.slo, steps, requests,
                       stream_interval=plan.options.scheduler.stream_interval)
    try:
        log = StepLog(sink=folder.on_steps, spill_rows=step_batch_rows)
        engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), None, plan.max_model_len,
                        fast_forward=fast_forward, progress=progress, steps=log)
        result = simulate(engine, TraceArrivals(request_stream(trace), engine,
                                                lambda position, r: folder.on_request(position, r, r.token_times)))
        log.spill()
    except BaseException:
        folder.abort()
        raise
    return folder.finish(result, plan_entries(plan))


def request_stream(trace: Trace) -> RequestStream:
    """The trace's requests in arrival order (ties in trace order), each made when it arrives."""
    arrival = trace.arrival_s
    order = None if bool((arrival[1:] >= arrival[:-1]).all()) else np.argsort(arrival, kind="stable")
    make_row = request_maker(trace)
    make = make_row if order is None else (lambda i: make_row(int(order[i])))
    return RequestStream(arrival if order is None else arrival[order], make)


def run_options(plan: RunPlan, trace: Trace) -> dict:
    """The options a run's summary records: the plan's, the trace and its transforms."""
    options = plan.as_dict()
    options["trace"] = trace.source
    if trace.dropped:  # the trace's rows that were not replayed, by reason, so completed + rejected add up
        options["trace_dropped"] = dict(trace.dropped)
    if trace.transforms:
        options["trace_transforms"] = trace.transforms
    api_server = api_server_entry(plan.options, trace)
    if api_server is not None:
        options["api_server"] = api_server
    return options


def plan_entries(plan: RunPlan) -> dict:
    """The summary's entries about the plan: the KV cache, the model and (a cost-model run) the
    hardware, whose memory sized the KV cache whatever priced the steps (a profile, tables or the
    datasheet roofline)."""
    entries = {"kv_cache": plan.kv_cache(), "model": plan.model.describe()}
    if plan.options.backend == "costmodel":
        entries["hardware"] = plan.hardware.as_dict()
    return entries
