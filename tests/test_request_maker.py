"""A trace row becomes a Request one way (sim.app.replay.request_maker), whether every row is made
at once from the columns read as lists or each row as it arrives from the arrays."""

import numpy as np

from sim.app.replay import make_requests, request_maker
from traces.trace import Trace


def fields(r):
    return (r.index, r.request_id, r.arrival_s, type(r.arrival_s), r.num_prompt_tokens, type(r.num_prompt_tokens),
            r.max_tokens, type(r.max_tokens), r.priority, type(r.priority),
            None if r.hash_ids is None else list(r.hash_ids), r.hash_block_tokens)


def test_lists_and_arrays_make_the_same_requests():
    trace = Trace(np.array([0.0, 0.25, 0.1]), np.array([5, 7, 9]), np.array([2, 3, 1]),
                  request_ids=["a", "b", "c"], hash_ids=[np.array([1]), np.array([1, 2]), np.array([3])],
                  hash_block_tokens=4, priority=np.array([2, 0, 1]))
    from_arrays = request_maker(trace)
    from_lists = request_maker(trace, as_lists=True)
    for j in range(len(trace)):
        assert fields(from_arrays(j)) == fields(from_lists(j))
    made = make_requests(trace)
    assert [fields(r) for r in made] == [fields(from_arrays(j)) for j in range(3)]
    assert fields(made[1])[:10] == (1, "b", 0.25, float, 7, int, 3, int, 0, int)


def test_a_trace_without_ids_or_priority():
    trace = Trace(np.array([0.0, 1.0]), np.array([3, 4]), np.array([1, 1]))
    made = make_requests(trace)
    assert [(r.request_id, r.priority) for r in made] == [("0", 0), ("1", 0)]
    assert [fields(r) for r in made] == [fields(request_maker(trace)(j)) for j in range(2)]
