"""Synthetic workloads: seeded, arrival statistics, length distributions, multi-turn prefix sharing."""

from __future__ import annotations

import numpy as np
import pytest

from sim.errors import ServesimError
from traces import read_trace
from traces.stats import prefix_sharing_ratio, trace_stats
from traces.synth import (
    Lengths,
    SynthConfig,
    arrival_times,
    diurnal_times,
    synthesize,
    synthesize_chunks,
)
from traces.trace import Trace


def test_same_seed_same_trace_other_seed_other_trace():
    config = SynthConfig(num_requests=50, rate=3, arrival="gamma", cv=2, prompt=Lengths.parse("uniform:5:900"),
                         turns=Lengths.parse("uniform:1:4"), seed=7)
    a, b = synthesize(config), synthesize(config)
    assert a.arrival_s.tolist() == b.arrival_s.tolist() and a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
    c = synthesize(SynthConfig(num_requests=50, rate=3, arrival="gamma", cv=2, seed=8))
    assert c.arrival_s.tolist() != a.arrival_s.tolist()


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_arrival_rate_and_burstiness(arrival, cv):
    t = arrival_times(np.random.default_rng(0), 40_000, rate=5.0, arrival=arrival, cv=cv)
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_length_distributions():
    rng = np.random.default_rng(1)
    assert Lengths.parse("fixed:64").sample(rng, 3).tolist() == [64, 64, 64]
    u = Lengths.parse("uniform:10:12").sample(rng, 3000)
    assert set(u.tolist()) == {10, 11, 12}
    z = Lengths.parse("zipf:1.5:1:1000").sample(rng, 20000)
    assert z.min() >= 1 and z.max() <= 1000
    counts = np.bincount(z)
    assert counts[1] > counts[2] > counts[4] > counts[16]  # heavy head, long tail
    assert counts[1] / counts[2] == pytest.approx(2 ** 1.5, rel=0.15)
    assert str(Lengths.parse("zipf:1.5:1:1000")) == "zipf:1.5:1:1000"


@pytest.mark.parametrize("text,message", [
    ("normal:5", "expected fixed:N, uniform:LO:HI or zipf:S:LO:HI"),
    ("fixed:0", "whole numbers of at least 1"),
    ("uniform:9:3", "LO must not be above HI"),
    ("zipf:0:1:10", "exponent S must be positive"),
    ("fixed:abc", "not a number"),
    # nan and inf were internal errors (int(nan)); a large zipf support took a weight per value (2**31: 16 GB).
    ("fixed:nan", "'fixed:nan' has a value that is not a finite number"),
    ("uniform:1:inf", "not a finite number"),
    ("zipf:inf:2:10", "not a finite number"),
    ("zipf:1.1:1:2000000000", r"zipf spans at most 16,777,216 values \(HI - LO \+ 1\), got 2,000,000,000"),
])
def test_bad_lengths(text, message):
    with pytest.raises(ServesimError, match=message):
        Lengths.parse(text, "--prompt-len")


@pytest.mark.parametrize("kwargs,message", [
    ({"num_requests": 0}, "--num-requests must be at least 1"),
    ({"rate": 0}, "--rate must be a positive number"),
    ({"arrival": "uniform"}, "--arrival must be one of poisson, gamma"),
    ({"cv": 2.0}, "--cv applies to gamma arrivals"),
    ({"arrival": "gamma", "cv": 1e-200}, "--cv must be a number from 1e-06 to 100"),  # was a ZeroDivisionError
    ({"system_prompt_tokens": 20}, r"multiple of --hash-block-tokens \(16\)"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ServesimError, match=message):
        SynthConfig(**kwargs)


def test_a_zipf_exponent_too_large_for_its_weights_puts_every_length_at_lo():
    # Every n**-S underflowed to 0 (S = 1e5 from LO = 2): the probabilities were NaN, an internal error.
    assert Lengths.parse("zipf:1e5:2:10").sample(np.random.default_rng(0), 100).tolist() == [2] * 100


def test_multi_turn_sessions_share_their_conversation_prefix():
    config = SynthConfig(num_requests=200, rate=2, prompt=Lengths.parse("uniform:1:300"),
                         output=Lengths.parse("uniform:1:200"), turns=Lengths.parse("uniform:1:6"),
                         think_time_s=3.0, system_prompt_tokens=64, hash_block_tokens=16, seed=3)
    t = synthesize(config)
    assert len(t) == 200 and (np.diff(t.arrival_s) >= 0).all() and t.arrival_s[0] == 0
    by_id = {rid: i for i, rid in enumerate(t.request_ids)}
    sessions: dict[str, list[int]] = {}
    for rid in t.request_ids:
        session, turn = rid.split("-t")
        sessions.setdefault(session, []).append(int(turn))
    assert max(len(turns) for turns in sessions.values()) > 1
    for session, turns in sessions.items():
        assert sorted(turns) == list(range(1, len(turns) + 1))
        for k in range(1, len(turns)):
            prev, cur = by_id[f"{session}-t{k}"], by_id[f"{session}-t{k + 1}"]
            assert t.arrival_s[cur] >= t.arrival_s[prev]
            # The new prompt is the old prompt, its answer and a new message of at least one token.
            assert t.prompt_tokens[cur] > t.prompt_tokens[prev] + t.output_tokens[prev]
            n_prev = len(t.hash_ids[prev])
            assert t.hash_ids[cur][:n_prev].tolist() == t.hash_ids[prev].tolist()
    for ids, prompt in zip(t.hash_ids, t.prompt_tokens):
        assert ids[:4].tolist() == [0, 1, 2, 3]  # the system prompt: 64 tokens, 4 blocks of 16
        assert len(ids) == -(-prompt // 16)
    assert 0.3 < prefix_sharing_ratio(t) < 1
    # Each turn's ids are a view of its session's one array: memory linear in a session's tokens.
    for session, turns in sessions.items():
        last = t.hash_ids[by_id[f"{session}-t{len(turns)}"]]
        assert all(np.shares_memory(t.hash_ids[by_id[f"{session}-t{k}"]], last) for k in range(1, len(turns)))


def test_single_turn_without_system_prompt_has_no_hashes():
    t = synthesize(SynthConfig(num_requests=10, rate=1))
    assert t.hash_ids is None and t.request_ids is None
    assert t.prompt_tokens.tolist() == [512] * 10 and t.output_tokens.tolist() == [128] * 10


def test_lengths_resampled_from_a_trace():
    source = read_trace("tests/data/traces/vidur_handmade.csv")
    pairs = set(zip(source.prompt_tokens.tolist(), source.output_tokens.tolist()))
    t = synthesize(SynthConfig(num_requests=300, rate=10, lengths_from=source, seed=2))
    drawn = set(zip(t.prompt_tokens.tolist(), t.output_tokens.tolist()))
    assert drawn == pairs  # every pair drawn is a pair of the trace, and 300 draws find all 5


def test_prefix_sharing_ratio_by_hand():
    # Blocks of 4 tokens. a: [1,2] (8 tokens); b: [1,2,3] shares 8 of 10; c: [1,5] shares 4 of 6;
    # d: [7] shares 0 of 3. Shared 12 of 27 prompt tokens.
    t = Trace(np.arange(4.0), np.array([8, 10, 6, 3]), np.ones(4, dtype=np.int64),
              hash_ids=[np.array(h) for h in ([1, 2], [1, 2, 3], [1, 5], [7])], hash_block_tokens=4)
    assert prefix_sharing_ratio(t) == 12 / 27
    stats = trace_stats(t)
    assert stats["requests"] == 4 and stats["span_s"] == 3 and stats["mean_rate"] == 4 / 3
    assert stats["interarrival_cv"] == 0.0
    assert stats["prompt_tokens"]["max"] == 10 and stats["prompt_tokens"]["p50"] == 7.0


def test_diurnal_mapping_by_hand():
    # A = 0.5, period 4 s: the cumulative rate is t - (0.5 * 4 / (2 pi)) sin(pi t / 2). At t = 1 it is
    # 1 - 1/pi, at t = 2 exactly 2 (half a period: the mean rate), at t = 4 exactly 4.
    u = np.array([0.0, 1 - 1 / np.pi, 2.0, 4.0])
    assert diurnal_times(u, 0.5, 4.0) == pytest.approx([0.0, 1.0, 2.0, 4.0], abs=1e-12)
    assert diurnal_times(u, 0.0, 4.0) is u


@pytest.mark.parametrize("amplitude", [0.98, 0.999, 1 - 1e-11])
def test_diurnal_mapping_near_amplitude_1_converges(amplitude):
    """Near A = 1 the slope at the trough is nearly 0 and Newton's steps overshoot; `sim trace synth
    --diurnal 0.99` was `sim: internal error: ... did not converge` (exit 1). The bracketed bisection
    that takes over solves the mapping to the same tolerance, in order."""
    u = np.sort(np.random.default_rng(0).uniform(0, 5 * 86_400, 20_000))
    u[0] = 0.0
    t = diurnal_times(u, amplitude, 86_400.0)
    w = 2 * np.pi / 86_400
    assert np.abs(t - amplitude / w * np.sin(w * t) - u).max() < 1e-6
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()


def test_synth_diurnal_099_writes_a_trace(tmp_path):
    from sim.app.cli import main

    out = tmp_path / "t.csv"
    assert main(["trace", "synth", str(out), "--num-requests", "1000", "--diurnal", "0.99"]) == 0
    assert len(read_trace(out)) == 1000


def test_diurnal_arrivals_follow_the_daily_rate():
    # 200,000 requests over about 2 days at A = 0.5: the night quarter (around t = 0 mod a day)
    # has rate 1 - 0.5 * mean(cos) over it, the day quarter 1 + the same.
    config = SynthConfig(num_requests=200_000, rate=200_000 / (2 * 86_400), diurnal=0.5, seed=4)
    t = synthesize(config).arrival_s
    phase = (t % 86_400) / 86_400
    night = ((phase < 0.125) | (phase >= 0.875)).sum()
    day = ((phase >= 0.375) & (phase < 0.625)).sum()
    # Over a quarter period centred on the trough, mean of cos is (2 sqrt 2) / pi = 0.9003.
    expected = (1 - 0.5 * 0.9003) / (1 + 0.5 * 0.9003)
    assert night / day == pytest.approx(expected, rel=0.03)
    assert (np.diff(t) >= 0).all() and t[0] == 0


@pytest.mark.parametrize("turns,system", [("fixed:1", 0), ("uniform:1:5", 32)])
def test_chunks_come_in_arrival_order_and_keep_sessions_whole(turns, system):
    config = SynthConfig(num_requests=5000, rate=3, turns=Lengths.parse(turns), think_time_s=20.0,
                         system_prompt_tokens=system, diurnal=0.3, diurnal_period_s=600.0, seed=9)
    chunks = list(synthesize_chunks(config, chunk_requests=700))
    assert len(chunks) > 7  # held-back turns move between chunks
    arrival = np.concatenate([c.arrival_s for c in chunks])
    assert len(arrival) == 5000 and (np.diff(arrival) >= 0).all()
    if system:
        ids = [i for c in chunks for i in c.request_ids]
        hashes = dict(zip(ids, (h for c in chunks for h in c.hash_ids)))
        assert len(set(ids)) == 5000
        for rid, h in hashes.items():
            session, turn = rid.rsplit("-t", 1)
            assert h[:2].tolist() == [0, 1]  # the system prompt: 32 tokens, 2 blocks of 16
            if int(turn) > 1:  # a later turn repeats the whole earlier conversation's ids
                earlier = hashes[f"{session}-t{int(turn) - 1}"]
                assert h[:len(earlier)].tolist() == earlier.tolist()
    # Up to CHUNK_REQUESTS requests, the trace is the first chunk itself.
    whole = synthesize(config)
    assert len(list(synthesize_chunks(config))) == 1 and whole.arrival_s.tolist() == sorted(whole.arrival_s.tolist())


def test_bad_diurnal():
    with pytest.raises(ServesimError, match="--diurnal must be at least 0 and below 1"):
        SynthConfig(diurnal=1.0)
    with pytest.raises(ServesimError, match="--diurnal-period must be a positive"):
        SynthConfig(diurnal=0.5, diurnal_period_s=0)


def test_synth_command_writes_a_diurnal_trace_in_chunks(tmp_path, capsys):
    from sim.app.cli import main

    out = tmp_path / "week.csv"
    assert main(["trace", "synth", str(out), "--num-requests", "3000", "--rate", "0.025", "--diurnal", "0.5"]) == 0
    trace = read_trace(out)
    assert f"wrote 3,000 synthetic requests over {trace.duration_s:,.1f} s" in capsys.readouterr().out
    assert trace.duration_s > 86_400 and trace.request_ids is None and trace.hash_ids is None
    assert main(["trace", "synth", str(out), "--diurnal", "1.5"]) == 2
