"""The axes a sweep can vary: their names (as in the options and the tables), their types, and
how tables and pages label them."""

from __future__ import annotations

AXES: dict[str, type] = {
    "policy": str,
    "model": str,
    "hardware": str,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "max_num_active_seqs": int,
    "long_prefill_token_threshold": int,
    "scheduling_policy": str,
    "prefill_schedule_interval": int,
    "watermark": float,
    "cache_aware_admission_window": int,
    "stream_interval": int,
    "rate_scale": float,
    "seed": int,
}
# The axes added after sweeps were first written, each with the value every point of a table written
# before it ran at (its option unset): a table that lacks such an axis is that table with the axis at
# that one value, so `--resume` continues it (sim/app/results_table.py, `upgraded`).
LATER_AXES: dict[str, object] = {
    "long_prefill_token_threshold": 0,
    "scheduling_policy": "fcfs",
    "prefill_schedule_interval": 1,
    "watermark": 0.0,
    "cache_aware_admission_window": 0,
    "max_num_active_seqs": 0,
    "stream_interval": 1,
}
SHORT_NAMES = {"max_num_batched_tokens": "budget", "max_num_seqs": "max seqs",
               "max_num_active_seqs": "max active seqs", "rate_scale": "rate",
               "long_prefill_token_threshold": "prefill cap", "scheduling_policy": "queue",
               "prefill_schedule_interval": "prefill interval", "watermark": "watermark",
               "cache_aware_admission_window": "cache-aware window", "stream_interval": "stream interval"}


def axis_text(axis: str, value) -> str:
    """`axis=value` as a point's key spells it (a float by its repr, so 0.1 and 0.10000000000000002 differ)."""
    return f"{axis}={value!r}" if AXES[axis] is float else f"{axis}={value}"


def axis_name(axis: str) -> str:
    """'budget' for max_num_batched_tokens; other axes by their own name."""
    return SHORT_NAMES.get(axis, axis)


def axis_widths(axes: list[str]) -> list[int]:
    """Each axis's column in a terminal table: 14 characters, or its name and two spaces where that is
    longer ("cache-aware window" ran into the next column)."""
    return [max(14, len(axis_name(a)) + 2) for a in axes]


def format_axis(axis: str, value) -> str:
    """A value with its axis: 'budget 256', 'rate ×2', 'seed 1'; a policy, model or hardware alone."""
    if axis == "rate_scale":
        return f"rate ×{float(value):g}"
    if axis in SHORT_NAMES or axis == "seed":
        return f"{axis_name(axis)} {value}"
    return str(value)
