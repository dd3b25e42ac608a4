"""Scheduling policies. A new policy is one class and one entry here."""

from policies.chunked import ChunkedPolicy
from policies.decode_first import DecodeFirstPolicy
from policies.prefill_first import PrefillFirstPolicy

POLICIES = {
    "decode-first": DecodeFirstPolicy,
    "prefill-first": PrefillFirstPolicy,
    "chunked": ChunkedPolicy,
}

__all__ = ["POLICIES"]
