"""Hand-computed timelines of the places where `chunked` follows vLLM V1's scheduler and KV cache
(vllm/v1/core/sched/scheduler.py, vllm/v1/core/block_pool.py, version 0.33), every step 1 s."""

from __future__ import annotations

from sim.app.replay import ReplayOptions, replay
from sim.config import CacheConfig, SchedulerConfig
from tests.helpers import ConstantBackend, make_trace


def run(rows, num_blocks, budget, max_num_seqs=4, block_size=16, caching=True, hash_ids=None,
        hash_block_tokens=16, **scheduler):
    options = ReplayOptions(
        scheduler=SchedulerConfig("chunked", max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, **scheduler),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching))
    result = replay(make_trace(rows, hash_ids, hash_block_tokens), options, backend=ConstantBackend(1.0))
    steps = list(zip(result.steps.num_prefill_tokens.tolist(), result.steps.num_decode_tokens.tolist(),
                     result.steps.num_preemptions.tolist()))
    return result, steps


def test_a_step_that_preempted_another_request_admits_no_one():
    # Issue 16's reproduction. Block size 16, 3 blocks, budget 16. R0 (prompt 7, output 11) and R1
    # (prompt 10, output 13) arrive at 0. Step 0: R0's prompt and 9 tokens of R1's (one block each).
    # Step 1: R0 decodes, R1's last prompt token. R1 computes position 16 at step 8 and takes the
    # last free block; R0 computes position 16 at step 10 and finds none: it preempts R1, the most
    # recently admitted. vLLM admits no waiting request in that step, so R1 does not come straight
    # back in (servesim used to re-admit it with a 15-token chunk).
    _, steps = run([(0.0, 7, 11), (0.0, 10, 13)], num_blocks=3, budget=16)
    assert steps[:11] == [(16, 0, 0), (1, 1, 0)] + [(0, 2, 0)] * 8 + [(0, 1, 1)]
