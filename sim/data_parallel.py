"""Data parallelism as vLLM runs a mixture of experts (`--dp N`, vLLM's --data-parallel-size): N
engine ranks, each with its own scheduler and KV cache, fed by vLLM's DP load balancer, stepping
together through the MoE layers.

    trace ──> arrivals ──DP load balancer──> rank 0: inbox -> engine (policy, KV cache, step log)
                                       └───> rank 1: inbox -> engine
                                                  ... all ranks step in lockstep

What vLLM 0.33 does, and where (vllm/v1/engine/):

- The load balancer (core_client.py, DPLBAsyncMPClient.get_core_engine_for_request), one API
  client: it scans the ranks from `eng_start_index` (0, then one further after every request, so
  that ties rotate) and takes the first with the lowest score
  max(its exact in-flight count, waiting + running) + waiting x 6 x max(0, kv_cache_usage - 0.5),
  where waiting, running and kv_cache_usage are the coordinator's latest snapshot (`lb_engines`);
  the chosen rank's snapshot waiting count then grows by one until the next snapshot replaces it.
  The in-flight count (`engine_inflight`) grows when a request is sent and shrinks when its
  finish comes back (process_engine_outputs).
- The snapshot (coordinator.py, DPCoordinatorProc.process_input_socket): each engine sends its
  (waiting, running, kv_cache_usage) when they change, before and after each step
  (core.py DPEngineCoreProc._maybe_publish_request_counts); the coordinator publishes them all to the
  client every `min_stats_update_interval_ms` = 100 ms when they changed, else every 5 s. Here: at
  each multiple of 0.1 s (of 5 s when nothing changed), the counts each rank last sent (`Coordinator`).
  The coordinator's 50 ms floor and its step-stamped copies (last_step_counts) are left out.
- Lockstep (core.py DPEngineCoreProc.run_busy_loop): while a wave runs, every rank steps each turn;
  a rank with no request to run (none, or none its scheduler could schedule) runs
  `execute_dummy_batch` (vllm/v1/worker/gpu_worker.py: a 1-token uniform decode forward,
  `_dummy_run(1, uniform_decode=True)`, no sampling), so that the MoE layers' collectives meet. The
  step lasts as long as the slowest rank's (they wait for each other in the MoE all-to-all).
  After a step each rank counts it (`step_counter`) and, at the wave's first step and every
  `dp_sync_interval` = 16 steps (vllm/config/parallel.py), all-reduces whether any rank has
  unfinished requests (_has_global_unfinished_reqs); when none has, the wave ends and the ranks
  pause until a request arrives, which starts the next wave on every rank (START_DP_WAVE).
- The prefill cadence (`--prefill-schedule-interval N` > 1; core.py
  DPEngineCoreProc._should_throttle_prefills): each rank's schedule is throttled when
  `step_counter % N != 0`, the counter the ranks share (0 at a wave's first step, so a wave's first
  schedule is never throttled; one more after each lockstep step, real or dummy). The rank's
  scheduler (vllm/v1/core/sched/scheduler.py, Scheduler.schedule(throttle_prefills)) then holds prefill
  while some running request is past its prefill, unless its last step that could carry prefill left
  requests waiting (`prefill_capacity_bound`); its own local cadence is off (Scheduler.__init__:
  `local_prefill_interval` is 1 while data_parallel_size > 1). Here: `throttle_prefills` on each
  rank's chunked policy (policies/chunked.py), set before each schedule.

A dense model's ranks do not step together (vllm/v1/engine/core.py run_engine_core makes a
DPEngineCoreProc only for a mixture of experts; utils.py enables wave coordination only then):
each rank is its own engine (with fast-forward), behind the same balancer; the coordinator's
snapshot then holds each rank's counts as of the tick. Such a rank is reconfigured to
data_parallel_size 1 (vllm/config/parallel.py, ParallelConfig.reconfigure_for_independent_dp_rank,
called by run_engine_core before it makes an EngineCoreProc), so its scheduler runs the local
prefill cadence of one engine (Scheduler.__init__, `local_prefill_interval`), as each rank's policy
here does by itself (stepped one step at a time while the cadence is on: the policy's promises).

Each rank's step is priced by the backend for its own batch (the dummy batch as one 1-token decode
with no logits), with its MoE layers priced once for the lockstep step from every rank's tokens
where the backend can (`dp_moe_parts` and `execute_in_lockstep`, backends/costmodel/roofline.py:
vLLM's allgather_reducescatter dispatch, the fused-MoE kernel over every rank's tokens, and the
combine); the tokens each rank brings to the collective are vLLM's DP padding of them
(`dp_padded_tokens`). The lockstep step's seconds are the largest rank's, and each rank's step-log
row records that, with `dp_wait` (the difference from its own) in its breakdown. The ranks step one
by one (no fast-forward under DP). A rank's dummy steps log no row; they are counted per rank.

The requests come from a trace (open loop), or from `ClosedLoopClients` (C clients in front of the
API server, as vLLM's benchmark sends them: `sim validate`'s DP rows).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Callable

import simpy

from sim.admission import QueueLimits
from sim.arrivals import ApiServers, queue_by_arrival
from sim.backend import StepResult
from sim.batch import Batch
from sim.cluster import Cluster, ClusterSteps, Instant, Replica
from sim.engine import Engine, SimResult, TokenTimes, delay_to
from sim.errors import ServesimError
from sim.fast_forward import single_step
from sim.request import Request, Status

DP_SYNC_INTERVAL = 16  # vllm/config/parallel.py ParallelConfig.dp_sync_interval
STATS_UPDATE_S = 0.1  # coordinator.py: min_stats_update_interval_ms = 100
STATS_IDLE_S = 5.0  # ... or every 5 s when no engine's counts changed
KV_PENALTY = 6.0  # get_core_engine_for_request: waiting x 6 x max(0, kv_cache_usage - 0.5)


def dp_padded_tokens(tokens: list[int], cuda_graph_sizes: tuple[int, ...] = ()) -> list[int]:
    """The tokens each DP rank runs through the step, as vLLM 0.33's ranks agree on them
    (vllm/v1/worker/gpu_model_runner.py, _determine_batch_execution_and_padding; vllm/v1/worker/dp_utils.py,
    coordinate_batch_across_dp -> _synchronize_dp_ranks): each rank first rounds its count up to its
    CUDA-graph size (the next of `cuda_graph_sizes`, ascending, for a count up to the largest; the
    dispatcher's batch_descriptor), then, when every rank's step runs a graph (the ranks take the least of
    their graph modes), every rank is padded to the largest rounded count (_post_process_dp_padding); else
    each runs its own rounded count. (Found by a review against vLLM: the ranks were padded to the largest
    count unrounded, so decodes of 37 and 20 tokens ran 2 x 37 where vLLM runs 2 x 40.)"""
    if not cuda_graph_sizes:
        return list(tokens)
    largest = cuda_graph_sizes[-1]
    rounded = [cuda_graph_sizes[bisect_left(cuda_graph_sizes, t)] if t <= largest else t for t in tokens]
    if max(tokens) <= largest:
        return [max(rounded)] * len(tokens)
    return rounded


class ClosedLoopClients:
    """C clients in a closed loop in front of the group's API server (vLLM's benchmark with
    --max-concurrency C and --request-rate inf): requests in send order, the first C sent at the
    start, each finish (or rejection) sending the next at its instant. An API server takes the
    requests one at a time, in send order, `server_seconds(request)` each, before the load balancer
    routes them (`arrival_s`); `num_servers` of them each take the next request when free
    (sim/arrivals.py, ApiServers: vLLM >= 0.15 starts one per rank); `sent_s` keeps each send, where
    the client's TTFT starts."""

    def __init__(self, requests: list[Request], concurrency: int,
                 server_seconds: Callable[[Request], float] = lambda r: 0.0, num_servers: int = 1):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.requests, self.concurrency = requests, concurrency
        self.servers = ApiServers(server_seconds, num_servers)
        self.pending: list[Request] = []  # sent, not yet through the API server, by arrival
        self.sent_s: dict[int, float] = {}
        self._next = 0

    @property
    def all_sent(self) -> bool:
        return self._next == len(self.requests)

    def send(self, at: float) -> None:
        if self.all_sent:
            return
        r = self.requests[self._next]
        self._next += 1
        self.sent_s[r.index] = at
        self.servers.take(r, at)
        queue_by_arrival(self.pending, r)

    def start(self) -> None:
        for _ in range(self.concurrency):
            self.send(0.0)


def dummy_batch() -> Batch:
    """What an idle rank runs (gpu_worker.py execute_dummy_batch): one token of a decode, no logits."""
    batch = Batch()
    batch.add("dp-dummy", 0, 1, [0], needs_logits=False, is_decode=True, token_source=[0])
    return batch


class DPLoadBalancer:
    """vLLM's DP load balancer for one API client (core_client.py, DPLBAsyncMPClient.
    get_core_engine_for_request): reads the coordinator's snapshot and each rank's in-flight count."""

    reads_state = True

    def __init__(self, num_ranks: int):
        self.lb_engines: list[list[float]] = [[0, 0, 0.0] for _ in range(num_ranks)]  # [waiting, running, kv usage]
        self.eng_start_index = 0  # len(core_engines) x client_index // client_count, client 0 of 1

    def route(self, request: Request, ranks: list["DPRank"]) -> int:
        counts = self.lb_engines
        num = len(counts)
        best, best_score = 0, float("inf")
        for i in range(num):
            idx = (self.eng_start_index + i) % num
            waiting, running, usage = counts[idx]
            score = max(ranks[idx].num_in_flight, waiting + running)
            if waiting:
                score += waiting * KV_PENALTY * max(0.0, usage - 0.5)
            if score < best_score:
                best, best_score = idx, score
        counts[best][0] += 1
        self.eng_start_index = (self.eng_start_index + 1) % num
        return best


class DPRank(Replica):
    """One DP rank: its engine's workload (requests routed to it) and what the balancer reads."""

    role = "dp_rank"

    def __init__(self, cluster: "DataParallelGroup", index: int, engine: Engine):
        super().__init__(cluster, index, engine)
        self.group = cluster
        self.reported: tuple[int, int, float] = (0, 0, 0.0)  # what it last sent the coordinator
        self.num_dummy_steps = 0

    def wake(self) -> None:
        if self.group.lockstep:
            self.group.wake()
        else:
            super().wake()

    @property
    def next_observation_s(self) -> float:
        # Besides the balancer at each arrival, the coordinator reads every rank at each of its ticks:
        # a run of steps (fast-forward) ends before it, so the counts it reads are step-by-step's.
        return min(super().next_observation_s, self.group.next_tick_s)

    def report(self) -> None:
        """Send (waiting, running, kv usage) to the coordinator if they changed
        (_maybe_publish_request_counts; get_kv_cache_usage: used / usable blocks)."""
        engine = self.engine
        bm = engine.block_manager
        counts = (len(engine.state.waiting), len(engine.state.running), bm.num_used_blocks / bm.num_blocks)
        if counts != self.reported:
            self.reported = counts
            self.group.counts_changed = True


class DPResult(SimResult):
    """A DP group's run: every request and token, every rank's steps in one table (with `dp_rank`),
    and per rank its load (`per_rank`)."""

    def __init__(self, group: "DataParallelGroup", end_s: float):
        ranks = group.ranks
        engines = [rank.engine for rank in ranks]
        steps = ClusterSteps([e.steps for e in engines])
        steps._columns["dp_rank"] = steps.replica  # the steps table's column (no `replica`: not a cluster)
        super().__init__(group.requests, group.token_times, steps, end_s,  # type: ignore[arg-type]  # a StepLog's interface
                         sum(e.state.num_preemptions for e in engines),
                         sum(e.block_manager.num_queried_tokens for e in engines),
                         sum(e.block_manager.num_hit_tokens for e in engines))
        self.rank_of = group.replica_of
        self.num_lockstep_steps = group.num_lockstep_steps
        self.num_waves = group.num_waves
        self.lockstep = group.lockstep
        self.asynchronous = any(rank.engine.asynchronous for rank in ranks)
        self.per_rank = [{"dp_rank": rank.index, "requests": rank.num_routed, "steps": len(rank.engine.steps),
                          "dummy_steps": rank.num_dummy_steps, "kv_blocks": rank.engine.block_manager.num_blocks,
                          "preemptions": rank.engine.state.num_preemptions}
                         for rank in ranks]

    def summary(self) -> dict:
        return {"dp": len(self.per_rank), "lockstep": self.lockstep,
                "scheduling": "asynchronous" if self.asynchronous else "synchronous",
                "lockstep_steps": self.num_lockstep_steps if self.lockstep else None,
                "waves": self.num_waves if self.lockstep else None,
                "load_balancer": "vLLM DPLBAsyncMPClient (one API client)", "ranks": self.per_rank}


class DataParallelGroup(Cluster):
    """N engine ranks stepping in lockstep behind vLLM's DP load balancer. Build with
    `add_rank(engine)` once per rank (each engine made with fast_forward=False); `run()`
    returns a `DPResult`."""

    def __init__(self, requests: list[Request], token_times: TokenTimes, num_ranks: int, lockstep: bool = True,
                 progress: Callable[[float, int], None] | None = None, cuda_graph_sizes: tuple[int, ...] = (),
                 clients: ClosedLoopClients | None = None):
        """`requests`: in arrival order (a trace), or in send order with `clients` (a closed loop,
        lockstep groups only). `cuda_graph_sizes`: the server's CUDA-graph capture sizes, ascending
        (`sim.config.cuda_graph_sizes`), for the DP padding of the MoE layers' tokens (empty: none)."""
        if clients is not None and not lockstep:
            raise ValueError("closed-loop clients drive a lockstep DP group (a mixture of experts) only")
        super().__init__(requests, token_times, DPLoadBalancer(num_ranks), progress)
        self.lockstep = lockstep  # a mixture of experts' ranks step together; a dense model's do not
        self.cuda_graph_sizes = tuple(cuda_graph_sizes)
        self.clients = clients
        self._client_sent: simpy.Event | None = None
        self._next_tick_s = STATS_UPDATE_S  # the coordinator's first read of the ranks
        self.counts_changed = False
        self.num_lockstep_steps = 0
        self.num_waves = 0
        self._wake: simpy.Event | None = None
        self._dummy: StepResult | None = None
        self.ranks: list[DPRank] = []
        self.prefill_schedule_interval = 1  # the ranks' --prefill-schedule-interval (`add_rank`)
        self.queue_limits: QueueLimits | None = None  # vLLM's admission limits, over every rank (`add_rank`)

    def add_rank(self, engine: Engine) -> DPRank:
        """Rank len(ranks): `engine`, fed by the balancer. A lockstep group schedules each rank as
        its engine says (`Engine.asynchronous`: `_lockstep`'s docstring), and, where its policy's
        `prefill_schedule_interval` is more than 1, throttles the rank's prefills by the group's step
        counter (`_throttle_prefills`) in place of the policy's local cadence."""
        interval = getattr(engine.policy.config, "prefill_schedule_interval", 1)
        if self.lockstep and interval > 1:
            self.prefill_schedule_interval = interval
            engine.policy.throttle_prefills = False  # the group's cadence from now on, not the rank's own
        rank = self.add_replica(engine, DPRank)
        assert isinstance(rank, DPRank)
        self.ranks.append(rank)
        # vLLM's admission limits (sim/admission.py) count every rank's requests: the API servers add up
        # their counts (SharedAdmissionStats), and check a request before the balancer picks its rank
        # (AsyncLLM._add_request, then the engine client's add_request_async). One count for the
        # group, checked when a request is routed; each rank's finishes feed it.
        if self.ranks[0] is rank:
            self.queue_limits = engine.queue_limits
        engine.queue_limits = self.queue_limits
        engine.checks_admission = False
        return rank

    def route(self, r: Request) -> None:
        """`r` reaches the group's API server: answered 503 where vLLM's admission limits say so
        (checked at this instant, when every rank's steps that ended before it are applied: the
        arrivals are URGENT events, sim/cluster.py), else sent to the rank the balancer picks. A
        request that can never run (too long) and passes the check is routed and rejected by its
        rank, not counted: vLLM's server checks admission before it renders the prompt."""
        limits = self.queue_limits
        if limits is not None:
            reason = limits.check(r)
            if reason is not None:
                r.status = Status.REJECTED
                r.reject_reason = reason
                self.replica_of[self.position(r)] = -1  # no rank took it
                self.on_done(r, None)
                return
            if self.ranks[0].engine.cannot_run(r) is None:
                limits.count(r)
        super().route(r)

    def wake(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def on_done(self, request: Request, now: float | None) -> None:
        super().on_done(request, now)
        clients = self.clients
        if clients is not None:  # the client whose request ended sends its next
            clients.send(self.env.now if now is None else now)
            if self._client_sent is not None and not self._client_sent.triggered:
                self._client_sent.succeed()

    def _route_due(self, now: float) -> None:
        """Route the clients' requests that are through the API server by `now`."""
        pending = self.clients.pending if self.clients is not None else None
        while pending and pending[0].arrival_s <= now:
            self.route(pending.pop(0))

    def _closed_loop(self, env: simpy.Environment):
        """The arrivals of `clients`: each routed when the API server hands it over."""
        clients = self.clients
        assert clients is not None
        clients.start()
        while True:
            if clients.pending:
                arrival_s = clients.pending[0].arrival_s
                while arrival_s > env.now:
                    yield Instant(env, delay_to(env.now, arrival_s))
                self._route_due(env.now)
            elif clients.all_sent:
                break
            else:  # every client waits for its request to end
                self._client_sent = env.event()
                yield self._client_sent
                self._client_sent = None
        self.arrivals_done = True
        self.wake()

    @property
    def next_tick_s(self) -> float:
        """When the coordinator next reads the ranks (`_coordinator`); inf once it has stopped."""
        return math.inf if self.arrivals_done else self._next_tick_s

    def _coordinator(self, env: simpy.Environment):
        """Publish the ranks' last reported counts to the balancer every 0.1 s when some changed,
        every 5 s otherwise (DPCoordinatorProc.process_input_socket), while requests still arrive."""
        tick, last = 0, 0.0
        balancer: DPLoadBalancer = self.router
        while not self.arrivals_done:
            tick += 1
            self._next_tick_s = tick * STATS_UPDATE_S
            yield env.timeout(delay_to(env.now, tick * STATS_UPDATE_S))
            while env.now < tick * STATS_UPDATE_S:
                yield env.timeout(delay_to(env.now, tick * STATS_UPDATE_S))
            if not self.lockstep:  # independent engines: their counts as of now
                for rank in self.ranks:
                    rank.report()
            if self.counts_changed or env.now - last >= STATS_IDLE_S:
                balancer.lb_engines = [list(rank.reported) for rank in self.ranks]
                self.counts_changed = False
                last = env.now

    def dummy_step(self, engine: Engine) -> StepResult:
        if self._dummy is None:
            self._dummy = engine.backend.execute(dummy_batch())
        return self._dummy

    def _price(self, work: list) -> list[StepResult]:
        """Each rank's step of one lockstep step; `work`: per rank, its batch or None (a dummy step).
        A backend that prices a DP group's MoE layers (`dp_moe_parts`) prices them once from every
        rank's tokens (padded as vLLM pads them) and each rank's step with them; another prices
        each rank's batch alone."""
        backend = self.ranks[0].engine.backend
        in_lockstep = getattr(backend, "execute_in_lockstep", None)
        if in_lockstep is None:
            return [backend.execute(batch) if batch is not None else self.dummy_step(self.ranks[0].engine)
                    for batch in work]
        batches = [batch if batch is not None else dummy_batch() for batch in work]
        tokens = dp_padded_tokens([batch.num_tokens for batch in batches], self.cuda_graph_sizes)
        moe_parts = getattr(backend, "dp_moe_parts")(tokens)
        return [in_lockstep(batch, moe_parts) for batch in batches]

    def _lockstep(self, env: simpy.Environment):
        """DPEngineCoreProc.run_busy_loop for all ranks at once (module docstring).

        Asynchronous scheduling (the ranks' `Engine.asynchronous`, vLLM's AsyncScheduler with the
        batch queue, vllm/v1/engine/core.py step_with_batch_queue; docs/async-scheduling.md): a rank
        that took a real step schedules its next while that step runs, as of its start (`last_start`):
        the arrivals up to then, the requests that finished in it still holding their seats and
        blocks (`EngineState.finishing`, freed right after the schedule). Where that schedule is
        empty, the rank waits for the step, processes its output and runs a dummy batch for the next
        lockstep step (run_busy_loop: `if not executed: execute_dummy_batch()`); it then schedules at
        the step's end, as a rank that was idle does."""
        ranks = self.ranks
        running, counter = False, 0
        end_s = env.now
        last_start = env.now  # the last lockstep step's start
        pipelined = [False] * len(ranks)  # whether the rank's next step is scheduled as of `last_start`
        while True:
            now = env.now
            self._route_due(now)  # a closed loop's requests handed over at this instant
            for i, rank in enumerate(ranks):
                if not pipelined[i]:
                    rank.engine.free_finishing()  # the last step's output processed before this schedule
                rank.deliver(last_start if pipelined[i] else now)
                rank.report()
            if not running:
                if not any(rank.engine.state.has_work for rank in ranks):
                    if self.arrivals_done and all(rank.is_exhausted for rank in ranks):
                        return end_s
                    self._wake = env.event()
                    yield self._wake
                    self._wake = None
                    continue
                running = True  # a request starts a wave on every rank (START_DP_WAVE)
                self.num_waves += 1
            work: list[Batch | None] = []
            scheduled: list[tuple[int, int, int] | None] = []
            was_pipelined = list(pipelined)
            self._throttle_prefills(counter)
            for i, rank in enumerate(ranks):
                engine = rank.engine
                state = engine.state
                batch = None
                if state.has_work:
                    preempted_before = state.num_preemptions
                    batch = engine.schedule_beside_step(last_start) if pipelined[i] else engine.policy.schedule(state, now)
                engine.free_finishing()
                if batch is not None and batch.requests:
                    work.append(batch)
                    scheduled.append((state.num_preemptions - preempted_before,
                                      engine.block_manager.num_used_blocks, len(state.waiting)))
                    pipelined[i] = engine.asynchronous
                    continue
                rank.num_dummy_steps += 1
                work.append(None)
                scheduled.append(None)
                pipelined[i] = False
            if all(batch is None for batch in work):
                self._check_not_stalled(now, was_pipelined)
            results = self._price(work)
            seconds = max(result.seconds for result in results)
            steps = [(rank, batch, result, *logged) for rank, batch, result, logged
                     in zip(ranks, work, results, scheduled) if batch is not None and logged is not None]
            yield env.timeout(seconds)  # the slowest rank's step; arrivals meanwhile are routed
            last_start = now
            for rank, batch, result, num_preempted, used, waiting in steps:
                breakdown = dict(result.breakdown)
                breakdown["dp_wait"] = seconds - result.seconds
                run = single_step(now, StepResult(seconds, breakdown, result.sampled_token_ids), num_preempted, used,
                                  waiting)
                rank.engine.apply(batch, run, now)
            if steps:
                end_s = env.now
            self.num_lockstep_steps += 1
            if self.progress is not None and not self.num_lockstep_steps % 4096:
                self.progress(env.now, self.num_done)
            for rank in ranks:
                rank.report()
            counter += 1
            if counter == 1 or counter % DP_SYNC_INTERVAL == 0:  # the all-reduce of unfinished requests
                running = any(rank.engine.state.has_work for rank in ranks)
                if not running:  # the wave ends: the ranks pause, their outputs processed
                    counter = 0
                    pipelined = [False] * len(ranks)
            if self.arrivals_done and not any(rank.engine.state.has_work or rank.inbox for rank in ranks):
                for rank in ranks:
                    rank.engine.free_finishing()
                if running:  # the wave's last steps, dummy batches on every rank until the all-reduce ends it:
                    trailing = DP_SYNC_INTERVAL - counter % DP_SYNC_INTERVAL  # counted, not timed (no request
                    self.num_lockstep_steps += trailing                       # is left to answer for)
                    for rank in ranks:
                        rank.num_dummy_steps += trailing
                return end_s

    def _throttle_prefills(self, counter: int) -> None:
        """Tell each rank's policy whether this lockstep step's schedule is throttled: vLLM's
        DPEngineCoreProc._should_throttle_prefills (vllm/v1/engine/core.py),
        `prefill_schedule_interval > 1 and step_counter % prefill_schedule_interval != 0`, where
        `step_counter` is the steps the wave has taken before this one (`counter`: 0 at a wave's first
        step, so the first schedule after a pause is never throttled; run_busy_loop counts a step in
        _has_global_unfinished_reqs after it and resets the counter when a wave ends). A batch scheduled
        beside the step before it (asynchronously) is vLLM's schedule of this turn, with this counter."""
        interval = self.prefill_schedule_interval
        if interval > 1:
            throttle = counter % interval != 0
            for rank in self.ranks:
                rank.engine.policy.throttle_prefills = throttle

    def _check_not_stalled(self, now: float, was_pipelined: list[bool]) -> None:
        """Every rank ran a dummy batch: fail, as a lone engine does (Engine._wait_for_policy), where
        nothing can change what they schedule (no request runs, none will arrive, no policy's retry
        time is ahead), rather than run dummy batches for ever."""
        clients = self.clients
        if not self.arrivals_done or any(rank.inbox for rank in self.ranks) or (clients is not None and clients.pending):
            return
        if not any(rank.engine.state.waiting for rank in self.ranks):
            return  # a wave's last steps: nothing waits
        for rank, pipelined in zip(self.ranks, was_pipelined):
            state, policy = rank.engine.state, rank.engine.policy
            if pipelined or state.running or state.finishing:
                return
            retry_s = policy.retry_s(state, now) if state.waiting else None
            if retry_s is not None and retry_s > now:
                return
        stuck = next(rank for rank in self.ranks if rank.engine.state.waiting)
        raise ServesimError(
            f"policy {stuck.engine.policy.name} of DP rank {stuck.index} scheduled nothing at t={now:.6f} s with "
            f"{len(stuck.engine.state.waiting)} waiting and none running, and no request will arrive: a policy must "
            "schedule a request while any waits and nothing else can change (Policy.retry_s)")

    def run(self) -> DPResult:  # type: ignore[override]
        env = self.env
        for rank in self.ranks:
            rank.pool_size = len(self.replicas)
        env.process(self._arrivals(env) if self.clients is None else self._closed_loop(env))
        env.process(self._coordinator(env))
        if not self.lockstep:  # vLLM's EngineCoreProc per rank (core.py run_engine_core: DP lockstep is for MoE)
            engines = [env.process(rank.engine.run(env)) for rank in self.replicas]
            env.run(until=env.all_of(engines))
            return DPResult(self, env.now)
        group = env.process(self._lockstep(env))
        env.run(until=group)
        end_s: float = group.value  # type: ignore[assignment]  # _lockstep returns its last step's end
        return DPResult(self, end_s)
