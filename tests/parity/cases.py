"""The parity cases: traces, options and a step-time function, run through vLLM's V1 scheduler
and through servesim, and how their answers are compared.

Times are whole numbers of seconds (the step-time function and the arrivals are integers), so
both simulators' clocks add exactly and any difference is a scheduling difference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tests.parity.vllm_driver import EngineSetup, Timeline
from traces.trace import Trace


def step_time(scheduled: list[int], contexts: list[int]) -> float:
    """A step costs a fixed part, a part per request, per token computed and per 16 tokens read."""
    return float(20 + 2 * len(scheduled) + sum(scheduled) + sum(contexts) // 16)


@dataclass(frozen=True)
class Case:
    name: str
    trace: Trace
    setup: EngineSetup
    priority: tuple[int, ...] | None = None  # per request, lower first (scheduling_policy="priority")


def _trace(rows, hash_ids=None, hash_block_tokens=512) -> Trace:
    arrival = np.array([r[0] for r in rows], dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    rows = [rows[i] for i in order]
    hashes = None if hash_ids is None else [np.asarray(hash_ids[i], dtype=np.int64) for i in order]
    return Trace(np.array([r[0] for r in rows], dtype=np.float64), np.array([r[1] for r in rows], dtype=np.int64),
                 np.array([r[2] for r in rows], dtype=np.int64), hash_ids=hashes,
                 hash_block_tokens=hash_block_tokens, source="parity")


def bursty_rows(seed: int, n: int, max_prompt: int, max_output: int) -> list[tuple[float, int, int]]:
    """Requests in bursts: a burst of 1-8 requests at one instant, exponential gaps between bursts."""
    rng = np.random.default_rng(seed)
    rows, t = [], 0.0
    while len(rows) < n:
        t += float(np.floor(rng.exponential(300.0)))
        for _ in range(min(int(rng.integers(1, 9)), n - len(rows))):
            rows.append((t, int(rng.integers(1, max_prompt + 1)), int(rng.integers(1, max_output + 1))))
    return rows


def shared_prefix_hashes(seed: int, rows, hash_block_tokens: int, num_families: int = 6):
    """Hash ids as a Mooncake trace gives them: each request takes the leading ids of one of a few
    shared "documents" (a random number of them), then ids of its own."""
    rng = np.random.default_rng(seed + 1000)
    families = [np.arange(f * 1000, f * 1000 + 200) for f in range(num_families)]
    out, own = [], 10**6
    for _, prompt, _ in rows:
        num_ids = -(-prompt // hash_block_tokens)
        shared = min(num_ids, int(rng.integers(0, num_ids + 1)))
        fam = families[int(rng.integers(0, num_families))]
        ids = list(fam[:shared]) + list(range(own, own + num_ids - shared))
        own += num_ids
        out.append(ids)
    return out


def bursty_traces(seed: int, priority_seed: int | None = None):
    """The bursty trace of `seed` (200 requests, prompts up to 800 tokens, outputs up to 64), the same with
    shared-prefix hash ids (32-token blocks), and with `priority_seed` each request's priority (0-3)."""
    rows = bursty_rows(seed, 200, 800, 64)
    trace = _trace(rows)
    hashed = _trace(rows, shared_prefix_hashes(seed, rows, 32), hash_block_tokens=32)
    priority = None if priority_seed is None else tuple(
        int(p) for p in np.random.default_rng(priority_seed).integers(0, 4, len(trace)))
    return trace, hashed, priority


def all_cases() -> list[Case]:
    cases = [
        # A prompt chunked over several steps, alone.
        Case("hand-chunked-prefill", _trace([(0, 40, 5)]), EngineSetup(max_num_batched_tokens=16, max_num_seqs=4)),
        # The issue's reproduction: request 0's decode preempts request 1 at step 10.
        Case("hand-preempt-other", _trace([(0, 7, 11), (0, 10, 13)]),
             EngineSetup(num_gpu_blocks=3, max_num_batched_tokens=16, max_num_seqs=4)),
        # Arrivals during decodes; a new prompt mixes with running decodes.
        Case("hand-mixed", _trace([(0, 30, 6), (25, 50, 4), (30, 5, 9), (100, 70, 3)]),
             EngineSetup(max_num_batched_tokens=32, max_num_seqs=3)),
        # Two requests with the same 64-token prefix, the second after the first finished.
        Case("hand-shared-prefix", _trace([(0, 70, 3), (500, 80, 3)], hash_ids=[[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]],
                                          hash_block_tokens=16),
             EngineSetup(max_num_batched_tokens=64, max_num_seqs=4)),
        # A request's generated blocks are cached, so a later eviction takes another prefix's block
        # (tests/test_vllm_v1_rules.py works it out by hand).
        Case("hand-eviction-order", _trace([(0, 8, 1), (0, 4, 6), (6, 12, 1), (6.5, 12, 1)],
                                           hash_ids=[[1, 2], [9], [20, 21, 22], [1, 2, 7]], hash_block_tokens=4),
             EngineSetup(block_size=4, num_gpu_blocks=6, max_num_batched_tokens=16, max_num_seqs=4)),
        # The tests/test_vllm_v1_rules.py timelines of priority preemption and the long-prefill cap.
        Case("hand-priority-preempt", _trace([(0, 1, 8), (1, 4, 8)]),
             EngineSetup(block_size=4, num_gpu_blocks=4, max_num_batched_tokens=16, max_num_seqs=4,
                         scheduling_policy="priority"), priority=(1, 0)),
        Case("hand-priority-order", _trace([(0, 8, 1), (0, 8, 1), (0, 8, 1), (0.5, 8, 1)]),
             EngineSetup(max_num_batched_tokens=8, max_num_seqs=4, scheduling_policy="priority"),
             priority=(2, 1, 2, 0)),
        Case("hand-threshold", _trace([(0, 14, 2), (0, 6, 1)]),
             EngineSetup(max_num_batched_tokens=16, max_num_seqs=4, long_prefill_token_threshold=4)),
    ]
    for seed in range(4):
        trace, hashed, _ = bursty_traces(seed)
        cases.append(Case(f"bursty-ample-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                     num_gpu_blocks=20000)))
        cases.append(Case(f"bursty-tight-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                     num_gpu_blocks=300, enable_prefix_caching=False)))
        cases.append(Case(f"bursty-tight-cached-{seed}", trace,
                          EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300)))
        cases.append(Case(f"prefix-ample-{seed}", hashed, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                      num_gpu_blocks=20000)))
        cases.append(Case(f"prefix-tight-{seed}", hashed, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                      num_gpu_blocks=300)))
        cases.append(Case(f"prefix-small-cache-{seed}", hashed,
                          EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=1200)))
    for seed in range(2):
        trace, hashed, priority = bursty_traces(10 + seed, priority_seed=20 + seed)
        cases.append(Case(f"threshold-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                  long_prefill_token_threshold=96,
                                                                  num_gpu_blocks=400)))
        cases.append(Case(f"no-reserve-isl-{seed}", trace,
                          EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300,
                                      reserve_full_isl=False)))
        cases.append(Case(f"priority-tight-{seed}", trace,
                          EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300,
                                      scheduling_policy="priority"), priority=priority))
        cases.append(Case(f"priority-prefix-{seed}", hashed,
                          EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=500,
                                      scheduling_policy="priority", long_prefill_token_threshold=128),
                          priority=priority))
    return cases


@dataclass(frozen=True)
class Agreement:
    num_requests: int
    num_requests_agreeing: int  # same first-token and finish times
    steps_agree: bool  # same per-step prefill tokens, decode tokens and preemptions
    first_step_differing: int | None
    prefix_stats_agree: bool

    @property
    def agrees(self) -> bool:
        return self.num_requests_agreeing == self.num_requests and self.steps_agree and self.prefix_stats_agree


def compare(vllm: Timeline, servesim: Timeline) -> Agreement:
    n = len(vllm.finish_s)
    same = sum(1 for i in range(n) if vllm.first_token_s[i] == servesim.first_token_s[i]
               and vllm.finish_s[i] == servesim.finish_s[i])
    first = next((k for k, (a, b) in enumerate(zip(vllm.steps, servesim.steps)) if a != b), None)
    if first is None and len(vllm.steps) != len(servesim.steps):
        first = min(len(vllm.steps), len(servesim.steps))
    stats = (vllm.prefix_queries, vllm.prefix_hits) == (servesim.prefix_queries, servesim.prefix_hits)
    return Agreement(n, same, first is None, first, stats)


def with_setup(case: Case, **changes) -> Case:
    return replace(case, setup=replace(case.setup, **changes))


def async_variant(case: Case) -> Case:
    """The case under vLLM's asynchronous scheduling (AsyncScheduler, batch queue of 2), named `<name>-async`."""
    return replace(with_setup(case, async_scheduling=True), name=f"{case.name}-async")


def async_cases() -> list[Case]:
    """Every case, scheduled asynchronously: vLLM's side runs (tests/parity/vllm_driver.py: run_vllm_async);
    servesim's side joins when its engine has the asynchronous clock (docs/async-scheduling.md)."""
    return [async_variant(case) for case in all_cases()]


def sliding_cases() -> list[Case]:
    """A model whose every layer slides (vLLM's SlidingWindowManager; servesim's
    sim/sliding_block_manager.py): hand cases, then bursty traces with and without shared prefixes,
    under ample and tight memory, windows shorter and longer than the prompts."""
    cases = [
        # A prompt longer than its window, chunked: the blocks before the window go as it slides.
        Case("sliding-hand-chunked", _trace([(0, 90, 20)]),
             EngineSetup(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, sliding_window=10)),
        # Two requests share a prefix; the second finds the window's blocks before its hit cached.
        Case("sliding-hand-shared", _trace([(0, 70, 3), (500, 80, 3)], hash_ids=[[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]],
                                           hash_block_tokens=16),
             EngineSetup(max_num_batched_tokens=64, max_num_seqs=4, sliding_window=20)),
        # Tight memory: decodes that slide free blocks for the others, preemptions.
        Case("sliding-hand-tight", _trace([(0, 30, 40), (0, 30, 40), (1, 30, 40)]),
             EngineSetup(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=16, max_num_seqs=4, sliding_window=8)),
    ]
    for seed in range(3):
        rows = bursty_rows(30 + seed, 150, 800, 96)
        trace = _trace(rows)
        hashed = _trace(rows, shared_prefix_hashes(30 + seed, rows, 32), hash_block_tokens=32)
        for window in (64, 300):
            cases.append(Case(f"sliding-{window}-ample-{seed}", trace,
                              EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=20000,
                                          sliding_window=window)))
            cases.append(Case(f"sliding-{window}-tight-{seed}", trace,
                              EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=120,
                                          enable_prefix_caching=False, sliding_window=window)))
            cases.append(Case(f"sliding-{window}-prefix-{seed}", hashed,
                              EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=2000,
                                          sliding_window=window)))
            cases.append(Case(f"sliding-{window}-prefix-tight-{seed}", hashed,
                              EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=200,
                                          sliding_window=window)))
    return cases


def hybrid_cases() -> list[Case]:
    """The same runs with a sliding group and a full-attention group sharing the pool (vLLM's
    HybridKVCacheCoordinator; gpt-oss, Gemma 2), named `hybrid-...`. `sliding-hand-tight` is left out:
    a request needs more blocks than its 20 (vLLM stalls with it waiting; servesim rejects it)."""
    cases = [replace(with_setup(case, hybrid=True), name=case.name.replace("sliding", "hybrid", 1))
             for case in sliding_cases() if case.name != "sliding-hand-tight"]
    # A shared prompt preempted in a tight pool (16 blocks, 8 a group): its indexed prompt blocks stay
    # cached when it leaves (found by tests/test_hybrid_blocks.py's property, asynchronously).
    shared = [[0, 1]] * 3 + [[0, 1] * 3]
    cases.append(Case("hybrid-hand-shared-tight", _trace([(0, 1, 1), (0, 1, 1), (0, 1, 1), (0, 20, 2)],
                                                         hash_ids=shared, hash_block_tokens=4),
                      EngineSetup(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
                                  sliding_window=16, hybrid=True)))
    return cases


def no_hybrid_cases() -> list[Case]:
    """The sliding and hybrid cases under vLLM's --disable-hybrid-kv-cache-manager, named `no-hybrid-...`:
    vLLM's scheduler over the groups its get_kv_cache_groups makes with the flag (the hybrid cases: one
    full-attention group of both layers, FullAttentionManager; the sliding cases: unchanged, a model
    whose every layer slides keeps its SlidingWindowManager)."""
    return [replace(with_setup(case, disable_hybrid_kv_cache_manager=True), name=f"no-hybrid-{case.name}")
            for case in sliding_cases() + hybrid_cases()]


def cache_aware_cases() -> list[Case]:
    """vLLM 0.34's cache-aware admission (`--cache-aware-admission-window`; skipped on a vLLM without
    it): a hand case where the window moves a request with a cached prefix ahead of an earlier one,
    the same under a threshold the cache's usage does not reach (no reordering), and the bursty
    shared-prefix traces under tight and small caches (preempted requests keep their places)."""
    # Request 0 (t = 0) caches blocks [1, 2, 3, 4]; at t = 30, during its decodes, A ([7, 8, 9, 10]) and
    # then B ([1, 2, 3, 11]: three blocks cached) arrive, with one seat free: B goes first.
    rows = [(0, 64, 30), (30, 64, 4), (30, 64, 4)]
    hashes = [[1, 2, 3, 4], [7, 8, 9, 10], [1, 2, 3, 11]]
    hand = _trace(rows, hash_ids=hashes, hash_block_tokens=16)
    cases = [
        Case("cache-aware-hand", hand, EngineSetup(max_num_batched_tokens=64, max_num_seqs=2, num_gpu_blocks=100,
                                                   cache_aware_admission_window=2,
                                                   cache_aware_admission_threshold=0.0)),
        Case("cache-aware-hand-below-threshold", hand,
             EngineSetup(max_num_batched_tokens=64, max_num_seqs=2, num_gpu_blocks=100,
                         cache_aware_admission_window=2, cache_aware_admission_threshold=0.5)),
    ]
    for seed in range(2):
        _, hashed, _ = bursty_traces(seed)
        for blocks, window, threshold in ((300, 4, 0.5), (1200, 16, 0.0), (600, 8, 0.5)):
            cases.append(Case(f"cache-aware-{blocks}-w{window}-{seed}", hashed,
                              EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=blocks,
                                          cache_aware_admission_window=window,
                                          cache_aware_admission_threshold=threshold)))
    return cases


def watermark_cases() -> list[Case]:
    """vLLM's `--watermark`: blocks kept free when admitting while any request runs. A hand case
    where it holds the second request back until the first finishes, then bursty traces under tight
    caches (preemptions, whose re-admissions it also guards), with and without shared prefixes, a
    sliding window and the whole-sequence reservation off."""
    # 20 usable blocks (21 in vLLM's pool): watermark 0.3 keeps int(0.3 x 21) = 6 free. R0 (prompt 160: 10
    # blocks, output 40) runs; R1 (prompt 96: 6 blocks) at t = 30 finds 10 - 1 = 9 free, fewer than 6 + 6.
    hand = _trace([(0, 160, 40), (30, 96, 4)])
    cases = [
        Case("watermark-hand", hand, EngineSetup(max_num_batched_tokens=256, max_num_seqs=4, num_gpu_blocks=20,
                                                 watermark=0.3)),
        Case("watermark-hand-off", hand, EngineSetup(max_num_batched_tokens=256, max_num_seqs=4, num_gpu_blocks=20)),
    ]
    for seed in range(2):
        trace, hashed, _ = bursty_traces(30 + seed)
        cases += [
            Case(f"watermark-tight-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                               num_gpu_blocks=300, watermark=0.1)),
            Case(f"watermark-prefix-{seed}", hashed, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                 num_gpu_blocks=500, watermark=0.25)),
            Case(f"watermark-no-reserve-isl-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300, watermark=0.05,
                             reserve_full_isl=False)),
            Case(f"watermark-sliding-{seed}", hashed,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=100, watermark=0.2,
                             sliding_window=128)),
        ]
    return cases


def adaptive_threshold_cases() -> list[Case]:
    """vLLM's `--long-prefill-token-threshold-adaptive`: the long-prefill cap raised to the budget over
    the requests running and waiting. A hand case (two prompts: a cap of 4 becomes 16 // 2 = 8), then
    bursty traces with tight and ample caches, shared prefixes and priorities."""
    cases = [Case("adaptive-hand", _trace([(0, 30, 2), (0, 30, 1)]),
                  EngineSetup(max_num_batched_tokens=16, max_num_seqs=4, long_prefill_token_threshold=4,
                              long_prefill_token_threshold_adaptive=True))]
    for seed in range(2):
        trace, hashed, priority = bursty_traces(40 + seed, priority_seed=50 + seed)
        cases += [
            Case(f"adaptive-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=400,
                                                        long_prefill_token_threshold=32,
                                                        long_prefill_token_threshold_adaptive=True)),
            Case(f"adaptive-prefix-tight-{seed}", hashed,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300,
                             long_prefill_token_threshold=16, long_prefill_token_threshold_adaptive=True)),
            Case(f"adaptive-priority-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300,
                             scheduling_policy="priority", long_prefill_token_threshold=8,
                             long_prefill_token_threshold_adaptive=True), priority=priority),
        ]
    return cases


def cadence_cases() -> list[Case]:
    """vLLM's `--prefill-schedule-interval` (the local prefill cadence): a hand case, then bursty traces
    under ample and tight caches, with the long-prefill cap, shared prefixes and priorities."""
    cases = [Case("cadence-hand", _trace([(0, 20, 30), (45, 40, 5), (90, 10, 5), (95, 10, 5)]),
                  EngineSetup(max_num_batched_tokens=16, max_num_seqs=4, prefill_schedule_interval=3)),
             # Found by the invariants property: the only decode is preempted (no block) while the cadence holds
             # the other request's prefill chunk, so the step schedules nothing; vLLM runs it empty and schedules
             # again at once (servesim stopped with "scheduled nothing").
             Case("cadence-preempt-empty", _trace([(0, 1, 1), (0, 22, 1), (0.1, 22, 2)],
                                                  [[100], [0, 101] * 3, [0, 102] * 3], hash_block_tokens=4),
                  EngineSetup(block_size=2, num_gpu_blocks=21, max_num_batched_tokens=2, max_num_seqs=2,
                              long_prefill_token_threshold=1, prefill_schedule_interval=2, reserve_full_isl=False))]
    for seed in range(2):
        trace, hashed, priority = bursty_traces(60 + seed, priority_seed=70 + seed)
        cases += [
            Case(f"cadence-ample-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                             num_gpu_blocks=20000, prefill_schedule_interval=4)),
            Case(f"cadence-tight-{seed}", hashed, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                              num_gpu_blocks=300, prefill_schedule_interval=3)),
            Case(f"cadence-threshold-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=400,
                             long_prefill_token_threshold=64, prefill_schedule_interval=2)),
            Case(f"cadence-priority-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300,
                             scheduling_policy="priority", prefill_schedule_interval=5), priority=priority),
        ]
    return cases


def active_seqs_cases() -> list[Case]:
    """vLLM's `max_num_active_seqs`: the admission limit into RUNNING, below max_num_seqs. A hand case
    where it holds the third request back until one of the first two finishes (and the same without
    it), then bursty traces where it binds: an ample cache, a tight one (preempted requests come back
    under it), shared prefixes, priorities with the long-prefill cap, and beside the watermark."""
    # Three prompts of 10 tokens at t = 0, budget 64: with a limit of 2, R2 waits for R0 (output 3) to finish.
    hand = _trace([(0, 10, 3), (0, 10, 8), (0, 10, 4)])
    cases = [
        Case("active-seqs-hand", hand, EngineSetup(max_num_batched_tokens=64, max_num_seqs=4, max_num_active_seqs=2)),
        Case("active-seqs-hand-off", hand, EngineSetup(max_num_batched_tokens=64, max_num_seqs=4)),
    ]
    for seed in range(2):
        trace, hashed, priority = bursty_traces(80 + seed, priority_seed=90 + seed)
        cases += [
            Case(f"active-seqs-ample-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                 num_gpu_blocks=20000, max_num_active_seqs=4)),
            Case(f"active-seqs-tight-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                 num_gpu_blocks=250, max_num_active_seqs=8)),
            Case(f"active-seqs-prefix-{seed}", hashed, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                   num_gpu_blocks=400, max_num_active_seqs=6)),
            Case(f"active-seqs-priority-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=200,
                             scheduling_policy="priority", long_prefill_token_threshold=32, max_num_active_seqs=8),
                 priority=priority),
            Case(f"active-seqs-watermark-{seed}", hashed,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300, watermark=0.1,
                             max_num_active_seqs=10)),
        ]
    return cases


def wave_rows(seed: int, num_waves: int = 30) -> list[tuple[float, int, int]]:
    """Waves of a DP rank: every 3,000 s (long enough for the last wave to end) a request, then 1-3 more
    while it decodes, 0-150 s after it: where they land in the cadence depends on the counter's restart."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(num_waves):
        start = 3000.0 * k
        rows.append((start, int(rng.integers(1, 120)), int(rng.integers(5, 40))))
        for _ in range(int(rng.integers(1, 4))):
            rows.append((start + float(rng.integers(0, 151)), int(rng.integers(1, 120)), int(rng.integers(1, 30))))
    return rows


def dp_cadence_cases() -> list[Case]:
    """`--prefill-schedule-interval` on one DP rank of a mixture of experts (`moe_dp_rank`): vLLM's Scheduler
    made as a DP rank's, driven by DPEngineCoreProc's busy loop with `schedule(throttle_prefills)` from the
    shared step counter (tests/parity/vllm_driver.py, DPRankLoop), against a lockstep DP group of that rank.
    The bursty traces' gaps end waves (at the 16th step's all-reduce) and requests arrive among a wave's
    dummy batches; interval 1 checks the busy loop itself."""
    hand = _trace([(0, 20, 30), (45, 40, 5), (90, 10, 5), (95, 10, 5), (1500, 30, 8), (1510, 10, 3)])
    cases = [Case("dp-cadence-hand", hand, EngineSetup(max_num_batched_tokens=16, max_num_seqs=4,
                                                        prefill_schedule_interval=3, moe_dp_rank=True)),
             Case("dp-cadence-hand-seats", hand, EngineSetup(max_num_batched_tokens=64, max_num_seqs=2,
                                                              prefill_schedule_interval=2, moe_dp_rank=True))]
    for seed in range(2):
        trace, hashed, priority = bursty_traces(60 + seed, priority_seed=70 + seed)
        cases += [
            Case(f"dp-cadence-waves-{seed}", _trace(wave_rows(80 + seed)),
                 EngineSetup(max_num_batched_tokens=64, max_num_seqs=8, prefill_schedule_interval=3 + 2 * seed,
                             moe_dp_rank=True)),
            Case(f"dp-cadence-every-step-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                     num_gpu_blocks=20000, moe_dp_rank=True)),
            Case(f"dp-cadence-ample-{seed}", trace, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                num_gpu_blocks=20000, prefill_schedule_interval=4,
                                                                moe_dp_rank=True)),
            Case(f"dp-cadence-tight-{seed}", hashed, EngineSetup(max_num_batched_tokens=256, max_num_seqs=16,
                                                                 num_gpu_blocks=300, prefill_schedule_interval=3,
                                                                 moe_dp_rank=True)),
            Case(f"dp-cadence-threshold-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=400,
                             long_prefill_token_threshold=64, prefill_schedule_interval=2, moe_dp_rank=True)),
            Case(f"dp-cadence-priority-{seed}", trace,
                 EngineSetup(max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=300,
                             scheduling_policy="priority", prefill_schedule_interval=5, moe_dp_rank=True),
                 priority=priority),
        ]
    return [case for base in cases for case in (base, async_variant(base))]


def option_cases() -> list[Case]:
    """The cases of vLLM's scheduler options, each also asynchronously (`<name>-async`)."""
    families = (cache_aware_cases(), watermark_cases(), adaptive_threshold_cases(), cadence_cases(),
                active_seqs_cases())
    return [case for cases in families for base in cases for case in (base, async_variant(base))]
