"""Replay speed: the whole Azure LLM inference 2023 conversation trace (19,366 requests, about an
hour) with the cost model (Llama-3.1-8B on H100-SXM, budget 2048) under each policy, and at 1x, 2x
and 4x rate under chunked. Each configuration runs in its own process so its peak memory is its own.

    python bench/replay_speed.py [--trace FILE] [--no-fast-forward] [--repeat N]

The trace is the project's shared copy (../shared/traces/raw/ beside the checkout) when there is
one; without it, the bundled five-minute cut (traces/samples/), which is said so in the output.

Prints: wall seconds (best of --repeat) and the CPU seconds of that run, simulated seconds, real-time factor (simulated / wall),
steps, steps per wall second, peak memory (RSS) of the process.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACE = ROOT.parent / "shared" / "traces" / "raw" / "AzureLLMInferenceTrace_conv.csv"
SAMPLE_TRACE = ROOT / "traces" / "samples" / "azure_conv_2023_first5min.csv"
CONFIGS = [("decode-first", 1.0), ("prefill-first", 1.0), ("chunked", 1.0), ("chunked", 2.0), ("chunked", 4.0)]


def one(trace_path: str, policy: str, rate: float, fast_forward: bool) -> dict:
    """One replay in this process: its wall and CPU seconds (the trace read is not timed)."""
    from sim.app.replay import ReplayOptions, replay
    from sim.config import SchedulerConfig
    from traces import read_trace
    from traces.transforms import scale_rate

    trace = scale_rate(read_trace(trace_path), rate)
    options = ReplayOptions(scheduler=SchedulerConfig(policy, max_num_batched_tokens=2048),
                            model="Llama-3.1-8B", hardware="H100-SXM")
    started, cpu_started = time.perf_counter(), time.process_time()
    result = replay(trace, options, fast_forward=fast_forward)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"policy": policy, "rate": rate, "wall_s": wall, "cpu_s": cpu, "simulated_s": result.end_s,
            "steps": len(result.steps), "finished": sum(r.finish_s is not None for r in result.requests),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=None,
                        help=f"trace file (default: {SHARED_TRACE} if it exists, else {SAMPLE_TRACE})")
    parser.add_argument("--no-fast-forward", action="store_true", help="step every iteration one by one")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration; the fastest is shown")
    parser.add_argument("--only", default=None, help="POLICY:RATE, one configuration in this process")
    args = parser.parse_args()
    note = ""
    if args.trace is None:
        args.trace = str(SHARED_TRACE if SHARED_TRACE.exists() else SAMPLE_TRACE)
        if not SHARED_TRACE.exists():
            note = f" (the full hour is {SHARED_TRACE}, not here: the bundled five-minute cut instead)"
    if not Path(args.trace).is_file():
        parser.error(f"--trace {args.trace}: no such file")
    if args.only:
        policy, rate = args.only.split(":")
        print(json.dumps(one(args.trace, policy, float(rate), not args.no_fast_forward)))
        return
    mode = "step by step" if args.no_fast_forward else "fast-forward"
    print(f"trace {args.trace} ({mode}){note}")
    print(f"{'policy':<14}{'rate':>5}{'wall s':>9}{'cpu s':>8}{'sim s':>9}{'x real':>9}{'steps':>9}{'steps/s':>10}"
          f"{'RSS MB':>8}")
    for policy, rate in CONFIGS:
        cmd = [sys.executable, __file__, "--trace", args.trace, "--only", f"{policy}:{rate}"]
        if args.no_fast_forward:
            cmd.append("--no-fast-forward")
        runs = []
        for _ in range(args.repeat):  # each in its own process: its peak memory is its own
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{policy} at {rate}x failed:\n{done.stderr.strip()}")
            runs.append(json.loads(done.stdout))
        r = min(runs, key=lambda run: run["wall_s"])
        print(f"{policy:<14}{rate:>5g}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{r['simulated_s']:>9.0f}{r['simulated_s'] / r['wall_s']:>9.0f}"
              f"{r['steps']:>9}{r['steps'] / r['wall_s']:>10.0f}{r['peak_rss_mb']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
