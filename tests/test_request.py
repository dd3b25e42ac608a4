"""The bulk forms of `Request.is_decoding` the policies' per-step loops use agree with it."""

from hypothesis import given
from hypothesis import strategies as st

from sim.request import Request, num_leading_decoding, split_decoding


@st.composite
def requests(draw) -> list[Request]:
    out = []
    for i in range(draw(st.integers(0, 12))):
        prompt = draw(st.integers(1, 50))
        r = Request(index=i, request_id=str(i), arrival_s=0.0, num_prompt_tokens=prompt, max_tokens=20)
        r.num_output_tokens = draw(st.integers(0, 20))
        # computed tokens anywhere up to every known token, often one short of them (decoding)
        r.num_computed_tokens = draw(st.one_of(st.just(max(r.num_tokens - 1, 0)), st.integers(0, r.num_tokens)))
        out.append(r)
    return out


@given(requests())
def test_bulk_forms_agree_with_is_decoding(rs):
    flags = [r.is_decoding for r in rs]
    expected = flags.index(False) if False in flags else len(flags)
    assert num_leading_decoding(rs) == expected
    decoding, others = split_decoding(rs)
    assert decoding == [r for r in rs if r.is_decoding]
    assert others == [r for r in rs if not r.is_decoding]


def test_worked_example():
    a = Request(index=0, request_id="a", arrival_s=0.0, num_prompt_tokens=4, max_tokens=3)
    a.num_output_tokens, a.num_computed_tokens = 1, 4  # sampled its first token: decoding
    b = Request(index=1, request_id="b", arrival_s=0.0, num_prompt_tokens=4, max_tokens=3)
    b.num_computed_tokens = 2  # mid-prefill
    c = Request(index=2, request_id="c", arrival_s=0.0, num_prompt_tokens=2, max_tokens=3)
    c.num_output_tokens, c.num_computed_tokens = 2, 3  # decoding
    assert num_leading_decoding([a, b, c]) == 1
    assert split_decoding([a, b, c]) == ([a, c], [b])
