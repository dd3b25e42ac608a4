"""The block manager against its previous implementation (tests/reference_block_manager.py, one
dict entry per block): random admissions with shared prefixes, chunked prefill and decode steps,
preemptions (also after scheduling) and finishes drive both, and every block table, free count,
eviction order, lookup and counter must agree, with check_invariants after every operation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.block_manager import BlockManager
from sim.request import Request
from tests.reference_block_manager import BlockManager as ReferenceBlockManager

# Shared prefixes: a request's hash ids are a prefix of one of these, then ids of its own.
FAMILIES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 40, 41, 42, 43, 44, 45, 46], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79]]


@st.composite
def workloads(draw):
    block_size, h_tokens = draw(st.sampled_from([(4, 8), (4, 4), (2, 8), (3, 8), (8, 4), (5, 7)]))
    specs = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, 40))
        hash_ids = None
        if draw(st.integers(0, 4)):  # most requests have trace hashes
            family = FAMILIES[draw(st.integers(0, len(FAMILIES) - 1))]
            n = -(-prompt // h_tokens)
            common = draw(st.integers(0, n))
            hash_ids = family[:common] + [1000 * (i + 1) + k for k in range(n - common)]
            hash_ids = (hash_ids + [1000 * (i + 1) + 99] * n)[:n]
        specs.append((prompt, draw(st.integers(1, 10)), hash_ids))
    return block_size, h_tokens, draw(st.integers(4, 40)), specs


def twin(i, prompt, output, hash_ids, h_tokens):
    return tuple(Request(i, str(i), 0.0, prompt, output, hash_ids=None if hash_ids is None else np.asarray(hash_ids, dtype=np.int64),
                    hash_block_tokens=h_tokens) for _ in range(2))


def reference_indexed(bm, r, i):
    key = r.block_hashes(bm.block_size, i + 1)[i]
    first = bm.hash_to_block.get(key)
    return [] if first is None else [first] + bm._duplicates.get(key, [])


def check_same(new, ref, pairs, running, finished):
    assert new.num_free_blocks == ref.num_free_blocks
    assert new.cached_free_blocks() == ref.cached_free_blocks()  # eviction order
    assert new._free_plain == ref._free_plain and new.ref_counts == ref.ref_counts
    assert (new.num_queried_tokens, new.num_hit_tokens, new.num_preempted_queried_tokens, new.num_preempted_hit_tokens) == \
        (ref.num_queried_tokens, ref.num_hit_tokens, ref.num_preempted_queried_tokens, ref.num_preempted_hit_tokens)
    for a, b in pairs:
        assert a.block_table == b.block_table and a.num_hashed_blocks == b.num_hashed_blocks
        if a.index in finished:
            continue
        assert new.num_cached_blocks(a) == ref.num_cached_blocks(b)
        for i in range(a.num_tokens // new.block_size):  # the index: the blocks found for each block key
            assert new.indexed_blocks(a, i) == reference_indexed(ref, b, i)
    new.check_invariants([a for a, _ in running])
    ref.check_invariants([b for _, b in running])


@pytest.mark.slow  # minutes: 250 random workloads, each checked against the reference after every operation
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(), st.data())
def test_same_as_the_reference(workload, data):
    block_size, h_tokens, num_blocks, specs = workload
    new, ref = BlockManager(num_blocks, block_size), ReferenceBlockManager(num_blocks, block_size)
    pairs = [twin(i, p, o, h, h_tokens) for i, (p, o, h) in enumerate(specs)]
    waiting, running, finished = list(pairs), [], set()
    for _ in range(data.draw(st.integers(1, 80))):
        if not waiting and not running:
            break
        admit = waiting and (not running or data.draw(st.booleans()))
        if admit:
            a, b = data.draw(st.sampled_from(waiting))
            cached = new.cached_prefix(a)
            assert cached == ref.cached_prefix(b)
            remaining = a.num_tokens - len(cached) * block_size
            n = data.draw(st.integers(1, remaining))
            fits = new.can_allocate(cached, n)
            assert fits == ref.can_allocate(cached, n)
            if not fits:
                continue
            a.num_computed_tokens = new.allocate(a, cached, n)  # it reports the hit; the reference writes it
            ref.allocate(b, list(cached), n)
            assert a.num_computed_tokens == b.num_computed_tokens
            waiting.remove((a, b))
            running.append((a, b))
        else:
            a, b = data.draw(st.sampled_from(running))
            action = data.draw(st.sampled_from(["step", "step", "step", "preempt", "preempt after scheduling"]))
            n = 0
            if action != "preempt":
                n = data.draw(st.integers(1, a.num_tokens_to_compute))
                fits = new.can_append(a, n)
                assert fits == ref.can_append(b, n)
                if fits:
                    new.append(a, n)
                    ref.append(b, n)
                else:
                    action, n = "preempt", 0
            if action.startswith("preempt"):
                new.free(a, preempted=True, num_scheduled=n)
                ref.free(b, preempted=True, num_scheduled=n)
                for r in (a, b):
                    r.num_computed_tokens = 0
                    r.num_preemptions += 1
                running.remove((a, b))
                waiting.append((a, b))
            elif action == "step":
                for r in (a, b):
                    r.num_computed_tokens += n
                    if r.num_computed_tokens == r.num_tokens:
                        r.num_output_tokens += 1  # sampled
                if a.num_output_tokens == a.max_tokens:  # finished
                    new.free(a)
                    ref.free(b)
                    for r in (a, b):
                        r.drop_block_hashes()
                    finished.add(a.index)
                    running.remove((a, b))
        check_same(new, ref, pairs, running, finished)
    # Probes: lookups of requests that were never admitted.
    for prompt in (8, 23, 40):
        for family in FAMILIES:
            hash_ids = (family * 5)[:-(-prompt // h_tokens)]
            a, b = twin(99, prompt, 1, hash_ids, h_tokens)
            assert new.cached_prefix(a) == ref.cached_prefix(b) and new.num_cached_blocks(a) == ref.num_cached_blocks(b)
