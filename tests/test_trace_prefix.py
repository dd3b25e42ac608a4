"""Prefix sharing from hash ids: identical token prefixes, an exactly known hit rate, and the
Mooncake cut replayed with and without prefix caching."""

from __future__ import annotations

import json

import numpy as np

from backends.model_config import ModelConfig
from sim.app.cli import main
from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, make_requests, replay, write_run
from sim.config import CacheConfig, SchedulerConfig
from sim.tokens import TokenSpec
from tests.helpers import ConstantBackend, make_trace
from traces import MOONCAKE_SAMPLE, read_trace


def options(enable_prefix_caching=True):
    return ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=256, max_num_seqs=4),
                         cache=CacheConfig(block_size=16, num_blocks=200, enable_prefix_caching=enable_prefix_caching),
                         model="tiny")


# One request at a time (arrivals 10 s apart, 1 ms steps), KV blocks of 16 tokens, hash blocks of 16.
HAND_MADE = [
    # (arrival_s, prompt, output), hash ids, prefix-cache hit tokens at admission
    ((0, 64, 2), [1, 2, 3, 4], 0),
    ((10, 64, 2), [1, 2, 3, 4], 48),  # all 4 blocks cached, but one token is always computed: 3 blocks
    ((20, 80, 2), [1, 2, 5, 6, 7], 32),  # shares blocks [1, 2]
    ((30, 40, 2), [9, 10, 11], 0),  # shares nothing
    ((40, 40, 2), [1, 2, 3], 32),  # 2 full blocks, both cached; the 8-token tail is never cached
]


def test_hand_made_trace_has_the_hit_rate_computed_by_hand(tmp_path):
    trace = make_trace([r for r, _, _ in HAND_MADE], hash_ids=[h for _, h, _ in HAND_MADE], hash_block_tokens=16)
    result = replay(trace, resolve(options(), backend=ConstantBackend(0.001)))
    assert [r.num_prefix_hit_tokens for r in result.requests] == [hit for _, _, hit in HAND_MADE]
    assert result.num_prefix_queried_tokens == 64 + 64 + 80 + 40 + 40
    assert result.num_prefix_hit_tokens == 112
    summary = write_run(tmp_path / "run", result, resolve(options(), build_backend=False), trace)
    assert summary["prefix_cache_hit_rate"] == 112 / 288
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["prefix_cache_hit_rate"] == 112 / 288

    off = replay(trace, resolve(options(enable_prefix_caching=False), backend=ConstantBackend(0.001)))
    assert off.num_prefix_hit_tokens == 0 and all(r.num_prefix_hit_tokens == 0 for r in off.requests)


def test_hash_blocks_larger_than_kv_blocks():
    # Hash blocks of 32 tokens hold two KV blocks each: b shares the first hash block with a (32 tokens).
    trace = make_trace([(0, 64, 2), (10, 48, 2)], hash_ids=[[5, 6], [5, 8]], hash_block_tokens=32)
    result = replay(trace, resolve(options(), backend=ConstantBackend(0.001)))
    assert [r.num_prefix_hit_tokens for r in result.requests] == [0, 32]


def test_shared_hash_ids_give_identical_token_prefixes():
    trace = read_trace(MOONCAKE_SAMPLE)
    requests = make_requests(trace)
    spec = TokenSpec(0, ModelConfig.from_preset("Qwen3-0.6B").vocab_size)
    first = [tuple(h[:1].tolist()) for h in trace.hash_ids]
    i = next(k for k in range(len(first)) if first.count(first[k]) > 1)
    j = next(k for k in range(i + 1, len(first)) if first[k] == first[i])
    a, b = trace.hash_ids[i], trace.hash_ids[j]
    shared = int(np.argmax(np.append(a[:len(b)] != b[:len(a)], True)))  # leading ids in common
    n = min(shared * 512, trace.prompt_tokens[i], trace.prompt_tokens[j])
    assert n >= 512
    assert np.array_equal(requests[i].token_ids(0, n, spec), requests[j].token_ids(0, n, spec))
    end = min(trace.prompt_tokens[i], trace.prompt_tokens[j])
    if n < end:  # the first block after the shared prefix differs
        k = min(n + 512, end)
        assert not np.array_equal(requests[i].token_ids(n, k, spec), requests[j].token_ids(n, k, spec))


def test_replay_mooncake_cut_hits_the_prefix_cache_and_lowers_ttft(tmp_path):
    runs = {}
    for name, extra in (("on", []), ("off", ["--no-prefix-caching"])):
        out = tmp_path / name
        assert main(["replay", str(MOONCAKE_SAMPLE), "--hardware", "H200", "--out", str(out), "--quiet", *extra]) == 0
        runs[name] = json.loads((out / "summary.json").read_text())
    on, off = runs["on"], runs["off"]
    assert on["completed"] == off["completed"] == 200
    assert on["prefix_cache_hit_rate"] > 0.5 and off["prefix_cache_hit_rate"] == 0.0
    assert on["ttft"]["mean"] < 0.7 * off["ttft"]["mean"]
    assert on["ttft"]["p50"] < off["ttft"]["p50"]
