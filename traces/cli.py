"""The trace options every command that reads a trace shares (`sim replay`, `sweep`, `trace ...`):
reading options and workload transforms, and `load_trace`, which applies them and prints the
trace's warnings. The `sim trace` commands themselves are in sim/app/trace_cli.py."""

from __future__ import annotations

import argparse
import sys

FORMAT_HELP = ("trace format: canonical, azure (2023 and 2024), mooncake, burstgpt, vidur, vllm-bench (vllm bench "
               "serve --save-detailed), aiperf (AIPerf's profile_export.jsonl) (default: detected from the header or "
               "extension)")


def whole_number(text: str) -> int:
    """A plain whole number. A flag's type is its range's (sim.config.Range.flag_type), which parses
    and checks it; tests/test_options.py refuses a flag of this type."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """Reading options and workload transforms (applied in this order: window, limit, rate, too-long);
    their numbers checked against sim.config's physical ranges."""
    from sim.config import COUNT, RATE_SCALE, REQUEST_RATE

    p.add_argument("--format", default=None, metavar="NAME", help=FORMAT_HELP)
    p.add_argument("--model-filter", default=None, metavar="MODEL",
                   help="BurstGPT: keep only the requests of this model (e.g. ChatGPT or GPT-4)")
    p.add_argument("--time-window", default=None, metavar="START:END",
                   help="keep requests arriving in [START, END) seconds from the first arrival; either may be "
                        "empty (e.g. 600:1200 or :300)")
    p.add_argument("--limit", type=COUNT.flag_type("--limit"), default=None, metavar="N", help="keep the first N requests")
    p.add_argument("--rate-scale", type=RATE_SCALE.flag_type("--rate-scale"), default=None, metavar="X",
                   help="divide arrival times by X (2 doubles the request rate)")
    p.add_argument("--target-rate", type=REQUEST_RATE.flag_type("--target-rate"), default=None, metavar="R",
                   help="stretch or compress arrivals to a mean rate of R requests/s")
    p.add_argument("--on-too-long", choices=("reject", "truncate"), default="reject",
                   help="requests longer than --max-model-len: reject them (the engine's default) or truncate "
                        "the prompt (and if need be the output) to fit")


def reader_options(args: argparse.Namespace) -> dict:
    return {"model_filter": args.model_filter}


def apply_trace_options(trace, args: argparse.Namespace, max_model_len: int | None):
    """The workload transforms of `add_trace_options`, applied to a trace read from `args`."""
    from traces.transforms import apply, parse_time_window

    window = parse_time_window(args.time_window) if args.time_window is not None else None
    return apply(trace, time_window_s=window, num_requests=args.limit, rate_scale=args.rate_scale,
                 rate=args.target_rate, on_too_long=args.on_too_long, max_model_len=max_model_len)


def load_trace(path: str, args: argparse.Namespace, max_model_len: int | None):
    """Read a trace with the options of `add_trace_options` and transform it; print its warnings."""
    from traces import read_trace

    trace = apply_trace_options(read_trace(path, args.format, **reader_options(args)), args, max_model_len)
    for warning in trace.warnings:
        print(f"sim: warning: {warning}", file=sys.stderr)
    return trace
