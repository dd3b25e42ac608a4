"""Bounded memory at scale: synthetic traffic of 1, 3 and 10 million requests (a week at 10M),
replayed end to end by `sim replay`, with the peak memory (RSS) and wall/CPU time of each.

    python bench/week_scale.py [--sizes 1000000,3000000,10000000] [--work DIR] [--keep]

The traces come from `sim trace synth` at one rate, 10 million requests a week (16.53 requests a
second on average) with a diurnal pattern of amplitude 0.5 (3:1 peak to trough), prompt and output
lengths resampled from the Azure conversation trace (../shared/traces/raw/, or the bundled
five-minute sample). A trace of N requests is the first N / 16.53 seconds of such traffic; the
replay is chunked, Llama-3.1-8B on H100-SXM, budget 2048, with the steps table written (Parquet).
Time should grow linearly with N and memory stay flat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATE = 10_000_000 / (7 * 86_400)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def reference_loop() -> float:
    from replay_speed import reference_loop as loop  # bench/ is this script's folder

    return loop()


def lengths_source() -> Path:
    from replay_speed import AZURE, AZURE_SAMPLE, shared_trace  # bench/ is this script's folder

    return shared_trace(AZURE) or AZURE_SAMPLE


def timed(cmd: list[str]) -> dict:
    """Run a command; its wall and CPU seconds and peak RSS (its own, via wait4)."""
    started = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    stderr = process.stderr.read().decode()
    process.stderr.close()
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"week_scale: {' '.join(cmd)} failed:\n{stderr}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,3000000,10000000", help="requests per trace, comma-separated")
    parser.add_argument("--work", default=None, help="folder for the traces and runs (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the traces and run folders")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="week_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    source = lengths_source()
    print(f"lengths from {source}; {RATE:.3f} requests/s, diurnal 0.5; work folder {work}")
    print(f"{'requests':>10}{'simulated h':>13}{'synth s':>9}{'replay s':>10}{'cpu s':>9}{'us/request':>12}"
          f"{'peak RSS MB':>13}{'ref s':>7}")
    python = sys.executable
    for n in sizes:
        trace = work / f"synth_{n}.csv"
        synth = timed([python, "-m", "sim.app.cli", "trace", "synth", str(trace), "--num-requests", str(n),
                       "--rate", f"{RATE:.6f}", "--diurnal", "0.5", "--lengths-from", str(source), "--seed", "0"])
        out = work / f"run_{n}"
        ref = reference_loop()  # this machine's speed just before the run (0.13 s on a quiet core)
        run = timed([python, "-m", "sim.app.cli", "replay", str(trace), "--out", str(out), "--overwrite", "--quiet"])
        simulated = json.loads((out / "summary.json").read_text())["simulated_s"]
        print(f"{n:>10,}{simulated / 3600:>13.1f}{synth['wall_s']:>9.0f}{run['wall_s']:>10.0f}{run['cpu_s']:>9.0f}"
              f"{run['cpu_s'] / n * 1e6:>12.0f}{run['rss_mb']:>13.0f}{ref:>7.2f}", flush=True)
        if not args.keep:
            trace.unlink()


if __name__ == "__main__":
    main()
