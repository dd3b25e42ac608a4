"""`sim validate`: its command line (the work is sim/app/validate.py)."""

from __future__ import annotations

import argparse
import sys
import time

from sim.app.options import MOE_KERNEL_CHOICES
from sim.app.validate import DEFAULT_BUDGET, Protocol, validate
from sim.errors import ServesimError


def cmd_validate(args: argparse.Namespace) -> int:
    warmup = args.warmup_waves
    if warmup != "auto":
        try:
            warmup = int(warmup)
        except ValueError:
            raise ServesimError(f"--warmup-waves must be auto or a whole number, got {warmup!r}") from None
    asynchronous = False if args.sync_scheduling else (True if args.async_scheduling else None)
    protocol = Protocol(range_ratio=args.range_ratio, prompts_per_client=args.prompts_per_client,
                        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                        kv_cache_dtype=args.kv_cache_dtype, async_scheduling=asynchronous, warmup_waves=warmup,
                        unique_prompts=args.unique_prompts, moe_cost_model=args.moe_cost_model,
                        moe_distribution=args.moe_distribution, moe_kernel=args.moe_kernel, sampling=args.sampling)
    started = time.perf_counter()
    show = sys.stderr.isatty() and not args.quiet

    def progress(done: int, skipped: int, total: int) -> None:
        if show:
            print(f"\r{done} simulated, {skipped} skipped of {total} rows", end="", file=sys.stderr, flush=True)

    from sim.app.outputs import claim_folder, command_inputs

    # Checked and locked before any work; with --overwrite the new run is written beside and swapped in whole.
    with claim_folder(args.out, overwrite=args.overwrite, inputs=command_inputs(args)) as folder:
        from sim.app.sweep import default_jobs

        jobs = default_jobs() if args.jobs is None else args.jobs
        summary = validate(args.measured, args.ops, folder.folder, args.models, protocol, progress, jobs)
    if show:
        print(file=sys.stderr)
    if not args.quiet:
        groups = summary["groups"]
        # Each column as wide as its longest value (a nightly build's version is 24 characters).
        widths = {key: max([least, *(len(str(g[key])) + 1 for g in groups)])
                  for key, least in (("system", 10), ("model", 36), ("backend", 9), ("backend_version", 13))}
        print(f"{'system':<{widths['system']}}{'model':<{widths['model']}}{'backend':<{widths['backend']}}"
              f"{'version':<{widths['backend_version']}}{'precision':<10}{'rows':>5}{'TTFT MAPE':>11}{'TPOT MAPE':>11}")
        for g in groups:
            print(f"{g['system']:<{widths['system']}}{g['model']:<{widths['model']}}{g['backend']:<{widths['backend']}}"
                  f"{g['backend_version']:<{widths['backend_version']}}"
                  f"{g['precision'] or '-':<10}{g['rows']:>5} {g['ttft_mape']:>9.1f}% {g['tpot_mape']:>9.1f}%")
        a = summary["all"]
        if a["rows"]:
            print(f"{'all':<{sum(widths.values()) + 10}}{a['rows']:>5} {a['ttft_mape']:>9.1f}% {a['tpot_mape']:>9.1f}%")
        print(f"{len(summary['skipped'])} rows skipped (reasons in validate.json); "
              f"{time.perf_counter() - started:.0f} s; wrote {args.out}/")
    if not summary["all"]["rows"]:  # nothing was validated: said, even with --quiet
        first = summary["skipped"][0]["reason"] if summary["skipped"] else ""
        print(f"sim: warning: none of the {len(summary['skipped'])} rows could be simulated (the first: {first}); "
              "reasons in validate.json", file=sys.stderr)
    return 0


def register(sub) -> None:
    from sim.app.options import add_output_options
    from sim.config import JOBS, OPEN_FRACTION, PROMPTS_PER_CLIENT, SEED, TOKENS_PER_STEP, UNIQUE_PROMPTS

    default = Protocol()  # the defaults, written once there
    p = sub.add_parser(
        "validate", help="simulate measured deployments and compare TTFT and TPOT",
        description="For every row of MEASURED.csv (AIConfigurator's silicon format) that servesim can express, "
                    "derive the operator-table profile of its system, model, TP and precision from --ops, "
                    "simulate its closed-loop benchmark and compare mean TTFT (client-side) and TPOT. Writes "
                    "validate.csv, validate.json and report.html to --out.")
    p.add_argument("measured", metavar="MEASURED.csv", help="measured deployments, e.g. "
                                                            "../shared/gpu-data/aiconfigurator/silicon_llama3.1.csv")
    p.add_argument("--jobs", type=JOBS.flag_type("--jobs"), default=None, metavar="N",
                   help="rows simulated at once, a worker process each (default: the number of CPUs; 1, or a "
                        "file of fewer than 16 rows, runs them in this process); the results are the same")
    p.add_argument("--ops", default=None, metavar="DIR",
                   help="operator tables: flat files (see sim calibrate --from-ops) or a folder in the package's "
                        "layout; default: the tables extra's package (pip install -e '.[tables]'), every system "
                        "it covers")
    p.add_argument("--models", default=None, metavar="DIR",
                   help="Hugging Face-style folders DIR/ORG/NAME/config.json for the rows' model_path (default: "
                        "presets, by name)")
    add_output_options(p, "validation", required=True)
    p.add_argument("--range-ratio", type=OPEN_FRACTION.flag_type("--range-ratio"), default=default.range_ratio,
                   metavar="R", help="prompt and output lengths uniform in [R x ISL, ISL] and [R x OSL, OSL] "
                                     f"(default: {default.range_ratio}, InferenceMAX's client; 1: fixed lengths)")
    p.add_argument("--prompts-per-client", type=PROMPTS_PER_CLIENT.flag_type("--prompts-per-client"),
                   default=default.prompts_per_client, metavar="K",
                   help=f"requests per benchmark: K x concurrency (default: {default.prompts_per_client}, as "
                        "InferenceMAX)")
    p.add_argument("--max-num-batched-tokens", type=TOKENS_PER_STEP.flag_type("--max-num-batched-tokens"),
                   default=None, metavar="N",
                   help=f"every row's server's token budget per step (default: the row's launch script's where "
                        f"servesim knows it, else {DEFAULT_BUDGET}, vLLM's on H100, H200 and B200)")
    p.add_argument("--seed", type=SEED.flag_type("--seed"), default=default.seed,
                   help=f"seed of the lengths (default: {default.seed})")
    p.add_argument("--kv-cache-dtype", default="recipe", choices=("recipe", "auto", "fp8"),
                   help="the deployments' KV cache, which the rows do not state: recipe (default) takes it from "
                        "the source's launch scripts where servesim knows them (InferenceMAX: fp8 on H200, auto on "
                        "H100) and vLLM's auto (bf16) elsewhere; auto or fp8 for every row")
    p.add_argument("--warmup-waves", default="auto", metavar="K|auto",
                   help="leave the first K x C requests sent out of the means; auto (default): 0, as vLLM's "
                        "benchmark counts every request, but 1 for a row whose measured TTFT is below what a "
                        "counted first wave allows")
    p.add_argument("--moe-cost-model", default=default.moe_cost_model, choices=("tables", "roofline"),
                   help="how MoE, MLA and sliding-window rows are priced: tables (each operator from the system's "
                        "measured tables, else the roofline; default) or roofline (the MoE roofline alone)")
    p.add_argument("--moe-distribution", default=default.moe_distribution, metavar="auto|balanced|power-law:ALPHA",
                   help="the token distribution over experts of the moe_perf rows that price MoE rows, as sim "
                        f"replay's --moe-distribution (default: {default.moe_distribution}, the family's skewed routing)")
    p.add_argument("--moe-kernel", default=default.moe_kernel,
                   choices=("recipe", *MOE_KERNEL_CHOICES),
                   help="the fused-MoE kernel of MoE rows' servers, which the rows do not state: recipe (default) "
                        "takes it from the source's launch scripts where they name one (InferenceX's gpt-oss: "
                        "Marlin on H100 and H200, FlashInfer's MXFP8 kernel on B200) and vLLM's own choice "
                        "elsewhere; or one kernel for every row, as sim replay's --moe-kernel")
    p.add_argument("--unique-prompts", type=UNIQUE_PROMPTS.flag_type("--unique-prompts"),
                   default=default.unique_prompts, metavar="N",
                   help="the client cycles through N prompts (AIPerf's and genai-perf's dataset of 100 by default) "
                        "and the server caches prefixes, vLLM's default (default: 0, every prompt its own and no "
                        "prefix caching, as InferenceMAX's vLLM servers)")
    p.add_argument("--sampling", default=default.sampling, choices=("auto", "greedy", "model"),
                   help="the benchmark client's sampling parameters, which decide the kernels of vLLM's sampler: auto "
                        "(default) per row from its source's client (genai-perf, which AIConfigurator's gap analysis "
                        "ran, sends none: the server's defaults from the model's generation_config.json; "
                        "InferenceMAX's sends temperature 0: greedy), or greedy or model for every row")
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--sync-scheduling", action="store_true",
                       help="every row: schedule each step after the last ends")
    sched.add_argument("--async-scheduling", action="store_true",
                       help="every row: schedule step k + 1 while step k runs (a new request waits one step more); "
                            "default: per row, asynchronous but for vLLM before 0.14")
    p.set_defaults(func=cmd_validate)
