"""Replay speed: the Azure LLM inference 2023 conversation trace (19,366 requests, about an hour)
with the cost model (Llama-3.1-8B on H100-SXM by default, budget 2048) under each policy, at 1x,
2x and 4x rate under chunked, the Mooncake synthetic trace (prefix caching) under chunked, and
`moe`: the Azure trace under chunked at 1x on Qwen3-30B-A3B (a mixture of experts, priced from the
operator tables where the hardware's system has them), with its time over chunked 1x's. The MoE
model's curves are derived from the tables by the first run on a machine and read from the cache
($SERVESIM_CACHE/ops/moe/) by later ones: a first run measures that derivation too.

    python bench/replay_speed.py [--trace FILE] [--mooncake FILE] [--only CONFIG ...] [--repeat N]
                                 [--model NAME] [--hardware NAME] [--no-fast-forward] [--no-e2e] [--sync]

CONFIG is POLICY:RATE on the Azure trace (chunked:2), `mooncake` or `moe`; with --only the figures of each
configuration asked for are printed as one JSON line (the table otherwise). Without --trace the traces are
looked up beside the repository (`../shared/traces/raw/`, from this checkout or from the main
checkout of a git worktree); when they are not there the bundled samples are replayed instead, and
the table says so.

Every run is a fresh process, so its peak memory is its own; each figure is the best of --repeat.
Columns:

- sim s, cpu s: wall and CPU seconds of the simulation alone (the trace read, the output not timed);
- x real: simulated seconds per wall second of simulation;
- e2e s, e2e cpu, e2e MB: the whole `sim replay ... --quiet` as a user runs it (start-up, reading,
  simulating, every output file), in a subprocess: its wall and CPU seconds and peak memory (RSS);
- ref s: the CPU seconds of a fixed pure-Python loop run in the same process just before the
  simulation (0.13-0.23 s on a quiet core here). The machine is shared: compare CPU figures across
  runs relative to it.

The simulation runs with the cyclic garbage collector set as `sim` sets it for a command (where the
tree's CLI sets it). Before the end-to-end runs the tree's modules are compiled to bytecode once
(`compileall`), as `pip install` does for an installed package: where PYTHONDONTWRITEBYTECODE is
set (it is on this project's machines) an editable checkout would otherwise recompile every module
on every command, which a user's installed `sim` does not (--cold keeps that cost in).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AZURE = "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = "synthetic_trace.jsonl"
CONFIGS = ("decode-first:1", "prefill-first:1", "chunked:1", "chunked:2", "chunked:4", "mooncake", "moe")
MOE_MODEL = "Qwen3-30B-A3B"  # the `moe` row: chunked 1x on the Azure trace with this model (issue 30: within 1.5x of --model)
AZURE_SAMPLE = ROOT / "traces" / "samples" / "azure_conv_2023_first5min.csv"
MOONCAKE_SAMPLE = ROOT / "traces" / "samples" / "mooncake_synthetic_last200.jsonl"
BUDGET = 2048
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def reference_loop() -> float:
    """CPU seconds of a fixed pure-Python loop (about 0.23 s on a quiet core of this project's machine)."""
    started = time.process_time()
    total = 0
    for i in range(3_000_000):
        total += i * i % 7
    return time.process_time() - started


def shared_trace(name: str) -> Path | None:
    """`../shared/traces/raw/NAME` beside this checkout, or beside the main checkout of a worktree."""
    roots = [ROOT]
    try:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        roots.append(Path(common).parent)
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout: only the folder beside this one
    for root in roots:
        path = root.parent / "shared" / "traces" / "raw" / name
        if path.exists():
            return path
    return None


def resolve_traces(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """The Azure and Mooncake trace paths, and notes on any bundled sample used instead."""
    notes = []
    paths = []
    for given, name, sample in ((args.trace, AZURE, AZURE_SAMPLE), (args.mooncake, MOONCAKE, MOONCAKE_SAMPLE)):
        if given is not None:
            if not Path(given).is_file():
                print(f"replay_speed: error: --{'trace' if name == AZURE else 'mooncake'} {given}: no such file",
                      file=sys.stderr)
                sys.exit(2)
            paths.append(str(Path(given).resolve()))
            continue
        found = shared_trace(name)
        if found is None:
            notes.append(f"{name} not found in ../shared/traces/raw/ (beside {ROOT}); replaying the bundled "
                         f"sample {sample.relative_to(ROOT)} instead (give the trace with --trace/--mooncake)")
            found = sample
        paths.append(str(found))
    return paths[0], paths[1], notes


def parse_config(text: str) -> tuple[str, float, bool]:
    """(policy, rate, is_mooncake) of a CONFIG."""
    if text == "mooncake":
        return "chunked", 1.0, True
    if text == "moe":
        return "chunked", 1.0, False
    policy, sep, rate = text.partition(":")
    try:
        return policy, float(rate) if sep else 1.0, False
    except ValueError:
        sys.exit(f"replay_speed: cannot read config {text!r}; expected POLICY:RATE or mooncake")


def collector_tuned() -> None:
    """The cyclic collector's first threshold as the tree's `sim` command sets it (sim/app/cli.py),
    so that the simulation alone is timed as it runs inside the command."""
    import gc

    try:
        from sim.app.cli import GC_FIRST_THRESHOLD
    except ImportError:  # a tree whose CLI leaves the collector at Python's default
        return
    gc.set_threshold(GC_FIRST_THRESHOLD, *gc.get_threshold()[1:])


def compile_tree() -> None:
    """Compile the tree's packages to bytecode (__pycache__, ignored by git), as pip does on install."""
    import compileall

    for package in ("sim", "policies", "backends", "traces", "reports"):
        compileall.compile_dir(str(ROOT / package), quiet=1)


def simulate(trace_path: str, policy: str, rate: float, model: str, hardware: str, fast_forward: bool,
             sync: bool = False) -> dict:
    """One replay in this process: wall and CPU seconds of the simulation (the trace read is not timed)."""
    try:
        from sim.app.replay import ReplayOptions, replay
    except ImportError:  # a checkout from before the application layer moved to sim/app
        from sim.replay import ReplayOptions, replay
    try:
        from sim.app.plan import resolve  # replay() takes a plan
    except ImportError:  # a checkout whose replay() resolved the options itself
        def resolve(options):
            return options
    from sim.config import SchedulerConfig
    from traces import read_trace
    from traces.transforms import scale_rate

    trace = scale_rate(read_trace(trace_path), rate)
    clock = {}
    if sync and "async_scheduling" in SchedulerConfig.__dataclass_fields__:
        clock = dict(async_scheduling=False, host_time=False)  # the engine's clock of trees before issue 29
    options = ReplayOptions(scheduler=SchedulerConfig(policy, max_num_batched_tokens=BUDGET, **clock),
                            model=model, hardware=hardware)
    collector_tuned()
    ref = reference_loop()
    started, cpu_started = time.perf_counter(), time.process_time()
    result = replay(trace, resolve(options), fast_forward=fast_forward)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"policy": policy, "rate": rate, "sim_s": wall, "cpu_s": cpu, "ref_s": ref, "simulated_s": result.end_s,
            "steps": len(result.steps), "finished": sum(r.finish_s is not None for r in result.requests),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def end_to_end(trace_path: str, policy: str, rate: float, model: str, hardware: str, fast_forward: bool,
               sync: bool = False) -> dict:
    """`sim replay` as a user runs it, in its own process: wall seconds and peak RSS."""
    with tempfile.TemporaryDirectory(prefix="replay_speed_") as out:
        cli = "sim.app.cli" if (ROOT / "sim" / "app" / "cli.py").exists() else "sim.cli"
        cmd = [sys.executable, "-m", cli, "replay", trace_path, "--policy", policy, "--rate-scale", f"{rate:g}",
               "--model", model, "--hardware", hardware, "--max-num-batched-tokens", str(BUDGET),
               "--out", out, "--quiet"] + ([] if fast_forward else ["--no-fast-forward"])
        if sync and "async_scheduling" in (ROOT / "sim" / "config.py").read_text():
            cmd += ["--no-async-scheduling", "--no-host-time"]
        started = time.perf_counter()
        process = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(process.pid, 0)  # its own rusage, not every child's
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr = process.stderr.read().decode()
        process.stderr.close()
        if process.returncode:
            sys.exit(f"replay_speed: {' '.join(cmd)} failed ({process.returncode}):\n{stderr}")
    return {"e2e_s": wall, "e2e_cpu_s": usage.ru_utime + usage.ru_stime, "e2e_rss_mb": usage.ru_maxrss / 1024}


def worker(args: argparse.Namespace) -> None:
    policy, rate, trace = args.worker.split("|")
    print(json.dumps(simulate(trace, policy, float(rate), args.model, args.hardware, not args.no_fast_forward,
                              args.sync)))


def best(runs: list[dict], key: str) -> float:
    return min(run[key] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=None, help=f"the Azure trace (default: ../shared/traces/raw/{AZURE})")
    parser.add_argument("--mooncake", default=None, help=f"the Mooncake trace (default: ../shared/traces/raw/{MOONCAKE})")
    parser.add_argument("--only", action="append", default=None, metavar="CONFIG",
                        help=f"run only this configuration (repeatable); default: {' '.join(CONFIGS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration; the best is shown")
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--hardware", default="H100-SXM")
    parser.add_argument("--no-fast-forward", action="store_true", help="step every iteration one by one")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end (CLI) runs")
    parser.add_argument("--sync", action="store_true",
                        help="step without asynchronous scheduling and host time (the engine's clock of trees "
                             "before issue 29), so an older tree and this one take the same steps")
    parser.add_argument("--cold", action="store_true",
                        help="do not compile the tree's bytecode before the end-to-end runs")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # POLICY|RATE|TRACE: one run, as JSON
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.repeat < 1:
        sys.exit("replay_speed: --repeat must be at least 1")
    azure, mooncake, notes = resolve_traces(args)
    fast_forward = not args.no_fast_forward
    table = not args.only  # with --only: one JSON line per configuration, for scripts
    say = print if table else (lambda text: print(text, file=sys.stderr))
    say(f"Azure trace {azure}\nMooncake trace {mooncake}\n{args.model} on {args.hardware}, budget {BUDGET}, "
        f"{'fast-forward' if fast_forward else 'step by step'}, best of {args.repeat}")
    for note in notes:
        say(f"note: {note}")
    if not args.no_e2e and not args.cold:
        compile_tree()
    if table:
        print(f"{'config':<17}{'sim s':>8}{'cpu s':>8}{'ref s':>7}{'simulated':>11}{'x real':>8}{'steps':>9}"
              f"{'RSS MB':>8}{'e2e s':>8}{'e2e cpu':>8}{'e2e MB':>8}")
    seen: dict[str, float] = {}
    for config in args.only or CONFIGS:
        policy, rate, is_mooncake = parse_config(config)
        trace = mooncake if is_mooncake else azure
        model = MOE_MODEL if config == "moe" else args.model
        cmd = [sys.executable, __file__, "--worker", f"{policy}|{rate}|{trace}", "--model", model,
               "--hardware", args.hardware] + ([] if fast_forward else ["--no-fast-forward"]) + \
            (["--sync"] if args.sync else [])
        runs = []
        for _ in range(args.repeat):
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=ENV)
            if done.returncode:
                sys.exit(f"replay_speed: {config} failed:\n{done.stderr}")
            run = json.loads(done.stdout)
            if not args.no_e2e:
                run.update(end_to_end(trace, policy, rate, model, args.hardware, fast_forward, args.sync))
            runs.append(run)
        label = "mooncake chunked" if is_mooncake else f"{MOE_MODEL} 1x" if config == "moe" else f"{policy} {rate:g}x"
        sim_s, simulated = best(runs, "sim_s"), runs[0]["simulated_s"]
        seen[config] = sim_s
        if not table:
            row = dict(runs[0], config=config, x_real=simulated / sim_s)
            row.update({key: best(runs, key) for key in row if key.endswith(("_s", "_mb")) and key != "simulated_s"})
            print(json.dumps(row), flush=True)
            continue
        e2e = "" if args.no_e2e else \
            f"{best(runs, 'e2e_s'):>8.2f}{best(runs, 'e2e_cpu_s'):>8.2f}{best(runs, 'e2e_rss_mb'):>8.0f}"
        print(f"{label:<17}{sim_s:>8.2f}{best(runs, 'cpu_s'):>8.2f}{best(runs, 'ref_s'):>7.2f}{simulated:>11.0f}"
              f"{simulated / sim_s:>8.0f}{runs[0]['steps']:>9}{best(runs, 'rss_mb'):>8.0f}" + e2e, flush=True)
    if "moe" in seen and "chunked:1" in seen:
        say(f"{MOE_MODEL} / {args.model} (chunked 1x, sim s): {seen['moe'] / seen['chunked:1']:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
