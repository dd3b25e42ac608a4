"""The `sim` command line."""

from __future__ import annotations

import argparse
import difflib
import gc
import os
import signal
import sys
import time
from datetime import datetime, timezone

from sim.errors import ServesimError
from traces.cli import add_trace_options

DEFAULT_TRACE_HELP = "the bundled Azure conversation sample is traces/samples/azure_conv_2023_first5min.csv"


def add_replay_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that replays a trace: the trace's (traces/cli.py) and every
    field of ReplayOptions, generated from the dataclasses (sim/app/options.py)."""
    from sim.app.options import add_replay_flags
    from sim.config import POLICY_TIMEOUT_S

    add_trace_options(p)  # --format, --model-filter and the workload transforms
    add_replay_flags(p)
    # Not an option of the run (its answers do not depend on it): how long your own policy's or
    # router's call may take (policies/checked.py reads it from the environment, workers too).
    p.add_argument("--policy-timeout", type=POLICY_TIMEOUT_S.flag_type("--policy-timeout"), default=None,
                   metavar="S", help="stop the run (exit 2) when your own policy's or router's call does not return "
                                     "within S seconds; 0 for no bound (default: 10)")


def options_from_args(args: argparse.Namespace):
    from sim.app.options import options_from_args

    return options_from_args(args)


def run_stamp() -> str:
    """The start of a default run folder's name: UTC date and time."""
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def warn(message: str | None) -> None:
    if message:
        print(f"sim: warning: {message}", file=sys.stderr)


def cmd_replay(args: argparse.Namespace) -> int:
    from reports.metrics import format_summary
    from sim.app.outputs import command_inputs, open_run_folder
    from sim.app.plan import resolve
    from sim.app.progress import Progress
    from sim.app.replay import replay, replay_to, write_run
    from traces.cli import load_trace

    options = options_from_args(args)
    # The run folder is claimed (made, locked, refused if it holds a run) before any work.
    with open_run_folder(args.out, f"{run_stamp()}-{options.scheduler.policy}", overwrite=args.overwrite,
                         discard_on_failure=True, inputs=command_inputs(args)) as folder:
        warn(folder.took_over)
        plan = resolve(options)
        for message in plan.warnings():
            warn(message)
        trace = load_trace(args.trace, args, plan.max_model_len)
        if plan.options.scheduler.scheduling_policy == "priority" and trace.priority is None:
            warn(f"--scheduling-policy priority: {args.trace} gives no request a priority, so every request has "
                 "priority 0 and they are served first come, first served")
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
        comparison = write_measured(out, trace, args.requests)
    if not args.quiet:
        print(f"{options.scheduler.policy} on {trace.source}: {len(trace)} requests{_cluster_words(plan)}, "
              f"{describe(plan)}")
        for role, pool in zip(("prefill", "decode"), plan.pools):  # a disaggregated cluster's own pools
            print(f"  {role} pool: {pool.options.scheduler.policy}, {describe(pool).splitlines()[0]}")
        print(format_summary(summary))
        if comparison is not None:
            from reports.measured import format_measured

            print(format_measured(comparison))
        print(f"simulated {summary['simulated_s']:.1f} s in {wall:.2f} s of wall time; wrote {folder.final}/")
    return 0


def write_measured(out, trace, requests_format: str) -> dict | None:
    """measured.json beside a replay of a measured run (reports/measured.py); None for other traces."""
    if trace.measured is None:
        return None
    import json

    import pandas as pd

    from reports.measured import compare_measured
    from sim.app.outputs import atomic_write_text

    path = out / f"requests.{requests_format}"
    table = pd.read_csv(path, dtype={"request_id": str}) if requests_format == "csv" else pd.read_parquet(path)
    comparison = {"source": trace.source, **compare_measured(table, trace.measured, trace.ids())}
    atomic_write_text(out / "measured.json", json.dumps(comparison, indent=2) + "\n")
    from reports.html import run_report_html  # the report again, with the comparison's table

    summary = json.loads((out / "summary.json").read_text())
    digest = json.loads((out / "digest.json").read_text())
    atomic_write_text(out / "report.html", run_report_html(summary, digest, comparison))
    return comparison


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
        weights, experts = plan.model.linear_dtypes(options.dtype) if plan.model.num_experts else (options.dtype,) * 2
        dtype = weights if experts == weights else f"{weights}, experts {experts}"  # a checkpoint's own quantization
        where = f"{gpus}{plan.hardware.name} (costmodel, {dtype}"
        where += (", fp8 KV cache)" if options.kv_cache_dtype == "fp8" else ")")
        if options.dp > 1:
            where += f", DP {options.dp}"
        if plan.model.num_experts:
            moe_tp, ep = plan.model.moe_parallel(options.tp, options.dp, options.enable_expert_parallel)
            where += f", experts over {moe_tp * ep} GPU{'s' * (moe_tp * ep > 1)}" + (f" (EP {ep})" if ep > 1 else "")
        if plan.priced_by_roofline:
            where += ", roofline (no operator-table profile matches this model and GPU)"
    text = f"{plan.model.name} on {where}, {plan.num_blocks} KV blocks"
    if plan.kv is not None and plan.kv.capped_from is not None:
        text += f" (capped from {plan.kv.capped_from})"
    text += f", profile {options.profile}" if options.profile else ""
    text += f"\n{plan.tables['note']}" if getattr(plan, "tables", None) else ""
    host = getattr(plan.backend, "host", None)  # a HostTimedBackend's profile (backends/host_time.py)
    text += f"\n{host.note()}" if host is not None else ""
    sampling = getattr(plan, "sampling", None)
    if sampling is not None and not sampling.greedy:  # which of vLLM's sampler paths each step runs
        text += f"\nsampling: {sampling.describe()}, vLLM's {sampling.path(plan.model.vocab_size)} sampler path"
    return text


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
    list_package_models()
    return 0


def list_package_models() -> None:
    """The config.json files the tables package ships (--model ORG/NAME), each with its parameters
    and family where servesim prices it, else why not (the refusal, without its file's path)."""
    from backends.costmodel.optables.systems import INSTALL_HINT
    from backends.model_config import ModelConfig, config_name, package_model_configs

    folder = package_model_configs()
    if folder is None:
        print(f"with the tables extra ({INSTALL_HINT}), --model also takes the Hugging Face names of the "
              "config.json files the package ships")
        return
    paths = sorted(p for p in folder.glob("*_config.json") if not p.name.endswith("hf_quant_config.json"))
    print(f"\nthe tables package's model configs (--model ORG/NAME), {len(paths)}:")
    for path in paths:
        name = config_name(str(path))
        try:
            m = ModelConfig.from_hf(path)
        except ServesimError as e:
            why = str(e).replace(f"{path} (text_config): ", "").replace(f"{path}: ", "").split("; servesim")[0]
            print(f"  {name:<52} not priced: {why[:110]}{'...' if len(why) > 110 else ''}")
            continue
        family = m.model_type or "dense"
        print(f"  {name:<52} {m.num_parameters / 1e9:>8.2f}B  {family}")


def cmd_hardware(args: argparse.Namespace) -> int:
    from backends.costmodel.optables.systems import DISTRIBUTION, INSTALL_HINT, list_systems, package_systems_dir, package_version
    from backends.hardware import HARDWARE

    def row(name, h, tables=""):
        fp8 = "-" if h.peak_fp8_flops is None else f"{h.peak_fp8_flops / 1e12:.1f}"
        link = "-" if h.link is None else f"{h.link} {h.link_bandwidth / 1e9:.0f}"
        node = "-" if h.gpus_per_node is None else (
            f"{h.gpus_per_node}" + ("" if h.inter_node_bandwidth is None else f" x {h.inter_node_bandwidth / 1e9:.0f}"))
        print(f"{name:<22}{h.peak_bf16_flops / 1e12:>14.1f}{fp8:>13}{h.memory_bandwidth / 1e12:>10.2f}"
              f"{h.memory_bytes / 2**30:>12.1f}{link:>13}{node:>11}  {tables or h.description}")

    print(f"{'hardware':<22}{'bf16 TFLOP/s':>14}{'fp8 TFLOP/s':>13}{'HBM TB/s':>10}{'memory GiB':>12}"
          f"{'link GB/s':>13}{'node GB/s':>11}  description / vLLM tables")
    for name, h in HARDWARE.items():
        row(name, h)
    print("(link: what one GPU sends another in its node, one way; node: GPUs a node holds x what one GPU sends "
          "another node: a --tp or expert-parallel group of more GPUs crosses nodes)")
    if package_systems_dir() is None:
        print(f"(more systems, with their measured vLLM tables: {INSTALL_HINT})")
        return 0
    from backends.costmodel.optables.systems import system_table_versions
    from backends.hardware import resolve_hardware

    print(f"systems of {DISTRIBUTION} {package_version()} (--hardware NAME; --vllm-version picks their tables):")
    for name in list_systems():
        versions = system_table_versions(name)
        gemm, attention = versions["gemm"], versions["context_attention"]
        tables = (f"vLLM GEMM {', '.join(gemm)}; attention {', '.join(attention) or '-'}; all-reduce "
                  f"{', '.join(versions['custom_allreduce']) or '-'}") if gemm else "no vLLM tables: the roofline only"
        row(name, resolve_hardware(name), tables)
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, as servesim's own are ("sim replay: error: ...",
    exit 2), not the command's whole usage before it; an unknown option is named with the command it
    was given to, and the closest option it knows is suggested (`--polcy`: did you mean --policy?)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(parsed)
            known = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(extras[0].split("=")[0], known, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close and extras[0].startswith("-") else ""
            command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost command's parser that `parsed` went through (`sim trace stats`'s)."""
        parser: argparse.ArgumentParser = self
        while True:
            chosen = [action.choices[name] for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction)
                      and (name := getattr(parsed, action.dest, None)) in action.choices]
            if not chosen:
                return parser
            parser = chosen[0]


def build_parser(all_commands: bool = True) -> argparse.ArgumentParser:
    """The `sim` parser; without `all_commands`, only the commands defined here (replay, models,
    hardware), which parse their own arguments exactly as in the whole parser."""
    from sim.app.options import add_output_options

    parser = OneLineParser(prog="sim", description="servesim: replay LLM-serving traces through "
                                     "scheduling policies, with predicted or measured step times.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("replay", help="replay a trace through one policy",
                       description="Replay a trace through one scheduling policy and write the requests and "
                                   "steps tables (requests.csv, steps.parquet), summary.json, digest.json and "
                                   "report.html into a run folder.")
    p.add_argument("trace", help="trace file: canonical CSV, Azure 2023/2024, Mooncake JSONL, BurstGPT or "
                                   "Vidur CSV, a vllm bench serve result (JSON) or an AIPerf profile_export.jsonl, "
                                   f"gzip too; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    add_output_options(p)
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
    """`sim`'s entry point: the command's exit code. Ctrl-C while the command's modules load or its
    arguments are read is "interrupted" (130), as it is while the command runs, not a traceback."""
    try:
        code = _main(argv)
    except KeyboardInterrupt as e:
        print(ended_line("interrupted", e), file=sys.stderr)
        code = 130
    if argv is None and code in (130, 143):
        # The command line's process, ending on a Ctrl-C or SIGTERM: a second one while Python joins a worker
        # pool's threads at exit printed its traceback ("Exception ignored in threading._shutdown"). A call with
        # its own arguments (a test, a program of the user's) keeps its Ctrl-C.
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def ended_line(how: str, e: BaseException) -> str:
    """"sim: interrupted" (or "terminated"), and when it came as a finished run took its folder's place,
    that the folder holds it (the exception's words: sim.app.outputs.FolderLock._swap_in)."""
    return f"sim: {how} {e}" if str(e) else f"sim: {how}"


def _main(argv: list[str] | None) -> int:
    from sim.app.workers import Terminated, terminate_on_sigterm

    command = (sys.argv[1:] if argv is None else argv)[:1]
    # A command of this module needs none of the others' modules (their imports are most of a
    # replay's start-up but for pandas): a parser without them parses its arguments the same.
    parser = build_parser(all_commands=command not in (["replay"], ["models"], ["hardware"]))
    try:
        args = parser.parse_args(argv)
    except ServesimError as e:  # a number out of its range (sim.config.Range.flag_type)
        print(f"sim: error: {e}", file=sys.stderr)
        return 2
    previous = terminate_on_sigterm()  # so that workers are stopped and folder locks released
    from policies.checked import TIMEOUT_ENV  # read there, by every policy call and in workers

    timeout_before = os.environ.get(TIMEOUT_ENV)
    if getattr(args, "policy_timeout", None) is not None:  # read by policies/checked.py, here and in workers
        os.environ[TIMEOUT_ENV] = repr(args.policy_timeout)
    # A replay makes hundreds of thousands of objects that live for a while (requests, their token
    # times): at Python's default first threshold (700 new objects) the cyclic collector ran 250
    # times over the Azure hour and walked them, 3-5% of the run. Reference counting frees them
    # anyway; cycles are rare (a few hundred objects at the end of a run) and wait a little longer.
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_FIRST_THRESHOLD, *thresholds[1:])
    try:
        return args.func(args)
    except Terminated as e:  # (its words, where it came as a finished run took its folder's place)
        print(ended_line("terminated", e), file=sys.stderr)
        return 143
    except ServesimError as e:
        print(f"sim: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`sim ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt as e:
        print(ended_line("interrupted", e), file=sys.stderr)
        return 130
    except Exception as e:  # a bug: one line, and the traceback on request
        if os.environ.get("SERVESIM_DEBUG"):
            raise
        print(f"sim: internal error: {type(e).__name__}: {e} (set SERVESIM_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1
    finally:
        gc.set_threshold(*thresholds)
        if timeout_before is None:  # as it was: main() may run again in this process (tests)
            os.environ.pop(TIMEOUT_ENV, None)
        else:
            os.environ[TIMEOUT_ENV] = timeout_before
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
