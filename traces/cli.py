"""`sim trace stats|convert|synth`, and the trace options every replaying command shares."""

from __future__ import annotations

import argparse
import json
import sys

from sim.errors import ServesimError

FORMAT_HELP = ("trace format: canonical, azure (2023 and 2024), mooncake, burstgpt, vidur "
               "(default: detected from the header or extension)")


def whole_number(text: str) -> int:
    """argparse type for counts (of every command); their ranges are checked where they are used."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """Reading options and workload transforms (applied in this order: window, limit, rate, too-long)."""
    p.add_argument("--format", default=None, metavar="NAME", help=FORMAT_HELP)
    p.add_argument("--model-filter", default=None, metavar="MODEL",
                   help="BurstGPT: keep only the requests of this model (e.g. ChatGPT or GPT-4)")
    p.add_argument("--time-window", default=None, metavar="START:END",
                   help="keep requests arriving in [START, END) seconds from the first arrival; either may be "
                        "empty (e.g. 600:1200 or :300)")
    p.add_argument("--limit", type=whole_number, default=None, metavar="N", help="keep the first N requests")
    p.add_argument("--rate-scale", type=_number, default=None, metavar="X",
                   help="divide arrival times by X (2 doubles the request rate)")
    p.add_argument("--target-rate", type=_number, default=None, metavar="R",
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


def cmd_stats(args: argparse.Namespace) -> int:
    from traces.stats import format_stats, trace_stats

    stats = trace_stats(load_trace(args.file, args, args.max_model_len))
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from traces.writers import write_canonical

    trace = load_trace(args.file, args, args.max_model_len)
    write_canonical(trace, args.out)
    hashes = "with" if trace.hash_ids is not None else "without"
    print(f"wrote {len(trace):,} requests ({trace.format}, {hashes} prefix hash ids) to {args.out}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from traces.synth import Lengths, SynthConfig, synthesize
    from traces.writers import write_canonical

    lengths_from = None
    if args.lengths_from is not None:
        lengths_from = load_trace(args.lengths_from, args, None)
    elif args.format is not None or args.model_filter is not None:
        raise ServesimError("--format and --model-filter apply to the --lengths-from trace")
    config = SynthConfig(
        num_requests=args.num_requests, rate=args.rate, arrival=args.arrival, cv=args.cv,
        prompt=Lengths.parse(args.prompt_len, "--prompt-len"), output=Lengths.parse(args.output_len, "--output-len"),
        turns=Lengths.parse(args.turns, "--turns"), think_time_s=args.think_time,
        system_prompt_tokens=args.system_prompt_tokens, hash_block_tokens=args.hash_block_tokens, seed=args.seed,
        lengths_from=lengths_from)
    trace = synthesize(config)
    write_canonical(trace, args.out)
    print(f"wrote {len(trace):,} synthetic requests over {trace.duration_s:,.1f} s to {args.out}")
    return 0


def register(subparsers) -> None:
    trace = subparsers.add_parser("trace", help="inspect, convert and synthesise traces",
                                  description="Inspect, convert and synthesise request traces.")
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    sub.required = True

    p = sub.add_parser("stats", help="rows, span, rate, burstiness, length percentiles, prefix sharing",
                       description="Print a trace's size, span, mean rate, inter-arrival CV, length percentiles "
                                   "and prefix-sharing ratio (after the transforms given).")
    p.add_argument("file", help="trace file (any supported format, gzip too)")
    add_trace_options(p)
    p.add_argument("--max-model-len", type=whole_number, default=None, metavar="N", help="for --on-too-long truncate")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("convert", help="write a trace as canonical CSV (keeping prefix hash ids)",
                       description="Read a trace in any supported format, apply the transforms given, and "
                                   "write canonical CSV: arrival_s,prompt_tokens,output_tokens[,request_id]"
                                   "[,hash_ids,hash_block_tokens]. OUT ending in .gz is compressed.")
    p.add_argument("file", help="trace file (any supported format, gzip too)")
    p.add_argument("out", help="canonical CSV to write")
    add_trace_options(p)
    p.add_argument("--max-model-len", type=whole_number, default=None, metavar="N", help="for --on-too-long truncate")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("synth", help="write a seeded synthetic trace",
                       description="Write a seeded synthetic trace as canonical CSV. Lengths are fixed:N, "
                                   "uniform:LO:HI or zipf:S:LO:HI. Multi-turn sessions (--turns) share their "
                                   "conversation prefix through hash ids.")
    p.add_argument("out", help="canonical CSV to write")
    p.add_argument("--num-requests", type=whole_number, default=1000, metavar="N", help="requests in all (default: 1000)")
    p.add_argument("--rate", type=_number, default=1.0, metavar="R",
                   help="sessions started per second; requests per second with one turn (default: 1)")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson",
                   help="arrival process (default: poisson)")
    p.add_argument("--cv", type=_number, default=1.0, metavar="CV",
                   help="gamma arrivals: coefficient of variation of inter-arrival times, >1 is burstier")
    p.add_argument("--prompt-len", default="fixed:512", metavar="DIST",
                   help="new prompt tokens per request (per turn) (default: fixed:512)")
    p.add_argument("--output-len", default="fixed:128", metavar="DIST", help="output tokens (default: fixed:128)")
    p.add_argument("--lengths-from", default=None, metavar="TRACE",
                   help="resample (prompt, output) pairs from this trace instead of --prompt-len/--output-len")
    p.add_argument("--format", default=None, metavar="NAME", help="format of the --lengths-from trace")
    p.add_argument("--model-filter", default=None, metavar="MODEL", help="BurstGPT --lengths-from: one model")
    p.add_argument("--turns", default="fixed:1", metavar="DIST", help="requests per session (default: fixed:1)")
    p.add_argument("--think-time", type=_number, default=10.0, metavar="S",
                   help="mean seconds between a session's turns, exponential (default: 10)")
    p.add_argument("--system-prompt-tokens", type=whole_number, default=0, metavar="N",
                   help="a prefix every request shares, a multiple of --hash-block-tokens (default: 0)")
    p.add_argument("--hash-block-tokens", type=whole_number, default=16, metavar="N",
                   help="tokens per prefix hash id (default: 16)")
    p.add_argument("--seed", type=whole_number, default=0, help="random seed (default: 0)")
    p.set_defaults(func=cmd_synth, time_window=None, limit=None, rate_scale=None, target_rate=None,
                   on_too_long="reject")
