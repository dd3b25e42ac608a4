"""Cluster replay speed: the whole Azure LLM inference 2023 conversation trace (19,366 requests,
about an hour) on 1, 4 and 16 replicas (Llama-3.1-8B on H100-SXM with the datasheet roofline,
chunked, budget 2048), with the trace as it is and at N times its rate (each replica then carries
about the hour's load). Each configuration runs in its own process.

    python bench/cluster_speed.py [--trace FILE] [--router NAME] [--no-fast-forward] [--repeat N]

Beside each replay's wall and CPU seconds it prints the CPU seconds of a fixed pure-Python
reference loop run in the same process just before, and the ratio of the two CPU times: the machine
is shared, and the ratio is what to compare across configurations and machines. The target: N
replicas cost at most about N times one replica at the same load per replica (the `vs N x 1`
column: the ratio over N times the one-replica ratio).
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
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "raw" / "AzureLLMInferenceTrace_conv.csv"
CONFIGS = [(1, 1.0), (4, 1.0), (16, 1.0), (4, 4.0), (16, 16.0)]  # (replicas, rate scale)
REFERENCE_N = 3_000_000


def reference_loop() -> float:
    """CPU seconds of a fixed pure-Python loop: additions, multiplications and list appends."""
    started = time.process_time()
    total, out = 0, []
    for i in range(REFERENCE_N):
        total += i * i % 7
        if not i & 1023:
            out.append(total)
    return time.process_time() - started


def one(trace_path: str, replicas: int, rate: float, router: str, fast_forward: bool) -> dict:
    from sim.app.cluster_options import ClusterOptions
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.app.replay import replay
    from sim.config import SchedulerConfig
    from traces import read_trace
    from traces.transforms import scale_rate

    trace = scale_rate(read_trace(trace_path), rate)
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=2048),
                            model="Llama-3.1-8B", hardware="H100-SXM", profile="roofline",
                            cluster=ClusterOptions(num_replicas=replicas, router=router))
    reference_s = reference_loop()
    started, cpu_started = time.perf_counter(), time.process_time()
    result = replay(trace, resolve(options), fast_forward=fast_forward)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"replicas": replicas, "rate": rate, "requests": len(trace), "wall_s": wall, "cpu_s": cpu,
            "reference_s": reference_s,
            "simulated_s": result.end_s, "steps": len(result.steps),
            "finished": sum(r.finish_s is not None for r in result.requests),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--router", default="round-robin")
    parser.add_argument("--no-fast-forward", action="store_true", help="step every iteration one by one")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration; the lowest ratio is shown")
    parser.add_argument("--only", default=None, help="REPLICAS:RATE, one configuration in this process")
    args = parser.parse_args()
    if args.only:
        replicas, rate = args.only.split(":")
        print(json.dumps(one(args.trace, int(replicas), float(rate), args.router, not args.no_fast_forward)))
        return
    mode = "step by step" if args.no_fast_forward else "fast-forward"
    print(f"trace {args.trace} ({mode}, router {args.router})")
    print(f"{'replicas':>8}{'rate':>6}{'requests':>10}{'wall s':>9}{'cpu s':>8}{'ref s':>8}{'cpu/ref':>9}{'vs N x 1':>10}"
          f"{'sim s':>8}{'steps':>10}{'RSS MB':>8}")
    one_ratio = {}  # rate per replica -> the one-replica ratio
    for replicas, rate in CONFIGS:
        cmd = [sys.executable, __file__, "--trace", args.trace, "--router", args.router, "--only", f"{replicas}:{rate}"]
        if args.no_fast_forward:
            cmd.append("--no-fast-forward")
        runs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
                for _ in range(args.repeat)]
        r = min(runs, key=lambda run: run["cpu_s"] / run["reference_s"])
        ratio = r["cpu_s"] / r["reference_s"]
        per_replica = rate / replicas
        if replicas == 1:
            one_ratio[per_replica] = ratio
        versus = ratio / (replicas * one_ratio[per_replica]) if per_replica in one_ratio else float("nan")
        print(f"{replicas:>8}{rate:>6g}{r['requests']:>10}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{r['reference_s']:>8.3f}"
              f"{ratio:>9.1f}"
              f"{versus:>10.2f}{r['simulated_s']:>8.0f}{r['steps']:>10}{r['peak_rss_mb']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
