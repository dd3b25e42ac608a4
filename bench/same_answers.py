"""Same answers: run `sim replay` with two source trees on the same workloads and compare every
file of their run folders (a speed change must not change one byte).

    python bench/same_answers.py --before TREE [--after TREE] [--quick] [--only NAME ...] [--keep DIR]
                                 [--after-args FLAGS] [--allow-additions]

TREE is a checkout of servesim (for the tree before a change: `git worktree add --detach
../base HEAD`); --after defaults to this checkout. Each tree's code runs in its own process with
PYTHONPATH set to the tree, with this interpreter. Workloads: the Azure conversation hour under
chunked at 1x and 4x and under decode-first, Mooncake's synthetic trace (prefix caching), both
step by step (`--no-fast-forward`) on the bundled samples, and a two-replica cluster on the
bundled Azure sample (Llama-3.1-8B on H100-SXM); mixtures of experts priced from the operator
tables: the Azure hour on Qwen3-30B-A3B, and on the bundled sample Qwen3-30B-A3B, Qwen3-235B-A22B
(fp8, TP 4, DP 2, expert parallel, synchronous scheduling) and gpt-oss-120b (sliding windows, TP 2,
expert parallel), DeepSeek-V3 (MLA from its module tables, H200, TP 8; asynchronous and synchronous
scheduling) and Qwen3-30B-A3B (H200, DP 2, expert parallel); `--quick` keeps the sample runs only. Every file is compared byte for byte
but summary.json, compared as JSON with the tree's own path taken out of the profile's path, and
Parquet tables, compared by schema and content (row groups included: their encoding may differ).
Exit status 1 when a file differs, 2 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from replay_speed import AZURE as AZURE_NAME  # bench/ is this script's folder: on sys.path
from replay_speed import MOONCAKE as MOONCAKE_NAME
from replay_speed import shared_trace

ROOT = Path(__file__).resolve().parent.parent
AZURE = shared_trace(AZURE_NAME)  # None when ../shared/traces/raw/ is not beside the checkout
MOONCAKE = shared_trace(MOONCAKE_NAME)
AZURE_SAMPLE = Path("traces/samples/azure_conv_2023_first5min.csv")
MOONCAKE_SAMPLE = Path("traces/samples/mooncake_synthetic_last200.jsonl")
# The budget and --max-num-seqs pinned: the comparison is of the engine and the cost model, not of the
# defaults (an unset pair is vLLM's for the GPU since 2026-12-06: 8192 and 1024 on an H100).
COMMON = ["--model", "Llama-3.1-8B", "--hardware", "H100-SXM", "--max-num-batched-tokens", "2048",
          "--max-num-seqs", "256", "--quiet"]

FULL = {
    "azure-chunked-1x": [str(AZURE), "--policy", "chunked"],
    "azure-chunked-4x": [str(AZURE), "--policy", "chunked", "--rate-scale", "4"],
    "azure-decode-first": [str(AZURE), "--policy", "decode-first"],
    "mooncake-chunked": [str(MOONCAKE), "--policy", "chunked"],
    "azure-moe-chunked-1x": [str(AZURE), "--policy", "chunked", "--model", "Qwen3-30B-A3B"],
}
QUICK = {
    "sample-chunked-stepwise": [str(AZURE_SAMPLE), "--policy", "chunked", "--no-fast-forward", "--rate-scale", "3"],
    "sample-prefill-first": [str(AZURE_SAMPLE), "--policy", "prefill-first", "--rate-scale", "3"],
    "mooncake-sample-stepwise": [str(MOONCAKE_SAMPLE), "--policy", "chunked", "--no-fast-forward"],
    "sample-two-replicas": [str(AZURE_SAMPLE), "--policy", "chunked", "--replicas", "2", "--rate-scale", "4"],
    "sample-moe": [str(AZURE_SAMPLE), "--policy", "chunked", "--model", "Qwen3-30B-A3B", "--rate-scale", "3"],
    "sample-moe-tp4-dp2-ep-sync": [str(AZURE_SAMPLE), "--policy", "chunked", "--model", "Qwen3-235B-A22B",
                                   "--hardware", "H200", "--dtype", "fp8", "--tp", "4", "--dp", "2",
                                   "--enable-expert-parallel", "--no-async-scheduling", "--rate-scale", "3"],
    "sample-moe-sliding-tp2-ep": [str(AZURE_SAMPLE), "--policy", "chunked", "--model", "gpt-oss-120b", "--tp", "2",
                                  "--enable-expert-parallel", "--rate-scale", "2"],
    "sample-mla-tp8": [str(AZURE_SAMPLE), "--policy", "chunked", "--model", "DeepSeek-V3", "--hardware", "H200",
                       "--tp", "8", "--rate-scale", "3"],
    "sample-mla-tp8-sync": [str(AZURE_SAMPLE), "--policy", "chunked", "--model", "DeepSeek-V3", "--hardware", "H200",
                            "--tp", "8", "--no-async-scheduling", "--rate-scale", "3"],
    "sample-moe-dp2-ep": [str(AZURE_SAMPLE), "--policy", "chunked", "--model", "Qwen3-30B-A3B", "--hardware", "H200",
                          "--dp", "2", "--enable-expert-parallel", "--rate-scale", "3"],
}


def run(tree: Path, args: list[str], out: Path, extra: list[str] = ()) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "sim.app.cli", "replay", *COMMON, *args, *extra, "--out", str(out)]  # args win
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"same_answers: {' '.join(cmd)} (in {tree}) failed:\n{done.stderr}", file=sys.stderr)
        sys.exit(2)


def normalised_summary(path: Path, tree: Path) -> dict:
    summary = json.loads(path.read_text())
    text = json.dumps(summary).replace(str(tree.resolve()), "<tree>")
    return json.loads(text)


def only_keys_of(before, after):
    """`after` cut to `before`'s keys, recursively (--allow-additions: keys the change adds go)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return {k: only_keys_of(before[k], after[k]) for k in before if k in after}
    return after


def same_table_columns(a: Path, b: Path) -> bool:
    """A table equal to the before one in every column the before one has (--allow-additions)."""
    import pandas as pd

    if a.suffix == ".parquet":
        ta, tb = pd.read_parquet(a), pd.read_parquet(b)
    else:
        ta, tb = pd.read_csv(a, dtype=str, keep_default_na=False), pd.read_csv(b, dtype=str, keep_default_na=False)
    return set(ta.columns) <= set(tb.columns) and ta.equals(tb[list(ta.columns)])


def same_parquet(a: Path, b: Path) -> bool:
    import pyarrow.parquet as pq

    fa, fb = pq.ParquetFile(a), pq.ParquetFile(b)
    if fa.schema_arrow != fb.schema_arrow or fa.num_row_groups != fb.num_row_groups:
        return False
    return all(fa.read_row_group(i).equals(fb.read_row_group(i)) for i in range(fa.num_row_groups))


def compare(name: str, before: Path, after: Path, before_tree: Path, after_tree: Path,
            allow_additions: bool = False) -> list[str]:
    problems = []
    # (.servesim-files.json records when the files were written, not what they hold: sim/app/outputs.py)
    names = sorted(({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()}) - {".servesim-files.json"})
    for file in names:
        a, b = before / file, after / file
        if not a.exists() or not b.exists():
            problems.append(f"{name}: {file} only in {'after' if not a.exists() else 'before'}")
        elif file == "summary.json":
            sa, sb = normalised_summary(a, before_tree), normalised_summary(b, after_tree)
            if allow_additions:
                sb = only_keys_of(sa, sb)
            if sa != sb:
                keys = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
                problems.append(f"{name}: summary.json differs in {keys}")
        elif allow_additions and file.endswith((".parquet", ".csv")):
            if not same_table_columns(a, b):
                problems.append(f"{name}: {file} differs in the before tree's columns")
        elif allow_additions and file.endswith(".html"):
            continue  # the report draws the added figures too; its data are the tables compared here
        elif file.endswith(".parquet"):
            if not same_parquet(a, b):
                problems.append(f"{name}: {file} differs")
        elif a.read_bytes() != b.read_bytes():
            problems.append(f"{name}: {file} differs")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="the tree before the change")
    parser.add_argument("--after", default=ROOT, type=Path, help="the tree after it (default: this checkout)")
    parser.add_argument("--quick", action="store_true", help="the bundled samples only")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--after-args", default="", metavar="'FLAGS'",
                        help="flags for the after tree's runs only (e.g. '--no-async-scheduling --no-host-time' "
                             "to ask for the before tree's engine clock)")
    parser.add_argument("--allow-additions", action="store_true",
                        help="compare tables and summary.json in the before tree's columns and keys only (the "
                             "change adds some) and skip report.html; every value the before tree has must match")
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="only this workload (repeatable), e.g. the dense ones against a tree without MoE flags")
    args = parser.parse_args()
    extra = args.after_args.split()
    workloads = dict(QUICK)
    if not args.quick:
        if AZURE is None or MOONCAKE is None:
            sys.exit("same_answers: the shared traces are not in ../shared/traces/raw/ beside the checkout; "
                     "run with --quick")
        workloads.update(FULL)
    if args.only:
        unknown = set(args.only) - set(workloads)
        if unknown:
            sys.exit(f"same_answers: no workload {', '.join(sorted(unknown))}; there are {', '.join(workloads)}")
        workloads = {name: w for name, w in workloads.items() if name in args.only}
    with tempfile.TemporaryDirectory(prefix="same_answers_") as temp:
        base = args.keep or Path(temp)
        problems = []
        for name, workload in workloads.items():
            folders = []
            for label, tree in (("before", args.before), ("after", args.after)):
                out = base / label / name
                run(tree.resolve(), workload, out, extra if label == "after" else [])
                folders.append(out)
            found = compare(name, *folders, args.before, args.after, args.allow_additions)
            print(f"{name}: {'same' if not found else 'DIFFERENT'}", flush=True)
            problems += found
    for problem in problems:
        print(problem)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
