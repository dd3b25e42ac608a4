"""Sliding windows against vLLM 0.33's and 0.34's own code:

- the block manager of sliding-window models (sim/sliding_block_manager.py) against vLLM's `Scheduler`
  and `AsyncScheduler` over one SlidingWindowSpec group (a model whose every layer slides:
  tests/parity/cases.py `sliding_cases`) and over a sliding group and a full-attention group (gpt-oss,
  Gemma 2: `hybrid_cases`), and each `-async`, step by step as the full-attention cases of test_vllm_parity.py: the same first-token
  and finish time of every request, the same prefill tokens, decode tokens and preemptions at every
  step, the same prefix-cache queries and hits;
- the blocks a hybrid model's sliding group frees (sim/sliding_block_manager.py) against
  SlidingWindowManager.get_num_skipped_tokens (vllm/v1/core/single_type_kv_cache_manager.py), called on
  a stand-in holding the fields it reads, and remove_skipped_blocks' rule (skipped // block_size blocks,
  at most the table's): scheduled again after a step, a request holds its table less those blocks;
- the same sliding and hybrid cases under vLLM's --disable-hybrid-kv-cache-manager (`no_hybrid_cases`:
  vLLM's scheduler over the groups its get_kv_cache_groups makes with the flag), synchronous and
  asynchronous, the hybrid ones with fast-forward on and off.

Skipped where vLLM is not installed (the `parity` extra: see the README).
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
stkcm = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager",
                            reason="vLLM is not installed (pip install '.[parity]')")

from sim.request import Request  # noqa: E402
from sim.sliding_block_manager import SlidingWindowBlockManager  # noqa: E402
from tests.parity.cases import async_variant, hybrid_cases, no_hybrid_cases, sliding_cases  # noqa: E402
from tests.parity.run import assert_schedules_as_vllm  # noqa: E402

SLIDING = sliding_cases() + hybrid_cases()
SLIDING += [async_variant(c) for c in SLIDING]


@pytest.mark.parametrize("case", SLIDING, ids=[c.name for c in SLIDING])
def test_a_sliding_model_schedules_as_vllm(case):
    assert_schedules_as_vllm(case, fast_forward=True)  # (a sliding cache takes no runs: stepped)


NO_HYBRID = no_hybrid_cases()
NO_HYBRID += [async_variant(c) for c in NO_HYBRID]
# A hybrid case under the flag is one full-attention group (the plain block manager, which takes
# fast-forward runs): both settings; a model whose every layer slides keeps its sliding manager (stepped).
NO_HYBRID_RUNS = [(c, ff) for c in NO_HYBRID for ff in ((True, False) if c.setup.hybrid else (True,))]


@pytest.mark.parametrize("case,fast_forward", NO_HYBRID_RUNS,
                         ids=[f"{c.name}-ff-{'on' if ff else 'off'}" for c, ff in NO_HYBRID_RUNS])
def test_without_the_hybrid_manager_schedules_as_vllm(case, fast_forward):
    assert_schedules_as_vllm(case, fast_forward)


@pytest.mark.parametrize("window,block_size", [(128, 16), (512, 16), (4096, 16), (128, 32), (5, 4)])
def test_held_blocks_follow_vllms_skipped_tokens(window, block_size):
    vllm = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    rng = random.Random(window + block_size)
    bm = SlidingWindowBlockManager(100_000, block_size, False, (("sliding_attention", window), ("full_attention", None)),
                                   window - 1 + 4096)
    r = Request(0, "0", 0.0, rng.randint(1, 3 * window), 400)
    chunk = rng.randint(1, 2 * window)
    bm.allocate(r, [], min(chunk, r.num_prompt_tokens))
    scheduled = min(chunk, r.num_prompt_tokens)
    while r.num_computed_tokens < r.num_prompt_tokens + 300:
        r.num_computed_tokens += scheduled
        scheduled = min(chunk, r.num_prompt_tokens - r.num_computed_tokens) if r.num_computed_tokens < r.num_prompt_tokens else 1
        bm.can_append(r, scheduled)  # its next scheduling frees what the window passed
        skipped = stkcm.SlidingWindowManager.get_num_skipped_tokens(vllm, r.num_computed_tokens)
        table = len(r.block_table)  # the sliding group's table length is the full group's
        assert bm.held_by_group(r) == [table - min(skipped // block_size, table), table]
        bm.append(r, scheduled)
    bm.free(r)
    assert bm.num_used_blocks == 0
