"""Hand-computed timelines of a 3-request trace under each policy, every step taking 1 s.

    R0 arrives at 0.0 with a 4-token prompt and 3 output tokens
    R1 arrives at 0.5 with a 6-token prompt and 2 output tokens
    R2 arrives at 0.5 with a 3-token prompt and 1 output token
Token budget 8, block size 4, plenty of blocks.
"""

import numpy as np
import pytest

from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, replay
from sim.config import CacheConfig, SchedulerConfig
from tests.helpers import ConstantBackend, make_trace

TRACE = [(0.0, 4, 3), (0.5, 6, 2), (0.5, 3, 1)]


def run(policy):
    options = ReplayOptions(scheduler=SchedulerConfig(policy, max_num_batched_tokens=8, max_num_seqs=4,
                                                      async_scheduling=False, host_time=False),
                            cache=CacheConfig(block_size=4, num_blocks=64))
    backend = ConstantBackend(1.0)
    result = replay(make_trace(TRACE), resolve(options, backend=backend))
    tokens = {r.request_id: result.tokens_of(i).tolist() for i, r in enumerate(result.requests)}
    steps = list(zip(result.steps.start_s, result.steps.num_prefill_tokens, result.steps.num_decode_tokens))
    return result, tokens, steps


def test_chunked_timeline():
    # t=0: R0's prompt. t=1: R0 decodes, R1's whole prompt, first token of R2's prompt (budget 8 = 1+6+1).
    # t=2: R0 and R1 decode, R2's last two prompt tokens.
    result, tokens, steps = run("chunked")
    assert steps == [(0.0, 4, 0), (1.0, 7, 1), (2.0, 2, 2)]
    assert tokens == {"0": [1.0, 2.0, 3.0], "1": [2.0, 3.0], "2": [3.0]}
    assert result.end_s == 3.0
    assert [r.first_scheduled_s for r in result.requests] == [0.0, 1.0, 1.0]


def test_prefill_first_timeline():
    # Whole prompts first: R0, then R1 alone (6 + 3 > 8), then R2; decodes stall meanwhile.
    result, tokens, steps = run("prefill-first")
    assert steps == [(0.0, 4, 0), (1.0, 6, 0), (2.0, 3, 0), (3.0, 0, 2), (4.0, 0, 1)]
    assert tokens == {"0": [1.0, 4.0, 5.0], "1": [2.0, 4.0], "2": [3.0]}


def test_decode_first_timeline():
    # R0 runs to completion before anything else is admitted; then R1 alone (6 + 3 > 8), then R2.
    result, tokens, steps = run("decode-first")
    assert steps == [(0.0, 4, 0), (1.0, 0, 1), (2.0, 0, 1), (3.0, 6, 0), (4.0, 0, 1), (5.0, 3, 0)]
    assert tokens == {"0": [1.0, 2.0, 3.0], "1": [4.0, 5.0], "2": [6.0]}


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "decode-first"])
def test_metrics_follow_the_timeline(policy):
    from reports.metrics import requests_table

    result, tokens, _ = run(policy)
    table = requests_table(result).set_index("request_id")
    for rid, times in tokens.items():
        arrival = dict(zip(["0", "1", "2"], [0.0, 0.5, 0.5]))[rid]
        assert table.loc[rid, "ttft_s"] == pytest.approx(times[0] - arrival)
        assert table.loc[rid, "e2e_s"] == pytest.approx(times[-1] - arrival)
        if len(times) > 1:
            assert table.loc[rid, "tpot_s"] == pytest.approx((times[-1] - times[0]) / (len(times) - 1))
        else:
            assert np.isnan(table.loc[rid, "tpot_s"])


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "decode-first"])
def test_itl_is_every_gap_within_a_request(policy):
    from reports.metrics import inter_token_latencies

    result, tokens, _ = run(policy)
    expected = sorted(b - a for times in tokens.values() for a, b in zip(times, times[1:]))
    assert sorted(inter_token_latencies(result).tolist()) == expected
