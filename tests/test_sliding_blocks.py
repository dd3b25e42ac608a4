"""A model whose every layer slides (Mistral-7B-v0.1): sim/sliding_block_manager.py, vLLM 0.33's
SlidingWindowManager under the unitary coordinator. Worked examples by hand (the blocks a request
holds as its window slides, a prefix hit after the cache evicted the prompt's first blocks),
blocks conserved and each request under vLLM's admission cap on random workloads, and the plan
and the KV capacity of such a model. tests/parity/test_sliding_window_parity.py runs it against
vLLM's own scheduler."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.hardware import resolve_hardware
from backends.kv_capacity import kv_capacity
from backends.model_config import ModelConfig
from sim.block_manager import BlockManager
from sim.config import SchedulerConfig
from sim.errors import ServesimError
from sim.request import Request
from sim.sliding_block_manager import SlidingWindowBlockManager
from tests.helpers import replay_with_blocks
from tests.moe_configs import MISTRAL_7B_V01

SLIDING = "sliding_attention"  # a model whose every layer slides: one group


def held(r: Request) -> int:
    return sum(b is not None for b in r.block_table)


def test_a_chunked_prompt_holds_its_window_worked_by_hand():
    # Window 10, blocks of 4, a 90-token prompt in chunks of 16. A request frees the blocks wholly
    # before its window when it is next scheduled: max(0, C - 10 + 1) // 4 of them once C tokens
    # are computed (SlidingWindowManager.get_num_skipped_tokens, remove_skipped_blocks).
    bm = SlidingWindowBlockManager(100, 4, False, ((SLIDING, 10),), 9 + 16)
    assert bm.max_admission_blocks == 8  # cdiv(9 + 16, 4) + 1
    r = Request(0, "0", 0.0, 90, 5)
    bm.allocate(r, [], 16)
    assert (len(r.block_table), held(r)) == (4, 4)
    r.num_computed_tokens = 16
    assert bm.can_append(r, 16)  # frees (16 - 9) // 4 = 1 block first
    assert (len(r.block_table), held(r)) == (4, 3) and r.block_table[0] is None
    bm.append(r, 16)
    assert (len(r.block_table), held(r)) == (8, 7)
    for computed in (32, 48, 64):  # (C - 9) // 4 = 5, 9, 13 skipped; 12, 16, 20 entries
        r.num_computed_tokens = computed
        bm.append(r, 16)
        assert (len(r.block_table), held(r)) == (computed // 4 + 4, computed // 4 + 4 - (computed - 9) // 4)
        assert held(r) <= bm.max_admission_blocks
    r.num_computed_tokens = 80
    bm.append(r, 10)  # the last 10 prompt tokens: 23 entries, (80 - 9) // 4 = 17 skipped
    assert (len(r.block_table), held(r)) == (23, 6)
    r.num_computed_tokens, r.num_output_tokens = 90, 1
    bm.append(r, 1)  # the first decode: (90 - 9) // 4 = 20 skipped
    assert (len(r.block_table), held(r), bm.num_used_blocks) == (23, 3, 3)
    assert r.block_table[:20] == [None] * 20
    bm.free(r)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 100
    bm.check_invariants([])


def test_a_prefix_hit_needs_only_the_windows_blocks_worked_by_hand():
    # Window 20, blocks of 4: a hit needs cdiv(19, 4) = 5 cached blocks before its end
    # (SlidingWindowManager.find_longest_cache_hit). Request a's 64-token prompt is shared by b.
    bm = SlidingWindowBlockManager(21, 4, True, ((SLIDING, 20),), 19 + 64)
    ids = np.arange(100, 116)  # 16 trace blocks of 4 tokens
    a = Request(0, "a", 0.0, 64, 2, hash_ids=ids, hash_block_tokens=4)
    bm.allocate(a, [], 64)
    assert a.num_hashed_blocks == 16  # every full block is cached when its tokens are scheduled
    a.num_computed_tokens, a.num_output_tokens = 64, 1
    bm.append(a, 1)  # (64 - 19) // 4 = 11 blocks before the window go, last first, to the queue's tail
    assert held(a) == 6 and bm.cached_free_blocks() == list(range(10, -1, -1))
    a.num_computed_tokens, a.num_output_tokens = 65, 2
    bm.free(a)  # last first: its decode block 16 (not full: no hash) to the head, then 15 ... 11 to the tail
    assert bm.cached_free_blocks() == list(range(10, -1, -1)) + [15, 14, 13, 12, 11]
    # Another request takes 16 blocks: the five without a hash (16 ... 20), then it evicts a's
    # blocks 10 ... 0, the prompt's first eleven.
    other = Request(1, "x", 0.0, 64, 1)
    bm.allocate(other, [], 64)
    assert other.block_table == [16, 17, 18, 19, 20] + list(range(10, -1, -1))
    assert bm.cached_free_blocks() == [15, 14, 13, 12, 11]
    bm.free(other)
    b = Request(2, "b", 1.0, 80, 2, hash_ids=np.concatenate([ids, [900, 901, 902, 903]]), hash_block_tokens=4)
    cached = bm.cached_prefix(b)
    # From the right, blocks 15 ... 11 are cached: five, a window's. The hit is 16 blocks (64 tokens),
    # the first eleven null; (64 - 19) // 4 = 11 are before the window, so b takes the five, all free.
    assert list(cached) == [None] * 11 + [11, 12, 13, 14, 15] and cached.num_free == 5
    assert len(BlockManager.cached_prefix(bm, b)) == 0  # (full attention would need block 0: evicted)
    assert bm.allocate(b, cached, 16) == 64
    # Its 16 new tokens take 4 blocks from the queue's head: other's, freed last first.
    assert b.block_table == [None] * 11 + [11, 12, 13, 14, 15] + [0, 1, 2, 3] and held(b) == 9
    assert (bm.num_hit_tokens, bm.num_queried_tokens) == (64, 64 + 64 + 80)
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])


def test_admission_checks_the_capped_sequence_then_the_first_chunk():
    # allocate_slots with full_sequence_must_fit: min(cdiv(tokens, B), max_admission_blocks) blocks
    # first, then the first chunk's, uncapped (get_num_blocks_to_allocate).
    bm = SlidingWindowBlockManager(10, 4, False, ((SLIDING, 8),), 7 + 8)  # cap: cdiv(15, 4) + 1 = 5 blocks
    r = Request(0, "0", 0.0, 400, 1)
    none = bm.cached_prefix(r)
    assert bm.can_allocate(none, 400, 8)  # 100 blocks capped at 5; the chunk needs 2
    assert not bm.can_allocate(none, 400)  # uncapped, the whole prompt at once: 100 blocks
    assert bm.can_allocate(none, 40) and not bm.can_allocate(none, 44)  # a first chunk of 40 tokens fits, 44 does not
    assert not bm.can_allocate(none, 400, 44)
    assert bm.max_blocks_needed(400) == 5 and bm.max_request_tokens() == 1 << 62  # any length runs


def test_scheduled_beside_a_step_in_flight_its_tokens_are_not_yet_computed():
    # Asynchronous scheduling: vLLM frees the blocks before the window of the tokens whose step has
    # ended (allocate_slots: num_computed_tokens - num_in_flight_tokens). The engine sets
    # `pipelined` while it schedules beside a step in flight; a step's tokens are in flight until the
    # next step ends (`slide`).
    bm = SlidingWindowBlockManager(100, 4, False, ((SLIDING, 10),), 9 + 2 * 16)
    r = Request(0, "0", 0.0, 90, 5)
    bm.allocate(r, [], 16)
    bm.slide([r])  # step 1 ended; its 16 tokens are in flight while step 2 is scheduled
    r.num_computed_tokens = 16
    bm.pipelined = True
    bm.append(r, 16)  # 16 - 16 = 0 tokens done: nothing freed yet
    assert (len(r.block_table), held(r)) == (8, 8)
    bm.pipelined = False
    bm.slide([r])
    r.num_computed_tokens = 32
    bm.pipelined = True
    bm.append(r, 16)  # 32 - 16 = 16 done: (16 - 9) // 4 = 1 freed
    assert (len(r.block_table), held(r)) == (12, 11)
    bm.pipelined = False
    bm.append(r, 0)  # not beside a step in flight: 32 done, (32 - 9) // 4 = 5 freed
    assert held(r) == 7
    bm.free(r)
    bm.check_invariants([])


def test_no_stretch_of_a_window_hits_the_cached_blocks_from_the_start():
    bm = SlidingWindowBlockManager(40, 4, True, ((SLIDING, 20),), 19 + 64)
    a = Request(0, "a", 0.0, 12, 1, hash_ids=np.arange(3), hash_block_tokens=4)
    bm.allocate(a, [], 12)
    bm.free(a)
    b = Request(1, "b", 0.0, 40, 1, hash_ids=np.concatenate([np.arange(3), [50] * 7]), hash_block_tokens=4)
    assert list(bm.cached_prefix(b)) == [0, 1, 2]  # three cached from the start: fewer than a window's five, a hit


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 200), st.integers(1, 40), st.integers(0, 3)),
                min_size=1, max_size=20),
       st.integers(12, 80), st.sampled_from([5, 16, 33]), st.booleans(), st.booleans(), st.booleans())
def test_blocks_conserved_and_each_request_under_the_admission_cap(rows, num_blocks, window, caching, reserve,
                                                                   asynchronous):
    budget = 32  # the cap counts the batches in flight: two asynchronously (sim/app/plan.py max_in_flight_tokens)
    bm = SlidingWindowBlockManager(num_blocks, 4, caching, ((SLIDING, window),), window - 1 + (1 + asynchronous) * budget)

    def check(batch, running):  # at every step: the pool adds up; a scheduled request holds at most the cap
        bm.check_invariants(running)
        for r in batch.requests:
            assert held(r) <= bm.max_admission_blocks

    replay_with_blocks(bm, rows, SchedulerConfig("chunked", max_num_batched_tokens=budget, max_num_seqs=4,
                                                 reserve_full_isl=reserve, async_scheduling=asynchronous), check)


def _mistral(tmp_path, **changes) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**MISTRAL_7B_V01, **changes}))
    return str(tmp_path)


def test_the_plan_builds_the_sliding_manager(tmp_path):
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve

    folder = _mistral(tmp_path)
    bm = resolve(ReplayOptions(model=folder, hardware="H100-SXM"), build_backend=False).make_block_manager()
    assert type(bm) is SlidingWindowBlockManager and bm.window == 4096
    assert bm.max_admission_blocks == -(-(4095 + 2 * 2048) // 16) + 1  # two batches in flight, asynchronously
    options = ReplayOptions(model=folder, hardware="H100-SXM",
                            scheduler=SchedulerConfig("chunked", 2048, 256, async_scheduling=False))
    sync = resolve(options, build_backend=False).make_block_manager()
    assert sync.max_admission_blocks == -(-(4095 + 2048) // 16) + 1  # one batch without (max_concurrent_batches)


def test_a_sliding_model_starts_when_its_window_fits(tmp_path):
    # vLLM checks that one request of max_model_len fits in the blocks it may hold at once
    # (SlidingWindowSpec.max_memory_usage_bytes): a window's and two batches', cdiv(4095 + 4096, 16) + 1
    # = 513 blocks, not max_model_len's 2,048.
    model = ModelConfig.from_hf(_mistral(tmp_path))
    hardware = resolve_hardware("A100-80GB")
    args = dict(block_size=16, max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=32768)
    kv = kv_capacity(model, hardware, gpu_memory_utilization=0.2, **args)
    assert 513 <= kv.num_gpu_blocks < 2048
    assert kv.vllm["groups"] == [{"kind": "sliding_attention", "num_layers": 32, "sliding_window": 4096,
                                  "max_blocks_per_request": 513}]
    with pytest.raises(ServesimError, match="one sliding window's group"):
        kv_capacity(model, hardware, gpu_memory_utilization=0.19, **args)


@pytest.mark.parametrize("policy", ["prefill-first", "decode-first"])
def test_whole_prompt_policies_count_a_whole_prompt_in_flight(tmp_path, policy):
    # prefill-first and decode-first compute a prompt whole, beyond the budget: its window's group
    # holds the whole prompt's blocks in that step. Until 2026-12-07 the cache counted the budget's
    # tokens in flight (window 128 - 1 + 512: 41 blocks), so a 3,000-token prompt (188 blocks at
    # once) was taken into a 100-block cache and never admitted: "scheduled nothing" with every
    # later request waiting behind it. It is rejected now, and the others finish.
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.app.replay import replay
    from sim.config import CacheConfig
    from sim.request import Status
    from tests.helpers import make_trace

    options = ReplayOptions(model=_mistral(tmp_path, sliding_window=128), hardware="H100-SXM",
                            scheduler=SchedulerConfig(policy, 512, 16, max_model_len=4096, async_scheduling=False),
                            cache=CacheConfig(block_size=16, num_blocks=100))
    plan = resolve(options)
    assert plan.make_block_manager().max_admission_blocks == 4096 // 16 + 1  # the longest prompt, at once
    result = replay(make_trace([(0.0, 100, 5), (0.0, 3000, 5), (0.1, 200, 5), (0.2, 1500, 5)]), plan)
    assert [r.status for r in result.requests] == [Status.FINISHED, Status.REJECTED, Status.FINISHED, Status.FINISHED]
    assert result.requests[1].reject_reason == "needs 188 KV blocks, the whole cache has 100"
    chunked = resolve(ReplayOptions(model=options.model, hardware="H100-SXM", scheduler=SchedulerConfig(
        "chunked", 512, 16, max_model_len=4096, async_scheduling=False), cache=options.cache))
    assert chunked.make_block_manager().max_admission_blocks == -(-(127 + 512) // 16) + 1  # vLLM's, unchanged


def test_the_flag_leaves_a_model_whose_every_layer_slides(tmp_path):
    # vLLM's --disable-hybrid-kv-cache-manager promotes a sliding layer only beside full-attention ones
    # (vllm/v1/core/kv_cache_planning.py _promote_local_kv_cache_specs): Mistral-7B-v0.1 keeps its window.
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.config import CacheConfig

    folder = _mistral(tmp_path)
    plans = [resolve(ReplayOptions(model=folder, hardware="H100-SXM",
                                   cache=CacheConfig(disable_hybrid_kv_cache_manager=flag)), build_backend=False)
             for flag in (False, True)]
    assert plans[0].num_blocks == plans[1].num_blocks and plans[0].kv.vllm == plans[1].kv.vllm
    managers = [p.make_block_manager() for p in plans]
    assert all(type(bm) is SlidingWindowBlockManager and bm.groups == (("sliding_attention", 4096),)
               for bm in managers)
