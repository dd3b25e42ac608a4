"""The `sim` command line."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from datetime import datetime, timezone

from sim.errors import ServesimError
from traces.cli import add_trace_options, whole_number

DEFAULT_TRACE_HELP = "the bundled Azure conversation sample is traces/samples/azure_conv_2023_first5min.csv"


def add_replay_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that replays a trace."""
    from backends.hardware import HARDWARE
    from backends.presets import MODELS
    from policies import POLICIES

    add_trace_options(p)  # --format, --model-filter and the workload transforms
    p.add_argument("--policy", default="chunked",
                   help=f"scheduling policy: {', '.join(POLICIES)} (default: chunked), or your own as "
                        "path/to/file.py:ClassName or package.module:ClassName (see the README)")
    p.add_argument("--model", default="Llama-3.1-8B", metavar="NAME|CONFIG",
                   help=f"model preset ({', '.join(MODELS)}) or a Hugging Face config.json, or a folder holding "
                        "one: dense Llama, Mistral, Qwen2, Qwen3 (default: Llama-3.1-8B)")
    p.add_argument("--hardware", default="H100-SXM", metavar="NAME|FILE.json",
                   help=f"hardware preset ({', '.join(HARDWARE)}) or a JSON file with its fields (see the README; "
                        "default: H100-SXM)")
    p.add_argument("--tp", type=whole_number, default=1, metavar="N",
                   help="tensor parallelism: GPUs per engine, joined by NVLink (default: 1)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                   help="the weights' dtype: fp8 halves their bytes and uses the fp8 peak (default: bf16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="the KV cache's dtype: auto (bf16) or fp8, half the bytes per block (default: auto)")
    p.add_argument("--backend", default="costmodel",
                   help="step-time backend: costmodel (default) or real (runs every step through a real model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="the real backend's device (default: cpu)")
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="the real backend's weights: a local safetensors folder with Hugging Face tensor names "
                        "matching --model (default: random weights, seeded by --seed)")
    p.add_argument("--max-num-batched-tokens", type=whole_number, default=2048, metavar="N",
                   help="token budget of one step (default: 2048)")
    p.add_argument("--max-num-seqs", type=whole_number, default=256, metavar="N",
                   help="most requests running at once (default: 256)")
    p.add_argument("--max-model-len", type=whole_number, default=None, metavar="N",
                   help="longest prompt + output accepted; longer requests are rejected "
                        "(default: the model's max_position_embeddings)")
    p.add_argument("--reserve-full-isl", action=argparse.BooleanOptionalAction, default=True,
                   help="admit a waiting request only if KV blocks for its whole prompt (and any tokens it "
                        "generated before a preemption) are free, not just its first chunk's: vLLM's "
                        "scheduler_reserve_full_isl (default: on)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="chunked: most prompt tokens one request computes in a step, so long prompts share "
                        "the budget; 0 for no cap (vLLM's option and default; vLLM lifts it when a single "
                        "request is waiting or running)")
    p.add_argument("--scheduling-policy", default="fcfs", metavar="fcfs|priority",
                   help="order of the waiting queue: fcfs (arrival) or priority (the trace's priority column, "
                        "lower first, then arrival; preemption takes the running request with the largest "
                        "priority value), as vLLM's --scheduling-policy (default: fcfs)")
    p.add_argument("--block-size", type=whole_number, default=16, metavar="N",
                   help="tokens per KV block, a power of two (default: 16)")
    p.add_argument("--num-gpu-blocks", "--num-blocks", dest="num_blocks", type=whole_number, default=None,
                   metavar="N", help="KV blocks per GPU, the figure a vLLM log prints (vLLM's "
                                     "--num-gpu-blocks-override; default: derived as vLLM derives it, see the README)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of device memory for weights, activations and KV cache (default: 0.9)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--seed", type=whole_number, default=0, help="seed of the synthetic token ids (default: 0)")
    p.add_argument("--slo", default=None, metavar="ttft=S,tpot=S,e2e=S,tbt=S,delay=S",
                   help="service-level objectives in seconds, for goodput: a request counts when its TTFT, TPOT, "
                        "E2E latency, every gap between its tokens (tbt) and its scheduling delay are within "
                        "those given (the keys of sim capacity's --slo)")
    p.add_argument("--profile", default=None, metavar="PROFILE.json|roofline",
                   help="cost-model profile from `sim calibrate` (fitted, e.g. profiles/tiny-cpu.json, or derived "
                        "from operator tables with --from-ops); roofline: the datasheet roofline (default: the "
                        "operator-table profile in profiles/ops/ matching the model, hardware, --tp and dtypes, "
                        "else the roofline)")
    p.add_argument("--vllm-version", default=None, metavar="X.Y.Z",
                   help="price the run with the operator tables of this vLLM version (AIConfigurator's package, "
                        "pip install -e '.[tables]'): the version itself, else the nearest the system has (said on "
                        "the terminal and in summary.json); default: a committed profile, else the newest")
    add_cluster_options(p)


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    from policies.routers import ROUTERS
    from sim.app.cluster_options import POOL_OPTIONS

    g = p.add_argument_group("cluster", "replicas behind a router, or prefill and decode pools (see the README)")
    g.add_argument("--replicas", type=whole_number, default=1, metavar="N",
                   help="colocated replicas, each an engine with its own policy and KV cache (default: 1)")
    g.add_argument("--router", default="round-robin",
                   help=f"which replica takes each request: {', '.join(ROUTERS)} (default: round-robin), or your "
                        "own as path/to/file.py:ClassName")
    g.add_argument("--prefill-replicas", type=whole_number, default=0, metavar="P",
                   help="disaggregated: replicas that prefill and emit the first token")
    g.add_argument("--decode-replicas", type=whole_number, default=0, metavar="D",
                   help="disaggregated: replicas that decode once a request's KV blocks have arrived")
    g.add_argument("--kv-transfer-bandwidth", type=float, default=None, metavar="GB/S",
                   help="KV link bandwidth per transfer (default: 450 GB/s, NVLink-class, when the pools' GPUs fit "
                        "in one 8-GPU node; 50 GB/s, RDMA-class, across nodes)")
    g.add_argument("--kv-transfer-latency", type=float, default=None, metavar="S",
                   help="KV link setup time per transfer (default: 5e-6 s inside a node, 2e-5 s across nodes)")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--{pool}-options", default="", metavar="KEY=VALUE,...",
                       help=f"the {pool} pool's own settings, KEY one of {', '.join(POOL_OPTIONS)}")


def options_from_args(args: argparse.Namespace):
    from sim.app.cluster_options import ClusterOptions
    from sim.app.options import ReplayOptions
    from sim.config import SLO, CacheConfig, SchedulerConfig

    return ReplayOptions(
        scheduler=SchedulerConfig(args.policy, args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len,
                                  reserve_full_isl=args.reserve_full_isl,
                                  long_prefill_token_threshold=args.long_prefill_token_threshold,
                                  scheduling_policy=args.scheduling_policy),
        cache=CacheConfig(args.block_size, args.num_blocks, args.gpu_memory_utilization, not args.no_prefix_caching),
        model=args.model, hardware=args.hardware, tp=args.tp, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        backend=args.backend, seed=args.seed, slo=SLO.parse(args.slo),
        device=args.device, weights=args.weights,
        profile=args.profile, vllm_version=getattr(args, "vllm_version", None),
        cluster=ClusterOptions(args.replicas, args.router, args.prefill_replicas, args.decode_replicas,
                               args.kv_transfer_bandwidth, args.kv_transfer_latency, args.prefill_options,
                               args.decode_options),
    )


def run_stamp() -> str:
    """The start of a default run folder's name: UTC date and time."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def warn(message: str | None) -> None:
    if message:
        print(f"sim: warning: {message}", file=sys.stderr)


def cmd_replay(args: argparse.Namespace) -> int:
    from reports.metrics import format_summary
    from sim.app.outputs import open_run_folder
    from sim.app.plan import resolve
    from sim.app.progress import Progress
    from sim.app.replay import replay, replay_to, write_run
    from traces.cli import load_trace

    options = options_from_args(args)
    # The run folder is claimed (made, locked, refused if it holds a run) before any work.
    with open_run_folder(args.out, f"{run_stamp()}-{options.scheduler.policy}", overwrite=args.overwrite,
                         discard_on_failure=True) as folder:
        warn(folder.took_over)
        plan = resolve(options)
        trace = load_trace(args.trace, args, plan.max_model_len)
        progress = Progress.for_replay(len(trace), quiet=args.quiet)
        started = time.perf_counter()
        out = folder.folder
        if plan.options.cluster.is_single:  # streamed, in bounded memory
            summary = replay_to(out, trace, plan, steps=args.steps, requests=args.requests, progress=progress,
                                fast_forward=not args.no_fast_forward)
        else:  # a cluster's run is kept in memory, then written
            result = replay(trace, plan, progress=progress, fast_forward=not args.no_fast_forward)
            summary = write_run(out, result, plan, trace, steps=args.steps, requests=args.requests)
        progress.close()
        wall = time.perf_counter() - started
    if not args.quiet:
        print(f"{options.scheduler.policy} on {trace.source}: {len(trace)} requests, {describe(plan)}"
              + _cluster_words(plan))
        print(format_summary(summary))
        print(f"simulated {summary['simulated_s']:.1f} s in {wall:.2f} s of wall time; wrote {out}/")
    return 0


def _cluster_words(plan) -> str:
    cluster = plan.options.cluster
    if cluster.is_single:
        return ""
    if cluster.is_disaggregated:
        link = plan.kv_link()
        return (f", {cluster.num_prefill_replicas} prefill + {cluster.num_decode_replicas} decode replicas "
                f"({cluster.router}), KV link {link.bandwidth_gb_s:g} GB/s + {link.latency_s:g} s")
    return f", {cluster.num_replicas} replicas ({cluster.router})"


def describe(plan) -> str:
    """One line: the model, where it runs, and its KV cache."""
    options = plan.options
    if options.backend == "real":
        where = f"{options.device} (real, measured)"
    else:
        gpus = f"{options.tp} x " if options.tp > 1 else ""
        where = f"{gpus}{plan.hardware.name} (costmodel, {options.dtype}"
        where += (", fp8 KV cache)" if options.kv_cache_dtype == "fp8" else ")")
    text = f"{plan.model.name} on {where}, {plan.num_blocks} KV blocks"
    text += f", profile {options.profile}" if options.profile else ""
    return text + (f"\n{plan.tables['note']}" if getattr(plan, "tables", None) else "")


def cmd_models(args: argparse.Namespace) -> int:
    from backends.model_config import ModelConfig
    from backends.presets import MODELS

    print(f"{'model':<16}{'params':>9}{'layers':>8}{'hidden':>8}{'heads':>7}{'kv':>4}{'vocab':>8}{'KV/token':>11}"
          f"{'max len':>9}")
    for name in MODELS:
        m = ModelConfig.from_preset(name)
        print(f"{name:<16}{m.num_parameters / 1e9:>8.2f}B{m.num_hidden_layers:>8}{m.hidden_size:>8}"
              f"{m.num_attention_heads:>7}{m.num_key_value_heads:>4}{m.vocab_size:>8}"
              f"{m.kv_bytes_per_token() / 1024:>8.0f} KiB{m.max_position_embeddings:>9}")
    print("max len: the longest prompt + output (max_position_embeddings), the default --max-model-len")
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    from backends.hardware import HARDWARE
    from backends.systems import DISTRIBUTION, INSTALL_HINT, list_systems, package_systems_dir, package_version

    def row(name, h, tables=""):
        fp8 = "-" if h.peak_fp8_flops is None else f"{h.peak_fp8_flops / 1e12:.1f}"
        link = "-" if h.link is None else f"{h.link} {h.link_bandwidth / 1e9:.0f}"
        print(f"{name:<22}{h.peak_bf16_flops / 1e12:>14.1f}{fp8:>13}{h.memory_bandwidth / 1e12:>10.2f}"
              f"{h.memory_bytes / 2**30:>12.1f}{link:>13}  {tables or h.description}")

    print(f"{'hardware':<22}{'bf16 TFLOP/s':>14}{'fp8 TFLOP/s':>13}{'HBM TB/s':>10}{'memory GiB':>12}"
          f"{'link GB/s':>13}  description / vLLM tables")
    for name, h in HARDWARE.items():
        row(name, h)
    if package_systems_dir() is None:
        print(f"(more systems, with their measured vLLM tables: {INSTALL_HINT})")
        return 0
    from backends.hardware import resolve_hardware
    from backends.systems import system_table_versions

    print(f"systems of {DISTRIBUTION} {package_version()} (--hardware NAME; --vllm-version picks their tables):")
    for name in list_systems():
        versions = system_table_versions(name)
        gemm, attention = versions["gemm"], versions["context_attention"]
        tables = (f"vLLM GEMM {', '.join(gemm)}; attention {', '.join(attention) or '-'}; all-reduce "
                  f"{', '.join(versions['custom_allreduce']) or '-'}") if gemm else "no vLLM tables: the roofline only"
        row(name, resolve_hardware(name), tables)
    return 0


def build_parser(all_commands: bool = True) -> argparse.ArgumentParser:
    """The `sim` parser; without `all_commands`, only the commands defined here (replay, models,
    hardware), which parse their own arguments exactly as in the whole parser."""
    parser = argparse.ArgumentParser(prog="sim", description="servesim: replay LLM-serving traces through "
                                     "scheduling policies, with predicted or measured step times.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("replay", help="replay a trace through one policy",
                       description="Replay a trace through one scheduling policy and write the requests and "
                                   "steps tables (requests.csv, steps.parquet), summary.json, digest.json and "
                                   "report.html into a run folder.")
    p.add_argument("trace", help="trace file: canonical CSV, Azure 2023/2024, Mooncake JSONL, BurstGPT or "
                                   f"Vidur CSV, gzip too; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    p.add_argument("--out", default=None, help="run folder to write (default: a new folder under runs/)")
    p.add_argument("--overwrite", action="store_true", help="write into --out even if it holds a run")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.add_argument("--no-fast-forward", action="store_true",
                   help="simulate every decode step one by one (same results, slower; for checking)")
    p.add_argument("--steps", choices=("parquet", "csv", "none"), default="parquet",
                   help="the per-step table: steps.parquet (default), steps.csv, or none")
    p.add_argument("--requests", choices=("csv", "parquet"), default="csv",
                   help="the per-request table: requests.csv (default) or requests.parquet")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("models", help="list the model presets")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("hardware", help="list the hardware presets and the systems of the tables extra")
    p.set_defaults(func=cmd_hardware)
    if all_commands:
        for register in _command_modules():
            register(sub)
    return parser


def _command_modules():
    """Other commands live beside the code they drive; each module has `register(subparsers)`."""
    import importlib

    registrars = []
    for module in COMMAND_MODULES:
        registrars.append(importlib.import_module(module).register)
    return registrars


# Modules adding subcommands (each defines `register(subparsers)`), in the order `sim --help` lists them.
COMMAND_MODULES: list[str] = ["sim.app.bench", "sim.app.calibrate", "sim.app.compare", "sim.app.trace_cli",
                             "sim.app.sweep_cli", "sim.app.capacity_cli", "sim.app.report", "sim.app.validate_cli"]


GC_FIRST_THRESHOLD = 10_000  # new container objects between two runs of the cyclic collector's youngest pass


def main(argv: list[str] | None = None) -> int:
    from sim.app.workers import Terminated, terminate_on_sigterm

    command = (sys.argv[1:] if argv is None else argv)[:1]
    # A command of this module needs none of the others' modules (their imports are most of a
    # replay's start-up but for pandas): a parser without them parses its arguments the same.
    parser = build_parser(all_commands=command not in (["replay"], ["models"], ["hardware"]))
    args = parser.parse_args(argv)
    previous = terminate_on_sigterm()  # so that workers are stopped and folder locks released
    # A replay makes hundreds of thousands of objects that live for a while (requests, their token
    # times): at Python's default first threshold (700 new objects) the cyclic collector ran 250
    # times over the Azure hour and walked them, 3-5% of the run. Reference counting frees them
    # anyway; cycles are rare (a few hundred objects at the end of a run) and wait a little longer.
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_FIRST_THRESHOLD, *thresholds[1:])
    try:
        return args.func(args)
    except Terminated:
        print("sim: terminated", file=sys.stderr)
        return 143
    except ServesimError as e:
        print(f"sim: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`sim ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print("sim: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: one line, and the traceback on request
        if os.environ.get("SERVESIM_DEBUG"):
            raise
        print(f"sim: internal error: {type(e).__name__}: {e} (set SERVESIM_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1
    finally:
        gc.set_threshold(*thresholds)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
