"""Sliding-window and full-attention layers in one block manager (sim/sliding_block_manager.py
SlidingWindowBlockManager, vLLM's HybridKVCacheCoordinator): a request holds only its window's
blocks in a sliding group, every block in a full-attention group, from one shared pool; checked
against vLLM's formula (backends/kv_capacity.py KVCacheGroup.blocks_held:
SlidingWindowManager.get_num_skipped_tokens / remove_skipped_blocks) on worked examples, and
blocks conserved under random workloads. tests/parity/test_sliding_window_parity.py runs it
against vLLM's own scheduler."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends.kv_capacity import KVCacheGroup, kv_cache_groups
from backends.model_config import ModelConfig, resolve_model
from sim.block_manager import BlockManager
from sim.config import SchedulerConfig
from sim.request import Request, Status
from sim.sliding_block_manager import SlidingWindowBlockManager
from tests.helpers import replay_with_blocks
from tests.moe_configs import GEMMA3_1B

GPT_OSS = (("sliding_attention", 128), ("full_attention", None))  # kv_cache_groups(gpt-oss-120b)


def test_gpt_oss_layout_is_what_the_plan_passes():
    groups = kv_cache_groups(resolve_model("gpt-oss-120b"))
    assert tuple((g.kind, g.sliding_window) for g in groups) == GPT_OSS


def test_gpt_oss_window_worked_by_hand():
    # Block size 16, window 128. A 300-token prompt: 19 blocks in each group at admission
    # (cdiv(300, 16)). Once its 300 tokens are computed, max(0, 300 - 128 + 1) = 173 tokens are
    # skipped: 173 // 16 = 10 blocks are freed when it is next scheduled, 9 held in the sliding
    # group, 19 in the full one (and one more in each for its first decode's token: 20 and 10).
    bm = SlidingWindowBlockManager(100, 16, False, GPT_OSS, 127 + 4096)
    r = Request(0, "0", 0.0, 300, 40)
    bm.allocate(r, [], 300)
    assert bm.held_by_group(r) == [19, 19] and bm.num_used_blocks == 38  # (sliding, full: vLLM's group order)
    r.num_computed_tokens, r.num_output_tokens = 300, 1
    bm.slide([r])  # nothing is freed at a step's end
    assert bm.held_by_group(r) == [19, 19]
    assert bm.can_append(r, 1)  # frees the 10 first
    assert bm.held_by_group(r) == [9, 19] and bm.num_used_blocks == 28
    window = KVCacheGroup("sliding_attention", 18, 128)
    for _ in range(40):  # decodes: each frees what its window passed, then appends its token
        bm.append(r, 1)
        tokens = r.num_computed_tokens + 1
        assert bm.held_by_group(r) == [window.blocks_held(r.num_computed_tokens, tokens, 16), -(-tokens // 16)]
        r.num_computed_tokens += 1
        r.num_output_tokens += 1
    # 340 computed: 22 blocks allocated (341 tokens); at the last scheduling 339 were computed,
    # (339 - 127) // 16 = 13 skipped: 9 held.
    assert bm.held_by_group(r) == [9, 22]
    bm.free(r)
    assert bm.num_used_blocks == 0
    bm.check_invariants([])


def test_gemma3_groups_worked_by_hand(tmp_path):
    # Gemma 3 1B: 4 full-attention layers and 22 sliding (window 512) -> one full group and six
    # sliding groups (kv_cache_groups). A 1000-token prompt, computed: 63 blocks in the full group;
    # each sliding group skips (1000 - 511) // 16 = 30 blocks and holds 33; 63 + 6 x 33 = 261.
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_1B))
    groups = kv_cache_groups(ModelConfig.from_hf(path))
    layout = tuple((g.kind, g.sliding_window) for g in groups)
    assert sorted(layout, key=str) == sorted([("full_attention", None)] + [("sliding_attention", 512)] * 6, key=str)
    bm = SlidingWindowBlockManager(1000, 16, True, layout, 511 + 4096)
    r = Request(0, "0", 0.0, 1000, 5)
    bm.allocate(r, [], 1000)
    r.num_computed_tokens, r.num_output_tokens = 1000, 1
    assert bm.can_append(r, 0)  # (the blocks before the window go when it is next scheduled)
    full = layout.index(("full_attention", None))
    held = bm.held_by_group(r)
    assert held[full] == 63 and held[:full] + held[full + 1:] == [33] * 6 and bm.num_used_blocks == 261
    for g in groups:
        assert g.blocks_held(1000, 1000, 16) == (63 if g.kind == "full_attention" else 33)


def test_admission_counts_every_group():
    # 40 free blocks; a 300-token prompt needs 19 + 19 at admission (no tokens computed yet).
    bm = SlidingWindowBlockManager(40, 16, False, GPT_OSS, 127 + 4096)
    r = Request(0, "0", 0.0, 300, 4)
    assert bm.can_allocate(bm.cached_prefix(r), 300)
    bm2 = SlidingWindowBlockManager(37, 16, False, GPT_OSS, 127 + 4096)
    assert not bm2.can_allocate(bm2.cached_prefix(r), 300)
    # A request longer than the cache with both groups is rejected when it arrives, not stalled:
    # 3000 tokens: 188 full blocks + a window's at most cdiv(127 + 4096, 16) + 1 = 265 -> 188 + 188.
    assert bm.max_blocks_needed(3000) == 188 + 188
    assert BlockManager(40, 16).max_blocks_needed(3000) == 188


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 200), st.integers(1, 30), st.integers(0, 3)),
                min_size=1, max_size=20),
       st.integers(24, 80), st.sampled_from([16, 32]), st.booleans(), st.sampled_from([2, 3]), st.booleans())
# Found by this property: a shared prompt preempted beside the step in flight kept its indexed blocks'
# keys but went to the free queue's head (a cached block at the head; then one block free twice).
@example([(0, 1, 1, 0), (0, 1, 1, 0), (0, 1, 2, 0), (0, 20, 2, 0)], 24, 16, True, 2, True)
@example([(0, 1, 1, 0), (0, 1, 1, 0), (0, 1, 1, 0), (0, 20, 2, 0)], 24, 32, True, 2, True)
def test_blocks_conserved_and_windows_held(rows, num_blocks, window, caching, num_sliding, asynchronous):
    layout = (("sliding_attention", window),) * num_sliding + (("full_attention", None),)
    bm = SlidingWindowBlockManager(num_blocks, 4, caching, layout, window - 1 + (1 + asynchronous) * 32)

    def check(batch, running):  # at every step: the pool adds up; each group of a scheduled request holds what
        bm.check_invariants(running)  # vLLM's formula says (synchronously; at most that plus the step in
        for r in batch.requests:  # flight's tokens' blocks asynchronously), at most the cap
            held = bm.held_by_group(r)
            table = len(r.block_table)
            assert held[-1] == table
            skip = min(max(0, r.num_computed_tokens - window + 1) // 4, table)
            assert all(h == table - skip if not asynchronous else table - skip <= h for h in held[:-1])
            assert all(h <= bm.max_admission_blocks for h in held[:-1])

    replay_with_blocks(bm, rows, SchedulerConfig("chunked", max_num_batched_tokens=32, max_num_seqs=4,
                                                 async_scheduling=asynchronous), check)


def test_the_plan_builds_the_hybrid_manager():
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve

    plan = resolve(ReplayOptions(model="gpt-oss-120b", hardware="H200"), build_backend=False)
    bm = plan.make_block_manager()
    assert isinstance(bm, SlidingWindowBlockManager) and bm.groups == GPT_OSS
    assert bm.max_admission_blocks == -(-(127 + 2 * 2048) // 16) + 1  # window - 1 + two batches in flight
    dense = resolve(ReplayOptions(model="Qwen3-30B-A3B", hardware="H200"), build_backend=False)
    assert type(dense.make_block_manager()) is BlockManager


@pytest.mark.slow
def test_gpt_oss_replay_holds_fewer_blocks(tmp_path):
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.app.replay import replay
    from tests.helpers import make_trace

    trace = make_trace([(0.1 * i, 2000, 50) for i in range(20)])
    options = ReplayOptions(model="gpt-oss-120b", hardware="H200",
                            scheduler=SchedulerConfig("chunked", 2048, 256, async_scheduling=False))
    result = replay(trace, resolve(options))
    assert all(r.status is Status.FINISHED for r in result.requests)
    # A decode-only step's blocks: each running request holds cdiv(tokens, 16) full blocks and at
    # most 9 in the 128-token window (not the 125 of its prompt). (Synchronously: asynchronously a
    # request's first decode is scheduled while its prompt's step is in flight, before it frees them.)
    s = result.steps
    decode = (s.num_prefill_tokens == 0) & (s.num_requests > 0)
    assert decode.any()
    assert (s.num_kv_blocks_used[decode] <= s.num_requests[decode] * (129 + 9)).all()


@pytest.mark.parametrize("make", [lambda: BlockManager(num_blocks=37, block_size=16),
                                  lambda: SlidingWindowBlockManager(100, 16, False, GPT_OSS, 127 + 4096),
                                  lambda: SlidingWindowBlockManager(40, 16, False, GPT_OSS, 127 + 4096)])
def test_the_most_tokens_a_request_may_hold_is_the_last_count_whose_blocks_fit(make):
    """The engine rejects a request whose KV needs more blocks than the whole cache
    (`max_blocks_needed`), comparing its tokens with `max_request_tokens`: counted here one token
    count at a time."""
    bm = make()
    fits = [t for t in range(0, bm.num_blocks * bm.block_size + 2) if bm.max_blocks_needed(t) <= bm.num_blocks]
    assert bm.max_request_tokens() == max(fits) and fits == list(range(max(fits) + 1))


def test_the_plan_without_the_hybrid_manager_builds_the_plain_one():
    # --disable-hybrid-kv-cache-manager: gpt-oss's 36 layers are one full-attention group (vLLM's
    # FullAttentionManager): the plain block manager, half the blocks (each holds every layer), summary
    # naming the flag; a run of a model without sliding layers is unchanged.
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.config import CacheConfig

    on = CacheConfig(disable_hybrid_kv_cache_manager=True)
    hybrid = resolve(ReplayOptions(model="gpt-oss-120b", hardware="H200"), build_backend=False)
    flat = resolve(ReplayOptions(model="gpt-oss-120b", hardware="H200", cache=on), build_backend=False)
    assert type(flat.make_block_manager()) is BlockManager
    assert flat.num_blocks == hybrid.num_blocks // 2 and flat.kv.block_bytes == 2 * hybrid.kv.block_bytes
    assert flat.as_dict()["cache"]["disable_hybrid_kv_cache_manager"] is True
    assert "disable_hybrid_kv_cache_manager" not in hybrid.as_dict()["cache"]
    dense = [resolve(ReplayOptions(model="Qwen3-30B-A3B", hardware="H200", cache=c), build_backend=False)
             for c in (CacheConfig(), on)]
    assert dense[0].num_blocks == dense[1].num_blocks and type(dense[1].make_block_manager()) is BlockManager


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), st.sampled_from([8, 64, 128, 512, 4096]), st.sampled_from([16, 32, 64]),
       st.integers(1, 2**36), st.integers(1, 1 << 17), st.sampled_from([2048, 4096, 16384]), st.booleans())
def test_without_the_hybrid_manager_a_hybrid_model_is_sized_as_full_attention(num_sliding, num_full, window, block_size,
                                                                              available, max_model_len, in_flight,
                                                                              sliding_first):
    """Any mix of sliding and full-attention layers under --disable-hybrid-kv-cache-manager: one
    full-attention group of every layer, the blocks and tokens of the same model with no sliding layer
    (vLLM's unify_hybrid_kv_cache_specs). (Not always fewer tokens than the hybrid manager's: with a
    window near the context and unequal groups, its padded blocks can hold less.)"""
    import os
    import tempfile

    from backends.kv_capacity import vllm_kv_cache
    from tests.moe_configs import GEMMA2_9B

    kinds = ["sliding_attention"] * num_sliding + ["full_attention"] * num_full
    if not sliding_first:
        kinds.reverse()
    base = {**GEMMA2_9B, "num_hidden_layers": len(kinds), "sliding_window": window,
            "max_position_embeddings": 1 << 17}
    folder = tempfile.mkdtemp(prefix="servesim-no-hybrid-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**base, "layer_types": kinds}, f)
    model = ModelConfig.from_hf(folder)
    assert model.layer_types == tuple(kinds)
    args = dict(block_size=block_size, max_model_len=max_model_len, max_in_flight_tokens=in_flight)
    flat = vllm_kv_cache(model, available, **args, disable_hybrid_kv_cache_manager=True)
    assert [(g["kind"], g["num_layers"]) for g in flat["groups"]] == [("full_attention", len(kinds))]
    assert flat["bytes_per_block"] == block_size * model.kv_bytes_per_token()
    assert flat["num_blocks"] == available // flat["bytes_per_block"]
    assert flat["groups"][0]["max_blocks_per_request"] == -(-max_model_len // block_size)
    blocks_per_request = -(-max_model_len // block_size)
    assert flat["tokens"] == int(flat["num_blocks"] / blocks_per_request * max_model_len)
    assert len(vllm_kv_cache(model, available, **args)["groups"]) >= 2  # the hybrid manager's groups
