"""Scheduling policies. A new policy is one class and one entry here; a user's own policy loads
from a file or module without editing servesim (`--policy path/to/file.py:ClassName`)."""

from policies.base import Policy
from policies.checked import checked_policy_class, load_bounded
from policies.chunked import ChunkedPolicy
from policies.decode_first import DecodeFirstPolicy
from policies.prefill_first import PrefillFirstPolicy
from sim.plugins import load_class

POLICIES: dict[str, type[Policy]] = {
    "decode-first": DecodeFirstPolicy,
    "prefill-first": PrefillFirstPolicy,
    "chunked": ChunkedPolicy,
}


def load_policy(spec: str) -> type[Policy]:
    """A built-in policy by name, or a user's `FILE.py:Class` / `module:Class` (a `Policy` subclass),
    wrapped so that every batch it returns is checked and its errors are reported as its own
    (policies/checked.py)."""
    if spec in POLICIES:
        return POLICIES[spec]
    cls = load_bounded(lambda: load_class(spec, POLICIES, Policy, "policy"), spec, "policy")
    return checked_policy_class(cls, spec)


__all__ = ["POLICIES", "Policy", "load_policy"]
