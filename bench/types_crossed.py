"""The servesim types one request crosses from a trace row to summary.json: a one-request trace is
replayed (`sim replay ... --out DIR`, chunked, Llama-3.1-8B on H100-SXM) with a profiler hook that
records the class of every servesim object whose methods run (methods, properties, dataclass
constructors: an object made or used on the way, not a class consulted for its name), and the
classes are listed by module. Issue 31 counts them before and after the
core's rewrite (nano-vllm's path crosses about 5).

    python bench/types_crossed.py [--tree DIR ...]

Each tree runs in its own process with its own code (PYTHONPATH); the count excludes the CLI's
argument parsing and report-writing helpers that are plain functions (they have no class).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sim", "policies", "backends", "traces", "reports")
PROBE = r"""
import sys, os
from pathlib import Path
root = Path(sys.argv[1]).resolve()
packages = tuple(str(root / p) + os.sep for p in sys.argv[4].split(","))
seen = {}
def hook(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    if not code.co_filename.startswith(packages):
        return
    first = frame.f_locals.get("self") if code.co_argcount and code.co_varnames[0] == "self" else None
    if first is None:
        return
    cls = type(first)
    module = getattr(cls, "__module__", "")
    if module.split(".")[0] in sys.argv[4].split(","):
        seen.setdefault(f"{module}.{cls.__qualname__}", 0)
        seen[f"{module}.{cls.__qualname__}"] += 1
from sim.app.cli import main
sys.setprofile(hook)
try:
    main(["replay", sys.argv[2], "--policy", "chunked", "--model", "Llama-3.1-8B", "--hardware", "H100-SXM",
          "--quiet", "--overwrite", "--out", sys.argv[3]])
finally:
    sys.setprofile(None)
for name in sorted(seen):
    print(name)
"""


def crossed(tree: Path, trace: Path, out: Path) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", PROBE, str(tree), str(trace), str(out), ",".join(PACKAGES)],
                          cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"types_crossed: the replay in {tree} failed:\n{done.stderr[-2000:]}")
    return [line for line in done.stdout.splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=None, help="a servesim checkout (repeatable; default: this one)")
    parser.add_argument("--list", action="store_true", help="print each type, not only the count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="types_crossed_") as temporary:
        trace = Path(temporary) / "one.csv"
        trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
        for tree in [Path(t).resolve() for t in (args.tree or [ROOT])]:
            names = crossed(tree, trace, Path(temporary) / f"run_{tree.name}")
            print(f"{tree}: {len(names)} servesim types crossed by one request (trace row to summary.json)")
            if args.list:
                for name in names:
                    print(f"  {name}")


if __name__ == "__main__":
    main()
