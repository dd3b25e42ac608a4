"""What compiling the engine's hot path would give: the same Python source compiled to C by mypyc,
its answers compared byte for byte with the interpreted tree's and both timed side by side.

    python bench/compiled_probe.py [--trace FILE] [--mooncake FILE] [--repeat N] [--keep DIR]

The modules compiled are those that CI type-checks (pyproject.toml [tool.mypy] `files`: the
engine, fast-forward, requests, the step log, the block manager, the workloads, the batch, the
policies and the operator-table cost model). The tree's files are copied to a scratch folder (or
--keep DIR), three constructs that mypyc cannot compile as they are get a compile-only edit there
(COMPILE_EDITS: a list subclass kept a Python class, a class hook that sets attributes on
subclasses, a runtime-checkable protocol), and mypyc builds them in place. Then:

1. the answers: `sim replay TRACE --policy chunked` by each tree on both traces, every file of the
   run folders compared as `bench/same_answers.py` compares them (its own functions);
2. the speed: each tree's own `bench/replay_speed.py` on the Azure hour (chunked, 1x) and the
   Mooncake trace, the trees alternated --repeat times; its JSON lines give the simulation alone
   (sim_s) and the whole command (e2e_s) with the reference loop (ref_s) beside them.

Needs mypy (pip install -e '.[lint]') and a C compiler. This is a measurement, not a build of
servesim: nothing is installed, and the scratch folder is removed unless --keep is given. The
compiled modules are stricter than the interpreted ones (mypyc checks declared types at run time,
and its classes cannot be patched), so a compiled build would be a second configuration to test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from replay_speed import AZURE, MOONCAKE, shared_trace  # noqa: E402
from same_answers import compare  # noqa: E402
from same_answers import run as replay_to  # noqa: E402

# (file, text, replacement): what mypyc cannot compile as written, changed in the scratch copy only.
COMPILE_EDITS = [
    # A subclass of list cannot be a native (compiled) class: keep it a Python class.
    ("sim/block_manager.py", "class CachedPrefix(list):",
     "from mypy_extensions import mypyc_attr\n\n\n@mypyc_attr(native_class=False)\nclass CachedPrefix(list):"),
    # A native class's attributes cannot be set on the class after it is made: the hook that
    # makes the promises of a policy declaring the old flags goes (the built-in policies state
    # `promises` in their class bodies).
    ("policies/base.py",
     "            cls.promises = Promises(**{f.name: legacy.get(f.name, getattr(inherited, f.name)) for f in fields(Promises)})\n",
     "            del inherited\n"),
    # A runtime-checkable Protocol compiled by mypyc is no longer a protocol class to `isinstance`.
    ("sim/batch.py", "@runtime_checkable\nclass TokenSource", "class TokenSource"),
    ("sim/batch.py", "isinstance(src, TokenSource)", "callable(getattr(src, \"token_ids\", None))"),
]
SKIP = {".git", ".venv", ".venv-parity", "build", "__pycache__", ".pytest_cache", ".hypothesis"}


def copy_tree(dest: Path) -> None:
    for item in ROOT.iterdir():
        if item.name in SKIP:
            continue
        target = dest / item.name
        if item.is_dir():
            shutil.copytree(item, target, ignore=shutil.ignore_patterns(*SKIP, "*.so"))
        else:
            shutil.copy2(item, target)


def apply_edits(tree: Path) -> None:
    for name, old, new in COMPILE_EDITS:
        path = tree / name
        text = path.read_text()
        if old not in text:
            sys.exit(f"compiled_probe: {name} no longer has the text this probe edits for mypyc: {old.splitlines()[0]!r}; "
                     "update COMPILE_EDITS")
        path.write_text(text.replace(old, new, 1))


def compile_tree(tree: Path) -> list[str]:
    modules = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    mypyc = Path(sys.executable).parent / "mypyc"
    if not mypyc.exists():
        sys.exit("compiled_probe: mypyc not found beside this Python; install it with pip install -e '.[lint]'")
    done = subprocess.run([str(mypyc), "--ignore-missing-imports", "--follow-imports=silent", *modules], cwd=tree,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"compiled_probe: mypyc failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return modules


def speed(tree: Path, azure: str, mooncake: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, str(tree / "bench" / "replay_speed.py"), "--trace", azure, "--mooncake",
                           mooncake, "--only", "chunked:1", "--only", "mooncake"], env=env, cwd=tree,
                          capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=None, help=f"the Azure trace (default: ../shared/traces/raw/{AZURE})")
    parser.add_argument("--mooncake", default=None, help=f"the Mooncake trace (default: ../shared/traces/raw/{MOONCAKE})")
    parser.add_argument("--repeat", type=int, default=3, help="alternated rounds; the best of each is shown")
    parser.add_argument("--keep", default=None, help="build the compiled tree here and keep it")
    args = parser.parse_args()
    azure = args.trace or shared_trace(AZURE)
    mooncake = args.mooncake or shared_trace(MOONCAKE)
    for given, path, name, option in ((args.trace, azure, AZURE, "--trace"), (args.mooncake, mooncake, MOONCAKE, "--mooncake")):
        if path is None or not Path(path).is_file():
            where = (f"{option} {given}: no such file" if given
                     else f"{name} not found in ../shared/traces/raw/ beside the repository; give it with {option}")
            print(f"compiled_probe: error: {where}", file=sys.stderr)
            sys.exit(2)
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="servesim-compiled-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        tree = scratch / "tree"
        if tree.exists():
            shutil.rmtree(tree)
        copy_tree(tree)
        apply_edits(tree)
        modules = compile_tree(tree)
        print(f"compiled {len(modules)} modules with mypyc in {tree}")
        differ = []
        for name, trace in (("azure-chunked-1x", azure), ("mooncake-chunked", mooncake)):
            folders = [scratch / "answers" / label / name for label in ("interpreted", "compiled")]
            for folder, root in zip(folders, (ROOT, tree)):
                shutil.rmtree(folder, ignore_errors=True)
                replay_to(root, [str(trace), "--policy", "chunked"], folder)
            found = compare(name, *folders, ROOT, tree)
            print(f"answers, {name}: {'same' if not found else 'DIFFERENT'}", flush=True)
            differ += found
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.repeat):
            for name, root in (("interpreted", ROOT), ("compiled", tree)):
                for row in speed(root, str(azure), str(mooncake)):
                    key = (name, row["config"])
                    if key not in best or row["e2e_s"] < best[key]["e2e_s"]:
                        best[key] = row
        print(f"best of {args.repeat}, the trees alternated")
        print(f"{'tree':<12} {'config':<10} {'sim s':>7} {'e2e s':>7} {'ref s':>6}")
        for (name, config), row in sorted(best.items(), key=lambda item: (item[0][1], item[0][0] != "interpreted")):
            print(f"{name:<12} {config:<10} {row['sim_s']:7.3f} {row['e2e_s']:7.3f} {row['ref_s']:6.3f}")
        for config in sorted({config for _, config in best}):
            a, b = best[("interpreted", config)], best[("compiled", config)]
            print(f"{config}: compiled/interpreted sim {b['sim_s'] / a['sim_s']:.2f}, e2e {b['e2e_s'] / a['e2e_s']:.2f}")
        if differ:
            print("\n".join(differ), file=sys.stderr)
            sys.exit(1)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
