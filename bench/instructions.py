"""Instructions of one replay, counted by valgrind's callgrind: a measure of a change that the
machine's load does not move (wall times on this shared machine drift by 1.5x within a day;
instruction counts repeat to well under 1%).

    python bench/instructions.py [TRACE] [--tree DIR ...] [--whole] [--sync] [--model NAME]

For each source tree (default: this checkout) the replay of TRACE (default: the bundled Azure
sample; chunked, Llama-3.1-8B (or --model) on H100-SXM, budget 2048) runs once and twice in a process under
callgrind, and the difference is printed: the instructions of one warm replay, without start-up
and the trace's reading. numpy's BLAS threads are held to one (their idle spinning under callgrind
makes counts drift) and hash randomisation is fixed. About a minute per tree for the sample.
Needs valgrind on the PATH.

With --whole, the whole command instead: `sim replay TRACE ... --quiet --out DIR` as a user runs
it (start-up, the trace's reading, the simulation, every file of the run folder), counted once.
Modules are compiled once beforehand (an uncounted run, their bytecode kept in a temporary
folder: PYTHONPYCACHEPREFIX), so the count is that of a run after installation, without the
compiling that PYTHONDONTWRITEBYTECODE would add to every run. About two minutes per tree for the
sample, half an hour for the Azure hour.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "traces" / "samples" / "azure_conv_2023_first5min.csv"
REPLAYS = """
import sys
from sim.app.replay import ReplayOptions, replay
from sim.app.plan import resolve
from sim.config import SchedulerConfig
from traces import read_trace

trace = read_trace(sys.argv[1])
clock = {}
if sys.argv[4] == "sync" and "async_scheduling" in SchedulerConfig.__dataclass_fields__:
    clock = dict(async_scheduling=False, host_time=False)  # the engine's clock of trees before issue 29
options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=2048, **clock),
                        model=sys.argv[3], hardware="H100-SXM")
for _ in range(int(sys.argv[2])):
    replay(trace, resolve(options))
"""


def counting_env(tree: Path, **extra: str) -> dict[str, str]:
    """The environment of a counted run of `tree`'s code: hash randomisation fixed, numpy's BLAS
    threads held to one (their idle spinning under callgrind makes counts drift)."""
    return dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                **extra)


def callgrind_count(command: list[str], cwd: Path, env: dict[str, str], who: str) -> int:
    """Instructions callgrind counts for `command`; exits naming `who` (the script) when it fails."""
    with tempfile.TemporaryDirectory(prefix="instructions_") as out:
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/callgrind.out", *command],
                              cwd=cwd, env=env, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or not found:
        sys.exit(f"{who}: the run under callgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1))


def instructions(tree: Path, trace: str, replays: int, model: str = "Llama-3.1-8B", clock: str = "default") -> int:
    """Instructions callgrind counts for the process that replays `trace` `replays` times (`clock`
    "sync": without asynchronous scheduling and host time, as trees before issue 29 step)."""
    return callgrind_count([sys.executable, "-c", REPLAYS, trace, str(replays), model, clock], tree,
                           counting_env(tree), "instructions")


def whole_command(tree: Path, trace: str, model: str = "Llama-3.1-8B", sync: bool = False) -> int:
    """Instructions callgrind counts for the whole `sim replay` of `trace` with the tree's code
    (`sync`: without asynchronous scheduling and host time, where the tree has them)."""
    with tempfile.TemporaryDirectory(prefix="instructions_") as temporary:
        env = counting_env(tree, PYTHONPYCACHEPREFIX=f"{temporary}/bytecode")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        command = [sys.executable, "-m", "sim.app.cli", "replay", trace, "--policy", "chunked", "--model",
                   model, "--hardware", "H100-SXM", "--max-num-batched-tokens", "2048", "--quiet",
                   "--overwrite", "--out", f"{temporary}/run"]
        if sync and "async_scheduling" in (tree / "sim" / "config.py").read_text():
            command += ["--no-async-scheduling", "--no-host-time"]
        compiled = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
        if compiled.returncode:
            sys.exit(f"instructions: sim replay failed ({compiled.returncode}):\n{compiled.stderr[-2000:]}")
        return callgrind_count(command, tree, env, "instructions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", default=str(SAMPLE))
    parser.add_argument("--tree", action="append", default=None, help="a servesim checkout (repeatable; default: this one)")
    parser.add_argument("--whole", action="store_true", help="count the whole `sim replay` command instead")
    parser.add_argument("--model", default="Llama-3.1-8B", help="the model replayed (default: Llama-3.1-8B)")
    parser.add_argument("--sync", action="store_true",
                        help="step without asynchronous scheduling and host time (the clock of trees before issue 29), "
                             "so an older tree and this one take the same steps")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("instructions: valgrind is not installed (it counts the instructions)")
    if not Path(args.trace).is_file():
        sys.exit(f"instructions: {args.trace}: no such file")
    trace = str(Path(args.trace).resolve())
    for tree in [Path(t).resolve() for t in (args.tree or [ROOT])]:
        if args.whole:
            count = whole_command(tree, trace, args.model, args.sync)
            print(f"{tree}: {count / 1e6:,.0f} M instructions for `sim replay {Path(trace).name}`", flush=True)
            continue
        clock = "sync" if args.sync else "default"
        one, two = (instructions(tree, trace, 1, args.model, clock), instructions(tree, trace, 2, args.model, clock))
        print(f"{tree}: {(two - one) / 1e6:,.0f} M instructions for one replay of {Path(trace).name}", flush=True)


if __name__ == "__main__":
    main()
