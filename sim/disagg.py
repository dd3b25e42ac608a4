"""Prefill/decode disaggregation (DistServe, Splitwise, Mooncake): a prefill pool, a decode pool
and a KV link between them.

A request's life:

    arrival      the router picks a prefill replica and a decode replica, as llm-d's P/D
                 scheduler picks the decode pod and the prefill pod together
                 (llm-d-inference-scheduler docs/disagg_pd.md)
    prefill      its prompt's steps on the prefill replica; the step that computes the last
                 prompt token emits the first token (TTFT ends there) and hands the request off:
                 it leaves the running batch, its blocks stay
    transfer     its prompt's blocks (blocks * block_size * KV bytes per token) cross the link in
                 latency + bytes / bandwidth seconds, each transfer at the link's full bandwidth;
                 then the prefill replica frees them
    decode       the request waits on the decode replica until it has blocks for the context and
                 the next token, and a slot under max_num_seqs (or --max-num-active-seqs; first
                 come, first served, ahead of the replica's own preempted requests); then it
                 decodes as any running request

A request with one output token finishes on its prefill replica. Decode replicas keep no prefix
cache (their blocks hold transferred KV; the prefill pool's caches hold the prefixes). A decode
replica preempts as any engine does, by recompute: the one case of prefill on a decode replica.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sim.batch import Batch
from sim.cluster import Cluster, Instant, Replica
from sim.engine import Engine, TokenTimes
from sim.errors import ServesimError
from sim.fast_forward import Run
from sim.request import Request, Status


@dataclass(frozen=True)
class KVLink:
    """The link a request's KV blocks cross from its prefill replica to its decode replica."""

    bandwidth_gb_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0:
            raise ServesimError(f"--kv-transfer-bandwidth must be positive (GB/s), got {self.bandwidth_gb_s}")
        if not self.latency_s >= 0:
            raise ServesimError(f"--kv-transfer-latency must be at least 0 (s), got {self.latency_s}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / (self.bandwidth_gb_s * 1e9)


class PrefillEngine(Engine):
    """An engine that hands each request off once it has emitted its first token."""

    plans_runs = False  # its `apply` hands requests off after each step: every step is applied alone
    workload: "PrefillReplica"

    def apply(self, batch: Batch, run: Run, start: float) -> float:
        end = super().apply(batch, run, start)
        handed = [r for r in batch.requests if r.status is Status.RUNNING and r.num_output_tokens == 1]
        if handed:
            for r in handed:
                r.status = Status.TRANSFERRING
            self.state.running = [r for r in self.state.running if r.status is Status.RUNNING]
            for r in handed:
                self.workload.hand_off(r, end)
        return end


class PrefillReplica(Replica):
    role = "prefill"

    def __init__(self, cluster: "DisaggregatedCluster", index: int, engine: Engine):
        if not isinstance(engine, PrefillEngine):
            raise TypeError("a prefill replica runs a PrefillEngine")
        super().__init__(cluster, index, engine)
        self.releases: dict[int, float] = {}  # request index -> when its transfer ends and frees its blocks

    def transfer_bytes(self, r: Request) -> int:
        bm = self.engine.block_manager
        return bm.blocks_for(r.num_prompt_tokens) * bm.block_size * self.cluster.kv_bytes_per_token

    def hand_off(self, r: Request, now: float) -> None:
        self.cluster.start_transfer(self, r, now)

    @property
    def is_exhausted(self) -> bool:
        return self.cluster.arrivals_done and not self.inbox and not self.releases

    @property
    def next_arrival_s(self) -> float:
        return min(self.next_routed_s, min(self.releases.values(), default=math.inf))

    def on_done(self, request: Request, now: float | None) -> None:
        """Finished here (one output token) or rejected: its decode replica expects it no more."""
        super().on_done(request, now)
        self.cluster.decode_replica(request).unexpect(request)


class DecodeReplica(Replica):
    role = "decode"

    def __init__(self, cluster: "DisaggregatedCluster", index: int, engine: Engine):
        if engine.block_manager.enable_prefix_caching:
            raise ValueError("a decode replica keeps no prefix cache")
        super().__init__(cluster, index, engine)
        self.expected: dict[int, tuple[Request, PrefillReplica]] = {}  # bound here, still on their prefill replica
        self.incoming: dict[int, float] = {}  # request index -> when its transfer ends
        self.transferred: deque[Request] = deque()  # arrived, waiting for blocks

    @property
    def reacts_to_finishes(self) -> bool:
        return bool(self.transferred)  # a finish frees blocks a transferred request may take

    def expect(self, r: Request, prefill: PrefillReplica) -> None:
        self.take_route()
        self.num_routed += 1
        self.expected[r.index] = (r, prefill)
        self.num_in_flight += 1

    def unexpect(self, r: Request) -> None:
        del self.expected[r.index]
        self.num_in_flight -= 1
        if self.is_exhausted:
            self.wake()

    def on_transfer_started(self, r: Request, end_s: float) -> None:
        del self.expected[r.index]
        self.incoming[r.index] = end_s

    def receive(self, r: Request) -> None:
        del self.incoming[r.index]
        self.inbox.append(r)
        self.wake()

    @property
    def is_exhausted(self) -> bool:
        return (self.cluster.arrivals_done and not self.inbox and not self.transferred and not self.expected
                and not self.incoming)

    @property
    def next_arrival_s(self) -> float:
        """The earliest a transferred request can reach this replica: a transfer under way ends
        when it ends; one not begun ends no sooner than its prefill replica's current step plus
        its transfer time; a request not yet arrived, after its arrival."""
        t = min(self.next_routed_s, min(self.incoming.values(), default=math.inf))
        if self.expected:
            now, link = self.cluster.env.now, self.cluster.link
            for r, prefill in self.expected.values():
                t = min(t, max(now, prefill.engine.busy_until_s) + link.seconds(prefill.transfer_bytes(r)))
        return t

    def deliver(self, now: float) -> None:
        inbox = self.inbox
        while inbox:
            self.transferred.append(inbox.popleft())
        if self.transferred:
            self._admit()

    def _admit(self) -> None:
        """Give transferred requests, first come first served, blocks for their context (the
        next decode opens the next block as usual) while blocks for the context and the next
        token are free and a slot is (under the admission limit: --max-num-active-seqs, else max_num_seqs,
        as vLLM's decode instance admits KV-loaded requests through the same WAITING loop)."""
        engine = self.engine
        state, bm = engine.state, engine.block_manager
        limit = engine.policy.config.max_num_active_reqs  # --max-num-active-seqs, else max_num_seqs
        waiting = self.transferred
        while waiting and len(state.running) < limit:
            r = waiting[0]
            if bm.blocks_for(r.num_computed_tokens + 1) > bm.num_free_blocks:
                break
            waiting.popleft()
            bm.take_over(r, r.num_computed_tokens)
            r.last_scheduled_step = None  # its prefill replica's step numbers mean nothing here
            r.last_sampled_step = r.cached_short_step = -1  # (its first token is known here)
            r.status = Status.RUNNING
            state.join_running(r)


class DisaggregatedCluster(Cluster):
    """Prefill replicas (numbered first) and decode replicas, a router for each pool, a KV link."""

    def __init__(self, requests: list[Request], token_times: TokenTimes, router, decode_router, link: KVLink,
                 kv_bytes_per_token: int, progress: Callable[[float, int], None] | None = None):
        super().__init__(requests, token_times, router, progress)
        self.decode_router = decode_router
        self.link = link
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_replicas: list[PrefillReplica] = []
        self.decode_replicas: list[DecodeReplica] = []
        n = len(requests)
        self.decode_of = np.zeros(n, dtype=np.int32)
        self.transfer_start_s = np.full(n, np.nan)
        self.transfer_end_s = np.full(n, np.nan)
        self.transfer_bytes = np.zeros(n, dtype=np.int64)

    def add_prefill_replica(self, engine: PrefillEngine) -> PrefillReplica:
        if self.decode_replicas:
            raise ValueError("add the prefill replicas first: they are numbered first")
        replica = self.add_replica(engine, PrefillReplica)
        self.prefill_replicas.append(replica)
        return replica

    def add_decode_replica(self, engine: Engine) -> DecodeReplica:
        replica = self.add_replica(engine, DecodeReplica)
        self.decode_replicas.append(replica)
        return replica

    def pools(self) -> list[list[Replica]]:
        return [self.prefill_replicas, self.decode_replicas]

    def decode_replica(self, r: Request) -> DecodeReplica:
        return self.replicas[int(self.decode_of[self.position(r)])]

    def routers(self) -> list:
        return [self.router, self.decode_router]

    def choose(self, r: Request) -> tuple:
        return (self.prefill_replicas[self.router.route(r, self.prefill_replicas)],
                self.decode_replicas[self.decode_router.route(r, self.decode_replicas)])

    def place(self, r: Request, choice: tuple) -> None:
        prefill, decode = choice
        i = self.position(r)
        self.replica_of[i] = prefill.index
        self.decode_of[i] = decode.index
        bm = decode.engine.block_manager
        if r.max_tokens > 1 and bm.blocks_for(r.max_kv_tokens) > bm.num_blocks:
            prefill.take_route()  # counted on neither replica
            decode.take_route()
            r.status = Status.REJECTED
            r.reject_reason = (f"needs {bm.blocks_for(r.max_kv_tokens)} KV blocks, the decode replica's whole "
                               f"cache has {bm.num_blocks}")
            self.on_done(r, None)
            return
        decode.expect(r, prefill)
        prefill.push(r)

    def start_transfer(self, prefill: PrefillReplica, r: Request, now: float) -> None:
        num_bytes = prefill.transfer_bytes(r)
        seconds = self.link.seconds(num_bytes)
        end = now + seconds  # the instant the event below fires
        i = self.position(r)
        self.transfer_start_s[i], self.transfer_end_s[i], self.transfer_bytes[i] = now, end, num_bytes
        decode = self.decode_replica(r)
        decode.on_transfer_started(r, end)
        prefill.releases[r.index] = end
        Instant(self.env, seconds).callbacks.append(lambda _: self._transfer_done(prefill, decode, r))

    def _transfer_done(self, prefill: PrefillReplica, decode: DecodeReplica, r: Request) -> None:
        prefill.engine.block_manager.free(r)
        r.drop_block_hashes()
        del prefill.releases[r.index]
        prefill.num_in_flight -= 1
        prefill.wake()  # its freed blocks may let a waiting request in, or it may be done
        decode.receive(r)

    def transfers(self) -> dict:
        return {"decode_replica": self.decode_of, "start_s": self.transfer_start_s, "end_s": self.transfer_end_s,
                "bytes": self.transfer_bytes}
