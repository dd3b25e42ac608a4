"""Workload transforms: each takes a trace and returns a new one, the input left as it was.

`apply` runs the CLI's transforms in one fixed order: time window, limit, rate, too-long.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from sim.errors import ServesimError
from traces.formats import MAX_SPAN_S
from traces.trace import Trace

TOO_LONG = ("reject", "truncate")


def mean_rate(trace: Trace) -> float:
    """Requests per second: rows divided by the span from first to last arrival."""
    if len(trace) < 2 or trace.duration_s <= 0:
        raise ServesimError(f"{trace.source or 'the trace'}: its mean rate is undefined "
                            f"({len(trace)} requests over {trace.duration_s:g} s)")
    return len(trace) / trace.duration_s


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Arrival times divided by `factor`: 2 doubles the rate, 0.5 halves it."""
    factor = _positive(factor, "--rate-scale must be a positive number")
    if trace.duration_s / factor > MAX_SPAN_S:
        raise ServesimError(f"rate scale {factor:g} stretches the trace's {trace.duration_s:g} s to "
                            f"{trace.duration_s / factor:.3g} s, more than {MAX_SPAN_S:g} s")
    if trace.measured is not None and factor != 1:  # its measurements were taken at the measured arrivals
        return replace(trace, arrival_s=trace.arrival_s / factor, measured=None, warnings=trace.warnings + [
            f"{trace.source}: the rate changed by {factor:g}, so the trace's own measurements are not compared"])
    return replace(trace, arrival_s=trace.arrival_s / factor)


def target_rate(trace: Trace, rate: float) -> Trace:
    """Arrivals stretched or compressed so that the mean rate becomes `rate` requests per second."""
    rate = _positive(rate, "--target-rate must be a positive number of requests per second")
    return scale_rate(trace, rate / mean_rate(trace))


def _positive(value, message: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ServesimError(f"{message}, got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise ServesimError(f"{message}, got {value}")
    return number


def parse_time_window(text: str) -> tuple[float | None, float | None]:
    """'START:END' in seconds from the first arrival; either side may be left empty."""
    start_text, sep, end_text = text.partition(":")
    if not sep:
        raise ServesimError(f"--time-window must be START:END in seconds (either may be empty), got {text!r}")
    bounds = []
    for part in (start_text, end_text):
        part = part.strip()
        try:
            bounds.append(float(part) if part else None)
        except ValueError:
            raise ServesimError(f"--time-window: {part!r} is not a number of seconds") from None
    return bounds[0], bounds[1]


def time_window(trace: Trace, start_s: float | None, end_s: float | None) -> Trace:
    """The requests arriving in [start_s, end_s), with arrivals counted again from the first kept."""
    start = -math.inf if start_s is None else start_s
    end = math.inf if end_s is None else end_s
    for name, b in (("START", start_s), ("END", end_s)):
        if b is not None and not math.isfinite(b):
            raise ServesimError(f"--time-window: {name} must be a finite number of seconds, got {b}")
    if start_s is not None and start_s < 0:
        raise ServesimError(f"--time-window: START must not be negative, got {start_s:g}: the trace's arrivals count "
                            "from its first, at 0 s")
    if not start < end:
        raise ServesimError(f"--time-window: START must be before END, got {start_s}:{end_s}")
    kept = trace.take((trace.arrival_s >= start) & (trace.arrival_s < end))
    if not len(kept):
        given = f"{'' if start_s is None else f'{start_s:g}'}:{'' if end_s is None else f'{end_s:g}'}"
        raise ServesimError(f"--time-window {given} keeps no request; the trace spans "
                            f"0 to {trace.duration_s:g} s")
    return replace(kept, arrival_s=kept.arrival_s - kept.arrival_s[0], warnings=kept.warnings + cut_load(trace, kept))


def cut_load(trace: Trace, kept: Trace) -> list[str]:
    """A measured run cut to some of its requests: the rest loaded the server while the kept ones were
    measured, and the replay runs without them (said, not refused)."""
    if trace.measured is None or len(kept) == len(trace):
        return []
    return [f"{trace.source}: {len(trace) - len(kept)} of the run's requests are cut away, but loaded the server "
            "while the ones kept were measured: the comparison with the measurements leaves their load out"]


def limit(trace: Trace, num_requests: int) -> Trace:
    """The first `num_requests` requests."""
    if num_requests < 1:
        raise ServesimError(f"--limit must be at least 1, got {num_requests}")
    kept = trace.take(np.arange(min(num_requests, len(trace))))
    return replace(kept, warnings=kept.warnings + cut_load(trace, kept))


def truncate_too_long(trace: Trace, max_model_len: int) -> Trace:
    """Requests longer than `max_model_len` cut to fit: the output to at most max_model_len - 1
    tokens, then the prompt to what is left (its prefix kept, so prefix sharing is kept too)."""
    if max_model_len < 2:
        raise ServesimError(f"--max-model-len must be at least 2 to truncate, got {max_model_len}")
    output = np.minimum(trace.output_tokens, max_model_len - 1)
    prompt = np.minimum(trace.prompt_tokens, max_model_len - output)
    changed = (output != trace.output_tokens) | (prompt != trace.prompt_tokens)
    if not changed.any():
        return trace
    hash_ids = trace.hash_ids
    if hash_ids is not None:
        needed = (-(-prompt // trace.hash_block_tokens)).tolist()
        hash_ids = [ids[:n] for ids, n in zip(hash_ids, needed)]
    n = int(changed.sum())
    note = f"truncated {n} request{'s' * (n != 1)} to --max-model-len {max_model_len}"
    measured = trace.measured
    if measured is not None:  # a truncated request is not the one measured
        measured = {k: np.where(changed, np.nan, v) for k, v in measured.items()}
    return replace(trace, prompt_tokens=prompt, output_tokens=output, hash_ids=hash_ids,
                   warnings=trace.warnings + [note], measured=measured)


def apply(trace: Trace, *, time_window_s: tuple[float | None, float | None] | None = None,
          num_requests: int | None = None, rate_scale: float | None = None, rate: float | None = None,
          on_too_long: str = "reject", max_model_len: int | None = None) -> Trace:
    """The CLI's transforms in order: window, limit, rate (scale or target), too-long requests."""
    if rate_scale is not None and rate is not None:
        raise ServesimError("give --rate-scale or --target-rate, not both")
    if on_too_long not in TOO_LONG:
        raise ServesimError(f"--on-too-long must be one of {', '.join(TOO_LONG)}, got {on_too_long!r}")
    if time_window_s is not None:
        trace = time_window(trace, *time_window_s)
    if num_requests is not None:
        trace = limit(trace, num_requests)
    if rate_scale is not None:
        trace = scale_rate(trace, rate_scale)
    if rate is not None:
        trace = target_rate(trace, rate)
    if on_too_long == "truncate":
        if max_model_len is None:
            raise ServesimError("--on-too-long truncate needs --max-model-len")
        trace = truncate_too_long(trace, max_model_len)
    applied = {"time_window_s": list(time_window_s) if time_window_s is not None else None, "limit": num_requests,
               "rate_scale": rate_scale, "target_rate": rate,
               "on_too_long": on_too_long if on_too_long == "truncate" else None}
    applied = {k: v for k, v in applied.items() if v is not None}
    return replace(trace, transforms={**trace.transforms, **applied}) if applied else trace
