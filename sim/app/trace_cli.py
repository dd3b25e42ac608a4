"""`sim trace stats|convert|synth`: a trace's statistics, a trace written as canonical CSV, a
synthetic trace. Outputs are checked before any work and written whole (sim.app.outputs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim.app.outputs import atomic_path, check_file_destination, command_inputs
from sim.config import (
    BLOCK_SIZE,
    COUNT,
    DURATION_S,
    FRACTION,
    GAMMA_CV,
    MODEL_LEN,
    OPTIONAL_TOKENS,
    POSITIVE_DURATION_S,
    REQUEST_RATE,
    SEED,
)
from sim.errors import ServesimError
from traces.cli import add_trace_options, load_trace


def _check_max_model_len(args: argparse.Namespace) -> None:
    if args.max_model_len is not None and args.on_too_long != "truncate":
        raise ServesimError("--max-model-len applies here with --on-too-long truncate (a replay rejects "
                            "requests that are too long; these commands keep them unless told to truncate)")


def cmd_stats(args: argparse.Namespace) -> int:
    from traces.stats import format_stats, trace_stats

    _check_max_model_len(args)
    stats = trace_stats(load_trace(args.file, args, args.max_model_len))
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    _check_max_model_len(args)
    check_csv_name(args.out)
    # Before the work: never over an input, nor over an existing file without --overwrite.
    out = check_file_destination(args.out, inputs=command_inputs(args), overwrite=args.overwrite)
    trace = load_trace(args.file, args, args.max_model_len)
    write_trace(trace, out)
    hashes = "with" if trace.hash_ids is not None else "without"
    print(f"wrote {len(trace):,} requests ({trace.format}, {hashes} prefix hash ids) to {args.out}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from traces.synth import Lengths, SynthConfig, write_synthetic

    check_csv_name(args.out)
    out = check_file_destination(args.out, inputs=command_inputs(args), overwrite=args.overwrite)
    # A flag that would change nothing is refused, as --cv without gamma arrivals is: each was ignored,
    # the trace written as if it had not been given.
    turns = Lengths.parse(args.turns, "--turns")
    unused = [(args.lengths_from is not None and args.prompt_len is not None,
               "--prompt-len does not combine with --lengths-from, whose (prompt, output) pairs are resampled"),
              (args.lengths_from is not None and args.output_len is not None,
               "--output-len does not combine with --lengths-from, whose (prompt, output) pairs are resampled"),
              (args.diurnal_period is not None and args.diurnal == 0,
               "--diurnal-period applies to a daily pattern (--diurnal A above 0)"),
              (args.think_time is not None and turns.max <= 1,
               f"--think-time applies to sessions of more than one turn (--turns), not --turns {args.turns}")]
    for given, message in unused:
        if given:
            raise ServesimError(message)
    lengths_from = None
    if args.lengths_from is not None:
        lengths_from = load_trace(args.lengths_from, args, None)
    elif args.format is not None or args.model_filter is not None:
        raise ServesimError("--format and --model-filter apply to the --lengths-from trace")
    config = SynthConfig(
        num_requests=args.num_requests, rate=args.rate, arrival=args.arrival, cv=args.cv,
        prompt=Lengths.parse(args.prompt_len or SYNTH_DEFAULTS["prompt_len"], "--prompt-len"),
        output=Lengths.parse(args.output_len or SYNTH_DEFAULTS["output_len"], "--output-len"),
        turns=turns, think_time_s=SYNTH_DEFAULTS["think_time"] if args.think_time is None else args.think_time,
        system_prompt_tokens=args.system_prompt_tokens, hash_block_tokens=args.hash_block_tokens, seed=args.seed,
        lengths_from=lengths_from, diurnal=args.diurnal,
        diurnal_period_s=SYNTH_DEFAULTS["diurnal_period"] if args.diurnal_period is None else args.diurnal_period)
    with atomic_path(out) as temp:  # written in chunks as they are made: ten million requests fit
        num_requests, span_s = write_synthetic(config, temp, compress=out.suffix == ".gz")
    print(f"wrote {num_requests:,} synthetic requests over {span_s:,.1f} s to {args.out}")
    return 0


# `sim trace synth`'s defaults of the flags that apply only with others (None: not given, so that giving
# one where it changes nothing is refused).
SYNTH_DEFAULTS = {"prompt_len": "fixed:512", "output_len": "fixed:128", "think_time": 10.0, "diurnal_period": 86400.0}


def check_csv_name(out: str) -> None:
    """The trace writers write canonical CSV (gzipped for a .gz name): refuse a name that says another
    format, which `sim` would then read as that format and refuse (a .jsonl is read as Mooncake JSON Lines)."""
    from traces.formats import suffix

    ext = suffix(Path(out))
    if ext not in ("", ".csv"):
        raise ServesimError(f"{out}: sim trace writes canonical CSV, not {ext}; name it .csv or .csv.gz "
                            "(a .jsonl or .json name would be read back as Mooncake JSON Lines)")


def write_trace(trace, out: Path) -> None:
    """Canonical CSV, written whole or not at all (a temporary file renamed into place)."""
    from traces.writers import write_canonical

    with atomic_path(out) as temp:
        write_canonical(trace, temp, compress=out.suffix == ".gz")


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
    p.add_argument("--max-model-len", type=MODEL_LEN.flag_type("--max-model-len"), default=None, metavar="N",
                   help="for --on-too-long truncate")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("convert", help="write a trace as canonical CSV (keeping prefix hash ids)",
                       description="Read a trace in any supported format, apply the transforms given, and "
                                   "write canonical CSV: arrival_s,prompt_tokens,output_tokens[,request_id]"
                                   "[,hash_ids,hash_block_tokens][,priority]. OUT ending in .gz is compressed.")
    p.add_argument("file", help="trace file (any supported format, gzip too)")
    p.add_argument("out", help="canonical CSV to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    add_trace_options(p)
    p.add_argument("--max-model-len", type=MODEL_LEN.flag_type("--max-model-len"), default=None, metavar="N",
                   help="for --on-too-long truncate")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("synth", help="write a seeded synthetic trace",
                       description="Write a seeded synthetic trace as canonical CSV. Lengths are fixed:N, "
                                   "uniform:LO:HI or zipf:S:LO:HI. Multi-turn sessions (--turns) share their "
                                   "conversation prefix through hash ids.")
    p.add_argument("out", help="canonical CSV to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--num-requests", type=COUNT.flag_type("--num-requests"), default=1000, metavar="N",
                   help="requests in all (default: 1000)")
    p.add_argument("--rate", type=REQUEST_RATE.flag_type("--rate"), default=1.0, metavar="R",
                   help="sessions started per second; requests per second with one turn (default: 1)")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson",
                   help="arrival process (default: poisson)")
    p.add_argument("--cv", type=GAMMA_CV.flag_type("--cv"), default=1.0, metavar="CV",
                   help="gamma arrivals: coefficient of variation of inter-arrival times, >1 is burstier")
    p.add_argument("--prompt-len", default=None, metavar="DIST",
                   help="new prompt tokens per request (per turn) (default: fixed:512)")
    p.add_argument("--output-len", default=None, metavar="DIST", help="output tokens (default: fixed:128)")
    p.add_argument("--lengths-from", default=None, metavar="TRACE",
                   help="resample (prompt, output) pairs from this trace instead of --prompt-len/--output-len")
    p.add_argument("--format", default=None, metavar="NAME", help="format of the --lengths-from trace")
    p.add_argument("--model-filter", default=None, metavar="MODEL", help="BurstGPT --lengths-from: one model")
    p.add_argument("--turns", default="fixed:1", metavar="DIST", help="requests per session (default: fixed:1)")
    p.add_argument("--think-time", type=DURATION_S.flag_type("--think-time"), default=None, metavar="S",
                   help="mean seconds between a session's turns, exponential (default: 10)")
    p.add_argument("--system-prompt-tokens", type=OPTIONAL_TOKENS.flag_type("--system-prompt-tokens"), default=0, metavar="N",
                   help="a prefix every request shares, a multiple of --hash-block-tokens (default: 0)")
    p.add_argument("--hash-block-tokens", type=BLOCK_SIZE.flag_type("--hash-block-tokens"), default=16, metavar="N",
                   help="tokens per prefix hash id (default: 16)")
    p.add_argument("--diurnal", type=FRACTION.flag_type("--diurnal"), default=0.0, metavar="A",
                   help="daily rate pattern: sessions start at rate * (1 - A cos(2 pi t / period)), lowest at "
                        "t = 0, highest half a period later; 0 <= A < 1 (default: 0, a constant rate)")
    p.add_argument("--diurnal-period", type=POSITIVE_DURATION_S.flag_type("--diurnal-period"), default=None, metavar="S",
                   help="period of the --diurnal pattern in seconds (default: 86400, a day)")
    p.add_argument("--seed", type=SEED.flag_type("--seed"), default=0, help="random seed (default: 0)")
    p.set_defaults(func=cmd_synth, time_window=None, limit=None, rate_scale=None, target_rate=None,
                   on_too_long="reject")
