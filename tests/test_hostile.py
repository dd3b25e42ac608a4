"""Issue 32's hostile cases: user code that breaks the engine's rules, raises, loops or returns
garbage; outputs aimed at the command's own inputs, at files, at read-only folders; overwrites
killed mid-write or stopped by a full disk (RLIMIT_FSIZE in a child process, SIGXFSZ ignored);
headline numbers that must equal the files; searches and connections that must not hang.
Each asserts exit 2 with a message naming the value, and that nothing was lost."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from policies import load_policy
from policies.checked import batch_violation
from policies.chunked import ChunkedPolicy
from policies.routers import load_router
from sim.app.cli import main
from sim.batch import Batch
from sim.block_manager import BlockManager
from sim.config import SchedulerConfig
from sim.errors import ServesimError
from sim.request import Request, Status
from sim.state import EngineState
from traces import AZURE_CONV_SAMPLE

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "data" / "hostile" / "policies.py"
SMALL = [str(AZURE_CONV_SAMPLE), "--limit", "40"]


def sim(*args) -> int:
    return main([str(a) for a in args])


def error_text(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("sim: error: "), err
    return err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "servesim.lock"}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".servesim-new-" in p.name)


def child(args: list, fsize: int | None = None, **kwargs) -> subprocess.Popen:
    """`sim ARGS` in a child process; with `fsize`, no file it writes may grow past that many bytes
    (a full disk: write(2) fails with EFBIG, SIGXFSZ ignored)."""
    def limit():
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "sim.app.cli", *map(str, args)], env=env, preexec_fn=limit,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


# The checker, on worked examples.

def tiny_state(num_blocks: int = 8, block_size: int = 4):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    state = EngineState(bm)
    config = SchedulerConfig("chunked", 12, 3)  # two prompts of 6 tokens fill the budget
    policy = ChunkedPolicy(config)
    requests = [Request(i, str(i), 0.0, 6, 3) for i in range(4)]
    for r in requests:
        state.waiting.append(r)
    return state, config, policy, requests


def test_a_batch_of_the_built_in_policy_keeps_every_rule():
    state, config, policy, _ = tiny_state()
    batch = policy.schedule(state, 0.0)
    assert [r.request_id for r in batch.requests] == ["0", "1"] and batch.num_scheduled_tokens == [6, 6]
    assert batch_violation(batch, state, config) is None


def test_each_broken_rule_is_named():
    cases = {
        "zero tokens": (lambda b, s, rs: b.num_scheduled_tokens.__setitem__(0, 0), "scheduled 0 tokens"),
        "negative": (lambda b, s, rs: b.num_scheduled_tokens.__setitem__(0, -3), "scheduled -3 tokens"),
        "float": (lambda b, s, rs: b.num_scheduled_tokens.__setitem__(0, 2.5), "scheduled 2.5 tokens"),
        "twice": (lambda b, s, rs: b.add_request(b.requests[0], 6, 1, False, False), "request 0 is in the batch twice"),
        "waiting": (lambda b, s, rs: b.add_request(rs[2], 0, 2, False, False), "request 2 is scheduled but is waiting"),
        "finished": (lambda b, s, rs: setattr(rs[0], "status", Status.FINISHED), "request 0 is scheduled but is finished"),
        "past its tokens": (lambda b, s, rs: b.num_scheduled_tokens.__setitem__(1, 7), "past its 6 known tokens"),
        "missing block": (lambda b, s, rs: rs[0].block_table.pop(), "too few for its 6 tokens"),
        "no such block": (lambda b, s, rs: rs[0].block_table.__setitem__(0, 99), "KV block 99, which does not exist"),
        "over max seqs": (lambda b, s, rs: s.running.extend(rs[2:]), "4 requests running, more than --max-num-seqs 3"),
        "over max seqs in a step": (lambda b, s, rs: [b.add_request(r, 0, 1, False, False) for r in rs[1:]],
                                    "5 requests in one step, more than --max-num-seqs 3"),
        "columns": (lambda b, s, rs: b.is_decode.append(False), "columns have different lengths"),
        # (a hand-made request, not one of the queues': it said "is none")
        "unknown": (lambda b, s, rs: setattr(rs[0], "status", None),
                    "request 0 is scheduled but is not a request of the engine's queues"),
        # (blocks a policy appended to a request's table unbeknown to the pool: in use went below 0)
        "negative blocks in use": (lambda b, s, rs: setattr(s.block_manager, "__class__", type(
            "Leaky", (type(s.block_manager),), {"num_used_blocks": property(lambda self: -1)})), "-1 KV blocks in use"),
    }
    for name, (breaks, words) in cases.items():
        state, config, policy, requests = tiny_state()
        batch = policy.schedule(state, 0.0)
        if name == "waiting":
            requests[2].status = Status.WAITING
        breaks(batch, state, requests)
        problem = batch_violation(batch, state, config)
        assert problem is not None and words in problem, (name, problem)
    state, config, policy, _ = tiny_state()
    assert "must return a sim.batch.Batch, it returned NoneType" in batch_violation(None, state, config)
    assert batch_violation(Batch(), state, config) is None  # nothing running: an empty batch is allowed


def test_over_the_budget_and_over_the_cache():
    state, config, policy, requests = tiny_state(num_blocks=64)
    config = SchedulerConfig("chunked", 8, 2)
    batch = policy.schedule(state, 0.0)  # 12 tokens, the budget of tiny_state
    assert "12 tokens in one step, more than the token budget --max-num-batched-tokens 8" in batch_violation(
        batch, state, config)
    state, config, policy, requests = tiny_state(num_blocks=4)
    batch = policy.schedule(state, 0.0)
    state.block_manager.append(requests[0], 40)  # blocks nobody checked were free
    assert "KV blocks in use of the 4 that exist" in batch_violation(batch, state, config)


# User code through the command line.

@pytest.mark.parametrize("policy, words", [
    ("OverBudget", "more than the token budget --max-num-batched-tokens 512"),
    ("ZeroTokens", "request 0 is scheduled 0 tokens"),
    ("Twice", "request 0 is in the batch twice"),
    ("StealsBlocks", "KV blocks in use of the"),
    ("ReturnsNone", "schedule must return a sim.batch.Batch, it returned NoneType"),
    ("RetriesNow", "after an empty batch, retry_s answered 0; it must be None (wait for the next arrival) or a "
                   "time later than now (0)"),
    ("ShortensOutputs", "request 0's max_tokens from 44 to 2: what the trace gave a request is not the policy's to "
                        "change"),
    ("MovesArrivals", "'s arrival_s from "),
    ("DropsWaiting", "left the waiting queue and the running list without finishing; only the engine finishes a "
                     "request"),
    ("ResizesBlocks", "the KV cache changed from "),
])
def test_a_policy_breaking_a_rule_stops_the_run_naming_policy_step_and_rule(tmp_path, capsys, policy, words):
    out = tmp_path / "run"
    assert sim("replay", *SMALL, "--rate-scale", 20, "--policy", f"{HOSTILE}:{policy}", "--max-num-seqs", 8,
               "--max-num-batched-tokens", 512, "--out", out, "--quiet") == 2
    err = error_text(capsys)
    assert re.match(rf"sim: error: your policy {policy} \({re.escape(str(HOSTILE))}:{policy}\) broke a rule of the "
                    r"engine at step \d+ \(t=[0-9.]+ s\): ", err), err
    assert words in err
    assert not out.exists()  # a part of a run is no run


def test_a_policy_that_raises_is_the_users_error_with_file_line_and_traceback(tmp_path, capsys):
    assert sim("replay", *SMALL, "--policy", f"{HOSTILE}:Raises", "--out", tmp_path / "run", "--quiet") == 2
    err = error_text(capsys)
    line = next(i for i, text in enumerate(HOSTILE.read_text().splitlines(), 1) if "1 / 0" in text)
    assert err.startswith(f"sim: error: error in your policy {HOSTILE}:{line} (Raises.schedule at step 3): "
                          "ZeroDivisionError: division by zero\nTraceback of your policy"), err
    assert f'File "{HOSTILE}", line {line}, in schedule' in err
    assert "internal error" not in err


def test_a_policy_that_loops_is_stopped_by_the_policy_timeout(tmp_path, capsys):
    started = time.monotonic()
    assert sim("replay", *SMALL, "--policy", f"{HOSTILE}:Loops", "--policy-timeout", 0.5, "--out", tmp_path / "r",
               "--quiet") == 2
    assert time.monotonic() - started < 10
    assert error_text(capsys) == (f"sim: error: your policy Loops ({HOSTILE}:Loops): schedule did not return within "
                                  "--policy-timeout 0.5 s at step 0; stopped\n")


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e300", "x"])
def test_a_bad_policy_timeout_is_refused(capsys, value):
    try:
        code = sim("replay", *SMALL, "--policy-timeout", value)
    except SystemExit as stop:  # argparse's own refusal (text that is no number)
        code = stop.code
    assert code == 2
    assert "--policy-timeout" in capsys.readouterr().err


def test_a_router_answering_a_negative_index_or_raising_stops_the_run(tmp_path, capsys):
    args = ["replay", *SMALL, "--replicas", 3, "--out", tmp_path / "run", "--quiet"]
    assert sim(*args, "--router", f"{HOSTILE}:NegativeRouter") == 2
    assert error_text(capsys).startswith(
        f"sim: error: your router NegativeRouter ({HOSTILE}:NegativeRouter) answered -1 for request 0; route must "
        "return the index of a replica it was shown, a whole number from 0 to 2")
    assert sim(*args, "--router", f"{HOSTILE}:RaisingRouter") == 2
    err = error_text(capsys)
    assert re.match(rf"sim: error: error in your router {re.escape(str(HOSTILE))}:\d+ \(RaisingRouter.route\): "
                    r"KeyError: 'no such replica'", err), err


def test_user_classes_are_checked_and_keep_their_promises_built_ins_are_not_wrapped():
    from policies import POLICIES
    from policies.base import Promises
    from policies.routers import ROUTERS

    assert all(load_policy(name) is cls for name, cls in POLICIES.items())
    assert all(load_router(name) is cls for name, cls in ROUTERS.items())
    cls = load_policy(f"{HOSTILE}:OverBudget")
    assert cls.checked_class.__name__ == "OverBudget" and issubclass(cls, cls.checked_class)
    # OverBudget overrides schedule and states that it promises nothing: wrapped, it still does not.
    assert cls.promises == Promises() == cls.checked_class.promises
    promising = load_policy(f"{ROOT / 'tests' / 'data' / 'policies' / 'slow.py'}:SlowChunked")
    assert promising.promises == promising.checked_class.promises and promising.name == "slow-chunked"


def test_a_checked_user_policy_gives_the_answers_of_the_unwrapped_class(tmp_path):
    """The wrapper changes nothing of a valid policy's run: a user file subclassing chunked and
    declaring its promises replays byte for byte as the built-in chunked."""
    user = tmp_path / "mine.py"
    user.write_text("from policies.chunked import ChunkedPolicy\n\n\nclass Mine(ChunkedPolicy):\n"
                    "    supports_fast_forward = True\n    decodes_all_when_none_waits = True\n"
                    "    repeats_full_chunk_steps = True\n\n"
                    "    def schedule(self, state, now):\n        return super().schedule(state, now)\n")
    for name, policy in (("a", "chunked"), ("b", f"{user}:Mine")):
        assert sim("replay", *SMALL, "--policy", policy, "--out", tmp_path / name, "--quiet", "--steps", "csv") == 0
    for table in ("requests.csv", "steps.csv"):
        assert (tmp_path / "a" / table).read_bytes() == (tmp_path / "b" / table).read_bytes()


# Outputs: never over an input, never a lost run.

def test_replay_out_on_the_folder_of_its_own_input_is_refused_whatever_the_flags(tmp_path, capsys):
    folder = tmp_path / "D"
    assert sim("replay", *SMALL, "--out", folder, "--quiet") == 0
    trace = folder / "requests.csv"
    before = snapshot(folder)
    for flags in ([], ["--overwrite"]):
        assert sim("replay", trace, "--out", folder, *flags, "--quiet") == 2
        assert error_text(capsys).startswith(f"sim: error: {folder}: holds the input {trace}; this command writes "
                                             "the folder as a whole")
        assert snapshot(folder) == before
    # Another spelling of the same folder, a hardware file inside it: refused too.
    other = tmp_path / "D" / ".." / "D"
    assert sim("replay", trace, "--out", other, "--overwrite", "--quiet") == 2
    capsys.readouterr()
    hardware = folder / "gpu.json"
    hardware.write_text('{"peak_bf16_flops": 1e15, "peak_fp8_flops": null, "memory_bandwidth": 3e12, '
                        '"memory_bytes": 85000000000, "nvlink_bandwidth": null}')
    assert sim("replay", *SMALL, "--hardware", hardware, "--out", folder, "--overwrite", "--quiet") == 2
    assert "holds the input" in error_text(capsys)
    assert hardware.exists()


def test_trace_and_profile_outputs_over_their_inputs_are_refused(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_bytes(Path(AZURE_CONV_SAMPLE).read_bytes())
    link = tmp_path / "link.csv"
    link.symlink_to(trace)
    for out in (trace, link, tmp_path / "." / "t.csv"):
        assert sim("trace", "convert", trace, out) == 2
        assert "writing it would destroy it" in error_text(capsys)
    assert trace.read_bytes() == Path(AZURE_CONV_SAMPLE).read_bytes()
    assert sim("trace", "synth", "--num-requests", 5, "--lengths-from", trace, trace) == 2
    assert "writing it would destroy it" in error_text(capsys)


@pytest.mark.parametrize("name", ["out.jsonl", "out.json", "out.jsonl.gz", "out.parquet"])
def test_trace_writers_refuse_a_name_of_another_format(tmp_path, capsys, name):
    assert sim("trace", "convert", AZURE_CONV_SAMPLE, tmp_path / name) == 2
    assert "sim trace writes canonical CSV" in error_text(capsys)
    assert sim("trace", "synth", "--num-requests", 5, tmp_path / name) == 2
    assert "sim trace writes canonical CSV" in error_text(capsys)
    assert not list(tmp_path.iterdir())


def test_written_traces_read_back(tmp_path):
    for name in ("a.csv", "a.csv.gz"):
        assert sim("trace", "synth", "--num-requests", 5, tmp_path / name) == 0
        assert sim("replay", tmp_path / name, "--out", tmp_path / f"run-{name}", "--quiet") == 0


def test_out_on_a_file_is_refused(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("mine")
    for command in (["replay", *SMALL], ["bench", "--concurrency", 1, "--input-len", 8, "--output-len", 2,
                                         "--num-prompts", 2]):
        assert sim(*command, "--out", a_file, "--overwrite", "--quiet") == 2
        assert error_text(capsys) == f"sim: error: {a_file}: is a file, not a folder\n"
    assert a_file.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_on_a_read_only_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "ro"
    assert sim("replay", *SMALL, "--out", folder, "--quiet") == 0
    before = snapshot(folder)
    folder.chmod(0o555)
    try:
        assert sim("replay", *SMALL, "--out", folder, "--overwrite", "--quiet") == 2
        assert "cannot write there" in error_text(capsys)
        assert snapshot(folder) == before
    finally:
        folder.chmod(0o755)


def test_an_overwrite_replaces_the_folder_whole_and_a_failed_one_keeps_the_old(tmp_path, capsys):
    folder = tmp_path / "run"
    assert sim("replay", *SMALL, "--steps", "csv", "--out", folder, "--quiet") == 0
    before = snapshot(folder)
    # A run that fails midway (the user's policy raises at step 3): the old folder is untouched.
    assert sim("replay", *SMALL, "--policy", f"{HOSTILE}:Raises", "--out", folder, "--overwrite", "--quiet") == 2
    assert "error in your policy" in error_text(capsys)
    assert snapshot(folder) == before and not leftovers(tmp_path)
    # A run that succeeds replaces the folder as a whole: nothing of the old run is left beside the new.
    assert sim("replay", *SMALL, "--policy", "decode-first", "--out", folder, "--overwrite", "--quiet") == 0
    after = snapshot(folder)
    assert "steps.csv" not in after and after.keys() == before.keys() - {"steps.csv"} | {"steps.parquet"}
    assert after["summary.json"] != before["summary.json"] and not leftovers(tmp_path)


def test_an_overwrite_never_deletes_what_servesim_did_not_write(tmp_path, capsys, monkeypatch):
    """--overwrite replaces a folder whole, so a folder holding anything but a run's files is refused,
    naming it, and left as it was: `--out . --overwrite` in a project deleted the project before."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "model.py").write_text("weights = 1\n")
    (project / "notes.md").write_text("my notes\n")
    def tree():
        return {str(p.relative_to(project)): p.read_bytes() if p.is_file() else None for p in project.rglob("*")}

    before = tree()
    monkeypatch.chdir(project)
    for flags in ((), ("--overwrite",)):
        assert sim("replay", *SMALL, "--out", ".", *flags, "--quiet") == 2
        said = error_text(capsys)
        assert "holds notes.md, src, which no servesim command writes" in said and "choose another --out" in said
        assert tree() == before
    # A note saved in a run folder is kept too; once moved out, the run is replaced.
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    (run / "my-note.txt").write_text("keep me")
    assert sim("replay", *SMALL, "--out", run, "--overwrite", "--quiet") == 2
    assert "holds my-note.txt, which no servesim command writes" in error_text(capsys)
    assert (run / "my-note.txt").read_text() == "keep me"
    (run / "my-note.txt").unlink()
    (run / ".DS_Store").write_bytes(b"Finder's view of the folder")  # a file browser's: no one's data
    assert sim("replay", *SMALL, "--out", run, "--overwrite", "--quiet") == 0
    assert not (run / ".DS_Store").exists()
    # A comparison's run folders are servesim's as it recorded them: a file put in one by hand is not.
    (run / "measured").mkdir()
    (run / "measured" / "summary.json").write_text("{}")
    assert sim("replay", *SMALL, "--out", run, "--overwrite", "--quiet") == 2
    assert "holds measured/summary.json, which servesim did not record writing" in error_text(capsys)
    assert (run / "measured" / "summary.json").read_text() == "{}"
    (run / "measured" / "summary.json").unlink()
    (run / "predicted").mkdir()
    (run / "predicted" / "data.bin").write_bytes(b"x")
    assert sim("replay", *SMALL, "--out", run, "--overwrite", "--quiet") == 2
    assert "holds predicted/data.bin" in error_text(capsys)


def test_a_full_disk_during_an_overwrite_keeps_the_old_run(tmp_path):
    folder = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", folder, "--quiet") == 0
    before = snapshot(folder)
    run = child(["replay", *SMALL, "--policy", "decode-first", "--out", folder, "--overwrite", "--quiet"],
                fsize=64 * 1024)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2, err
    assert err.startswith("sim: error: ") and "File too large" in err and f"{folder}/" in err, err
    assert ".servesim-new-" not in err
    assert snapshot(folder) == before and not leftovers(tmp_path)


def test_a_file_output_never_replaces_an_existing_file_without_overwrite(tmp_path, capsys):
    """sim trace convert, sim trace synth and sim calibrate --from-ops wrote over any file of the
    name given; an existing file is now replaced only with --overwrite."""
    from tests.helpers import shared_dir

    kept = "my own data\n"
    cases = {
        "t.csv": ("trace", "convert", *SMALL[:1], "--limit", "5"),
        "s.csv": ("trace", "synth", "--num-requests", "5"),
    }
    tables = shared_dir() / "gpu-data" / "aiconfigurator"
    if list(tables.glob("h100_sxm*gemm_perf*")):  # the shared tables, where this checkout has them
        cases["p.json"] = ("calibrate", "--from-ops", str(tables), "--system", "h100_sxm", "--model", "Llama-3.1-8B",
                           "--hardware", "H100-SXM", "--tp", "1", "--quiet", "--out")
    for name, command in cases.items():
        out = tmp_path / name
        out.write_text(kept)
        assert sim(*command, out) == 2
        assert error_text(capsys).strip().endswith(f"{out}: exists; pass --overwrite to replace it, or choose another name")
        assert out.read_text() == kept
        assert sim(*command, out, "--overwrite") == 0
        assert out.read_text() != kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)


def test_an_output_named_by_nothing_is_refused(tmp_path, capsys, monkeypatch):
    """--out "" would be the current folder and --out " " a folder named by a space: both refused."""
    monkeypatch.chdir(tmp_path)
    for name in ("", " ", "\t"):
        assert sim("replay", *SMALL, "--out", name, "--quiet") == 2
        assert error_text(capsys).strip() == f"sim: error: {name!r}: an empty name; name the folder to write"
        assert sim("trace", "convert", SMALL[0], name) == 2
        assert error_text(capsys).strip() == f"sim: error: {name!r}: an empty name; name the file to write"
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_a_trace_keeps_the_old_file(tmp_path):
    out = tmp_path / "t.csv"
    out.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,1\n")
    run = child(["trace", "synth", "--num-requests", 20000, out, "--overwrite"], fsize=16 * 1024)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2 and "File too large" in err, err
    assert out.read_text() == "arrival_s,prompt_tokens,output_tokens\n0,1,1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]


@pytest.mark.slow
def test_a_sweep_overwrite_killed_after_a_point_leaves_the_old_sweep_whole(tmp_path):
    from sim.app.report import missing_points

    folder = tmp_path / "S"
    grid = ["--policy", "chunked,decode-first", "--jobs", 1, "--quiet"]
    assert sim("sweep", *SMALL, *grid, "--out", folder) == 0
    before = snapshot(folder)
    slow = f"{ROOT / 'tests' / 'data' / 'policies' / 'slow.py'}:SlowChunked"
    run = child(["sweep", str(AZURE_CONV_SAMPLE), "--limit", 300, "--policy", f"chunked,{slow}", "--jobs", 1,
                 "--quiet", "--out", folder, "--overwrite"])
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".S.servesim-new-*/results.parquet")):
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.05)
    run.kill()
    run.wait()
    assert snapshot(folder) == before  # the old sweep, whole: its table and its report
    assert missing_points(folder) == []
    # The next overwrite clears what the killed one left beside it.
    assert sim("sweep", *SMALL, "--policy", "chunked", "--jobs", 1, "--quiet", "--out", folder, "--overwrite") == 0
    assert not leftovers(tmp_path)


@pytest.mark.slow
def test_sigterm_ends_a_command_within_two_seconds(tmp_path):
    slow = f"{ROOT / 'tests' / 'data' / 'policies' / 'slow.py'}:SlowChunked"
    for args in (["replay", AZURE_CONV_SAMPLE, "--policy", slow, "--out", tmp_path / "a", "--quiet"],
                 ["replay", AZURE_CONV_SAMPLE, "--policy", f"{HOSTILE}:Loops", "--out", tmp_path / "b", "--quiet"],
                 ["sweep", AZURE_CONV_SAMPLE, "--policy", f"chunked,{slow}", "--jobs", 2, "--out", tmp_path / "c",
                  "--quiet"]):
        run = child(args)
        time.sleep(3)
        assert run.poll() is None
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=10)
        assert time.monotonic() - started < 2, args
        assert run.returncode == 143, args


# Headline numbers.

def test_the_capacity_table_on_the_terminal_equals_capacity_csv(tmp_path, capsys):
    out = tmp_path / "c"
    assert sim("capacity", *SMALL, "--slo", "tbt=0.05,ttft=2", "--max-rate-scale", 8, "--policy",
               "chunked,decode-first", "--jobs", 1, "--out", out) == 0
    printed = capsys.readouterr().out.splitlines()
    capacity = pd.read_csv(out / "capacity.csv")
    head = printed[1].split()
    unit = head[head.index("tbt") + 1]
    per_second = {"ms": 1e3, "s": 1.0}[unit]
    for line, (_, row) in zip(printed[2:], capacity.iterrows()):
        cells = line.split()
        assert cells[0] == row["policy"]
        assert float(cells[1]) == pytest.approx(row["capacity_rate_scale"], rel=1e-2)
        for i, key in ((3, "tbt_at_capacity"), (4, "ttft_at_capacity"), (5, "delay_at_capacity")):
            assert float(cells[i]) == pytest.approx(row[key] * per_second, rel=1e-3), (key, line)


def test_format_capacity_shows_seconds_times_a_thousand_whatever_the_rate_scale():
    from sim.app.capacity import CapacitySLO
    from sim.app.capacity_cli import format_capacity

    frame = pd.DataFrame([{"policy": "chunked", "capacity_rate_scale": 4.0, "capacity_request_rate": 12.5,
                           "tbt_at_capacity": 0.030, "delay_at_capacity": 0.5, "num_probes": 5, "status": "ok"}])
    text = format_capacity(frame, ["policy"], CapacitySLO(tbt=0.1))
    assert text.splitlines()[2].split() == ["chunked", "4", "12.50", "30", "500", "5", "ok"]


def test_a_capacity_search_on_a_trace_too_short_to_queue_stops_saying_so(tmp_path, capsys):
    # Five requests within 0.4 s: at a rate scale of 4e5 (under --max-rate-scale's bound of 1e6) they
    # arrive within a microsecond, as one burst, and still meet the SLO.
    trace = tmp_path / "short.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{0.1 * i:.1f},300,20\n" for i in range(5)))
    started = time.monotonic()
    assert sim("capacity", trace, "--slo", "tbt=1", "--max-rate-scale", "1e6",
               "--jobs", 1, "--out", tmp_path / "c", "--quiet") == 0
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert "this trace is too short to build a queue" in err
    capacity = pd.read_csv(tmp_path / "c" / "capacity.csv")
    assert capacity["status"].tolist() == ["unbounded: the whole trace at once meets the SLO"]
    assert capacity["num_probes"].tolist()[0] < 40


def test_a_report_of_an_incomplete_sweep_names_the_missing_points(tmp_path, capsys):
    import pyarrow.parquet as pq

    folder = tmp_path / "S"
    assert sim("sweep", AZURE_CONV_SAMPLE, "--limit", 10, "--policy", "chunked,decode-first,prefill-first",
               "--jobs", 1, "--quiet", "--out", folder) == 0
    table = pq.read_table(folder / "results.parquet")
    pq.write_table(table.slice(0, 1), folder / "results.parquet")  # as a sweep killed after its first point
    capsys.readouterr()
    assert sim("report", folder) == 0
    err = capsys.readouterr().err
    assert "the sweep is incomplete, 2 points have no result (policy=decode-first, policy=prefill-first)" in err
    page = (folder / "report.html").read_text()
    assert "This sweep is incomplete: 2 of its points have no result" in page
    assert "policy=decode-first, policy=prefill-first" in page


def test_a_report_of_runs_says_which_sub_folders_it_left_out(tmp_path, capsys):
    """`sim report` of a folder of runs drew its run folders and silently left out a sweep beside them (and
    `sim report` of a sweep, a run folder put in it): the page looked like everything the folder held."""
    import shutil

    from tests.helpers import one_error_line

    folder = tmp_path / "study"
    for policy in ("chunked", "decode-first"):
        assert sim("replay", AZURE_CONV_SAMPLE, "--limit", 10, "--policy", policy, "--quiet",
                   "--out", folder / policy) == 0
    assert sim("sweep", AZURE_CONV_SAMPLE, "--limit", 10, "--policy", "chunked,prefill-first", "--jobs", 1,
               "--quiet", "--out", folder / "sweep") == 0
    capsys.readouterr()
    assert sim("report", folder) == 0
    note = (f"left out 1 sub-folder, sweep/ (a sweep): this page draws the 2 run folders directly in it only. "
            f"Report each on its own (sim report {folder / 'sweep'}).")
    assert capsys.readouterr().err == f"sim: warning: {folder}: {note}\n"
    assert f"<b>Left out:</b> L{note[1:]}</div>" in (folder / "report.html").read_text()
    # A sweep's report says so of a run folder inside it.
    shutil.copytree(folder / "chunked", folder / "sweep" / "mine")
    assert sim("report", folder / "sweep") == 0
    assert capsys.readouterr().err == (f"sim: warning: {folder / 'sweep'}: left out 1 sub-folder, mine/ (a run): this "
                                       "page draws the sweep's table only. Report each on its own (sim report "
                                       f"{folder / 'sweep' / 'mine'}).\n")
    # A validation's page is its own report.html, which sim report refuses to draw again: pointed there
    # (found by a review: the hint said `sim report DIR/val`).
    val = folder / "val"
    val.mkdir()
    (val / "validate.json").write_text("{}")
    (val / "report.html").write_text("<html></html>")
    assert sim("report", folder) == 0
    assert (f"Report each on its own (sim report {folder / 'sweep'}; a validation's page is its own report.html "
            f"({val / 'report.html'}))") in capsys.readouterr().err
    shutil.rmtree(val)
    # A folder holding no run folder, only a sweep: the refusal names it.
    for policy in ("chunked", "decode-first"):
        shutil.rmtree(folder / policy)
    assert sim("report", folder) == 2
    assert one_error_line(capsys) == (f"{folder}: holds no results.parquet, capacity.csv, summary.json or run "
                                      "folders; nothing to report; its sub-folder sweep/ (a sweep) is not drawn here. "
                                      f"Report each on its own (sim report {folder / 'sweep'}).")


@pytest.mark.slow
def test_a_profile_of_another_system_is_refused(tmp_path, capsys):
    from tests.helpers import shared_dir

    tables = shared_dir() / "gpu-data" / "aiconfigurator"
    if not (tables / "h200_sxm__vllm-0.24.0__gemm_perf.parquet").exists() and not list(tables.glob("h200_sxm*")):
        pytest.skip("no operator tables")
    profile = tmp_path / "h200.json"
    assert sim("calibrate", "--from-ops", tables, "--system", "h200_sxm", "--model", "Llama-3.1-8B", "--out", profile,
               "--quiet") == 0
    assert sim("replay", *SMALL, "--profile", profile, "--hardware", "A100-80GB", "--out", tmp_path / "a",
               "--quiet") == 2
    assert error_text(capsys) == (f"sim: error: {profile} holds kernel times measured on H200 (h200_sxm tables), not "
                                  "A100-80GB: derive a profile from A100-80GB's tables, or run with --hardware H200\n")
    assert sim("replay", *SMALL, "--profile", profile, "--hardware", "H200", "--out", tmp_path / "b", "--quiet") == 0
    # A full disk while replacing it keeps the good profile whole.
    good = profile.read_bytes()
    run = child(["calibrate", "--from-ops", tables, "--system", "h200_sxm", "--model", "Llama-3.1-8B", "--out",
                 profile, "--overwrite", "--quiet"], fsize=4096)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2 and "the file there is unchanged" in err, err
    assert profile.read_bytes() == good


def test_bench_requests_that_can_never_run_are_refused_up_front(tmp_path, capsys):
    args = ["bench", "--concurrency", 4, "--num-prompts", 20, "--out", tmp_path / "b", "--quiet"]
    assert sim(*args, "--input-len", 5000, "--output-len", 10, "--max-model-len", 4096) == 2
    assert error_text(capsys) == ("sim: error: --input-len 5000 + --output-len 10 = 5010 tokens, more than "
                                  "--max-model-len 4096: every request would be rejected; shorten them or raise "
                                  "--max-model-len\n")
    assert sim(*args, "--input-len", 500, "--output-len", 10, "--num-gpu-blocks", 10) == 2
    assert "needs 32 KV blocks, and the whole cache has 10" in error_text(capsys)
    assert not (tmp_path / "b").exists()


# No hangs.

def test_an_unreachable_ray_address_is_refused_quickly():
    import socket

    from sim.app.sweep_cli import check_reachable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ServesimError, match=rf"^--address {re.escape(address)}: no Ray cluster answers there"):
            check_reachable(address)
    with pytest.raises(ServesimError, match="expected HOST:PORT"):
        check_reachable("nonsense")
    with pytest.raises(ServesimError, match="no Ray cluster answers there"):
        check_reachable("192.0.2.1:6379", timeout_s=0.5)  # TEST-NET-1: never answers
    assert time.monotonic() - started < 30


@pytest.mark.slow  # a cache of 2**25 blocks takes seconds to build
def test_a_capped_kv_cache_is_reported_as_capped(tmp_path, capsys):
    """A memory within its physical range (16 TiB) that holds more blocks than servesim simulates
    (a tiny model, 1-token blocks): the run goes on at the cap and says so, on the terminal and in
    summary.json (an absurd 1e300 bytes is refused as out of range: tests/test_options.py)."""
    import json

    hardware = tmp_path / "huge.json"
    hardware.write_text('{"peak_bf16_flops": 1e15, "peak_fp8_flops": null, "memory_bandwidth": 3e12, '
                        f'"memory_bytes": {2**44}, "nvlink_bandwidth": null}}')
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", 5, "--model", "tiny", "--block-size", 1, "--hardware", hardware,
               "--out", tmp_path / "r", "--quiet") == 0
    assert "servesim simulates at most 33,554,432" in capsys.readouterr().err
    kv = json.loads((tmp_path / "r" / "summary.json").read_text())["kv_cache"]
    assert kv["num_gpu_blocks"] == 33_554_432 and kv["capped"]["derived_num_gpu_blocks"] > 33_554_432
    assert kv["capped"]["cap"] == 33_554_432 and kv["capped"]["why"]


def test_every_command_refuses_an_out_folder_holding_its_input(tmp_path, capsys):
    """The input, whatever its flag, is inside --out: refused before any work, the input kept."""
    folder = tmp_path / "D"
    folder.mkdir()
    trace = folder / "trace.csv"
    trace.write_bytes(Path(AZURE_CONV_SAMPLE).read_bytes())
    hardware = folder / "gpu.json"
    hardware.write_text('{"peak_bf16_flops": 1e15, "peak_fp8_flops": null, "memory_bandwidth": 3e12, '
                        '"memory_bytes": 85000000000, "nvlink_bandwidth": null}')
    profile = folder / "p.json"
    profile.write_bytes((ROOT / "profiles" / "tiny-cpu.json").read_bytes())
    measured = folder / "silicon.csv"
    measured.write_text("x\n")
    before = snapshot(folder)
    commands = {
        "sweep": ["sweep", trace, "--jobs", 1],
        "capacity": ["capacity", trace, "--slo", "tbt=0.1", "--jobs", 1],
        "bench": ["bench", "--concurrency", 1, "--input-len", 8, "--output-len", 2, "--num-prompts", 2,
                  "--hardware", hardware],
        "compare": ["compare", trace, "--profile", profile, "--model", "tiny"],
        "validate": ["validate", measured, "--ops", tmp_path],
    }
    for name, args in commands.items():
        assert sim(*args, "--out", folder, "--overwrite", "--quiet") == 2, name
        assert f"{folder}: holds the input " in error_text(capsys), name
        assert snapshot(folder) == before, name
    # A file output over an input named by any flag: a profile over the --hardware file.
    assert sim("calibrate", "--from-ops", tmp_path, "--system", "h100_sxm", "--model", "Llama-3.1-8B",
               "--hardware", hardware, "--out", hardware.with_suffix(".json"), "--overwrite", "--quiet") == 2
    assert "writing it would destroy it" in error_text(capsys)
    assert snapshot(folder) == before


def test_an_overwrite_through_a_link_replaces_the_folder_it_names_and_keeps_the_link(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    assert sim("replay", *SMALL, "--out", real, "--quiet") == 0
    link.symlink_to(real)
    before = snapshot(real)
    assert sim("replay", *SMALL, "--policy", "decode-first", "--out", link, "--overwrite", "--quiet") == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert snapshot(real).keys() == before.keys() and snapshot(real) != before
    assert not leftovers(tmp_path)


def test_an_overwrite_of_a_file_through_a_link_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    """The rename onto the link replaced the link itself with the new file, and left the file it named as
    it was: the trace the link named stayed the old one."""
    source = tmp_path / "t.csv"
    source.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n1,20,3\n")
    real, link = tmp_path / "real.csv", tmp_path / "link.csv"
    real.write_text("old\n")
    link.symlink_to(real.name)
    assert sim("trace", "convert", source, link, "--overwrite") == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert real.read_text().startswith("arrival_s,prompt_tokens,output_tokens\n0.0,10,2\n")
    assert not leftovers(tmp_path)


def test_out_on_a_link_to_nothing_names_the_link(tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    assert sim("replay", *SMALL, "--out", link, "--quiet") == 2  # was "cannot make the folder (File exists)"
    assert error_text(capsys) == (f"sim: error: {link}: a link to {tmp_path / 'nowhere'}, which does not exist; "
                                  "make that folder first, or choose another --out\n")
    assert not (tmp_path / "nowhere").exists()


def test_a_file_output_that_is_a_link_loop_is_refused_naming_it(tmp_path, capsys):
    """A link that names itself (or a loop of links) cannot be written through: refused naming the link;
    resolving it was an internal error (RuntimeError: Symlink loop)."""
    source = tmp_path / "t.csv"
    source.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n")
    link = tmp_path / "loop.csv"
    link.symlink_to(link.name)
    assert sim("trace", "convert", source, link, "--overwrite") == 2
    message = capsys.readouterr().err
    assert str(link) in message and "loop of links" in message and "internal error" not in message
    assert link.is_symlink() and not leftovers(tmp_path)


def _as_written_before_max_num_active_seqs(path: Path, keep_seed: int) -> None:
    """Rewrite a sweep's table as a sweep written before the max_num_active_seqs and
    prefill_schedule_interval axes and the admission limits existed wrote it: no such axes in its grid,
    columns or point keys, no such fixed options; only the points of seed `keep_seed`."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    identity = json.loads(table.schema.metadata[b"servesim.sweep"])
    for axis in ("max_num_active_seqs", "prefill_schedule_interval"):
        del identity["axes"][axis]
    for option in ("max_num_queued_reqs", "max_num_queued_tokens"):
        del identity["fixed"][option]
    table = table.take([i for i, key in enumerate(table.column("point").to_pylist()) if key.endswith(f"seed={keep_seed}")])
    keys = [key.replace("max_num_active_seqs=0,", "").replace("prefill_schedule_interval=1,", "")
            for key in table.column("point").to_pylist()]
    table = table.set_column(0, "point", pa.array(keys))
    table = table.drop([c for c in ("max_num_active_seqs", "prefill_schedule_interval", "max_num_queued_reqs",
                                    "max_num_queued_tokens") if c in table.column_names])
    pq.write_table(table.replace_schema_metadata({b"servesim.sweep": json.dumps(identity).encode()}), path)


def test_a_sweep_written_before_the_newer_axes_resumes(tmp_path, capsys):
    # A sweep of the previous release (before --max-num-active-seqs was an axis) resumed with the same command: it
    # was refused as 'grid max_num_active_seqs = not set there, [0] here', an option no one gave. Its points run at
    # the axes' unset values: the finished one is kept (not run again beside its old row), the other one runs.
    pytest.importorskip("pyarrow")
    from reports.tables import read_table

    out = tmp_path / "s"
    grid = ["sweep", *SMALL, "--seed", "0,1", "--jobs", "1", "--quiet", "--out", out]
    assert sim(*grid) == 0
    full = read_table(out / "results.parquet")[0]
    _as_written_before_max_num_active_seqs(out / "results.parquet", keep_seed=0)
    old = read_table(out / "results.parquet")[0]
    assert len(old) == 1 and "max_num_active_seqs" not in old
    assert sim(*grid, "--resume") == 0, capsys.readouterr().err
    resumed, identity = read_table(out / "results.parquet")
    assert resumed["point"].tolist() == full["point"].tolist()  # two rows, in today's keys
    assert resumed["wall_s"].iloc[0] == old["wall_s"].iloc[0]  # the old row kept, not run again
    assert resumed["max_num_active_seqs"].tolist() == [0, 0] and resumed["prefill_schedule_interval"].tolist() == [1, 1]
    assert identity["axes"]["max_num_active_seqs"] == [0]
    assert resumed["ttft_p99"].tolist() == full["ttft_p99"].tolist()
    # Another grid is still refused, naming what differs.
    assert sim("sweep", *SMALL, "--seed", "0,1", "--max-num-active-seqs", "8", "--quiet", "--out", out, "--resume") == 2
    assert "grid max_num_active_seqs = [0] there, [8] here" in error_text(capsys)


def test_a_sweep_written_before_stream_interval_was_an_axis_resumes_at_its_fixed_value(tmp_path, capsys):
    # Before --stream-interval was a grid axis a sweep with --stream-interval 2 stated it as a fixed option (its
    # points' keys without it). The same command resumed today was refused as 'grid stream_interval = not set
    # there, [2] here': the fixed option is the one-valued axis, and the finished point is kept.
    pytest.importorskip("pyarrow")
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from reports.tables import read_table

    out = tmp_path / "s"
    grid = ["sweep", *SMALL, "--stream-interval", "2", "--seed", "0,1", "--jobs", "1", "--quiet", "--out", out]
    assert sim(*grid) == 0
    full = read_table(out / "results.parquet")[0]
    table = pq.read_table(out / "results.parquet")
    identity = json.loads(table.schema.metadata[b"servesim.sweep"])
    del identity["axes"]["stream_interval"]
    identity["fixed"]["stream_interval"] = 2
    table = table.take([0])
    table = table.set_column(0, "point", pa.array([k.replace("stream_interval=2,", "")
                                                   for k in table.column("point").to_pylist()]))
    pq.write_table(table.replace_schema_metadata({b"servesim.sweep": json.dumps(identity).encode()}),
                   out / "results.parquet")
    old = read_table(out / "results.parquet")[0]
    assert sim(*grid, "--resume") == 0, capsys.readouterr().err
    resumed, identity = read_table(out / "results.parquet")
    assert resumed["point"].tolist() == full["point"].tolist()
    assert resumed["wall_s"].iloc[0] == old["wall_s"].iloc[0]  # the old row kept, not run again
    assert resumed["stream_interval"].tolist() == [2, 2] and identity["axes"]["stream_interval"] == [2]
    assert "stream_interval" not in identity["fixed"]
    # Another value is still refused, naming what differs.
    assert sim("sweep", *SMALL, "--stream-interval", "3", "--seed", "0,1", "--quiet", "--out", out, "--resume") == 2
    assert "grid stream_interval = [2] there, [3] here" in error_text(capsys)


def test_tables_of_several_runs_show_what_each_rejected(tmp_path, capsys):
    # Under the admission limits a run at 10x the rate rejects most of its requests (HTTP 503), which are in none
    # of its latencies: its p99 TTFT was lower than at 1x and neither the sweep's table on the terminal nor a
    # report's table of numbers said that it had shed its load. Both show the rejected count where any point has one.
    pytest.importorskip("pyarrow")
    from reports.tables import read_table

    out = tmp_path / "s"
    assert sim("sweep", *SMALL, "--rate-scale", "1,10", "--max-num-queued-reqs", "3", "--jobs", "1", "--out", out) == 0
    frame = read_table(out / "results.parquet")[0]
    assert frame["rejected"].iloc[1] > frame["rejected"].iloc[0] > 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["rate", "req/s", "rejected"]
    assert [float(line.split()[2]) for line in lines[1:3]] == frame["rejected"].tolist()
    page = (out / "report.html").read_text()
    numbers = page[page.index("<h2>Numbers</h2>"):]
    assert "<th>req/s</th><th>rejected</th>" in numbers
    for rejected in frame["rejected"]:
        assert f"<td>{rejected:.1f}</td>" in numbers or f"<td>{rejected:.3g}</td>" in numbers
    # A folder of runs, one of them rejecting every request.
    runs = tmp_path / "runs"
    assert sim("replay", *SMALL, "--out", runs / "a", "--quiet") == 0
    assert sim("replay", *SMALL, "--max-num-queued-reqs", "0", "--out", runs / "b", "--quiet") == 0
    assert sim("report", runs) == 0
    numbers = (runs / "report.html").read_text().split("<h2>Numbers</h2>")[1]
    assert "<th>rejected</th>" in numbers and "<td>40.0</td>" in numbers
    # Where no run rejected a request, the table is as it was.
    assert sim("sweep", *SMALL, "--rate-scale", "1,2", "--jobs", "1", "--out", tmp_path / "t") == 0
    assert "rejected" not in capsys.readouterr().out
    assert "<th>rejected</th>" not in (tmp_path / "t" / "report.html").read_text()


def test_a_report_of_runs_of_an_older_release_names_no_option_they_share(tmp_path, capsys):
    # A run written before --max-num-active-seqs records no max_num_active_seqs (it ran with none: every --max-num-seqs
    # admitted); today's records 0, unset. The two were said to differ in max_num_active_seqs, a column of "-" and 0.
    import json

    from reports.html import differing_options

    runs = tmp_path / "runs"
    assert sim("replay", *SMALL, "--out", runs / "old", "--quiet") == 0
    assert sim("replay", *SMALL, "--policy", "decode-first", "--out", runs / "new", "--quiet") == 0
    summary = json.loads((runs / "old" / "summary.json").read_text())
    del summary["options"]["scheduler"]["max_num_active_seqs"]
    (runs / "old" / "summary.json").write_text(json.dumps(summary))
    assert sim("report", runs) == 0
    assert "The runs differ in policy: a column each" in (runs / "report.html").read_text()
    # An axis given a value in a run is still named beside one that does not record it.
    new = json.loads((runs / "new" / "summary.json").read_text())
    new["options"]["scheduler"]["max_num_active_seqs"] = 8
    assert differing_options([summary["options"], new["options"]]) == ["policy", "max_num_active_seqs"]


def test_the_burstgpt_total_tokens_warning_does_not_say_rows_cut_by_limit_were_replayed(tmp_path, capsys):
    # The rows are counted as the file is read; --limit 1 then replays only line 2, whose total is right. The warning
    # said "1 replayed row so: the replay uses Request and Response tokens" of line 3, which was not replayed.
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "0,ChatGPT,10,5,15,Conversation log\n1,ChatGPT,10,5,99,Conversation log\n")
    assert sim("replay", path, "--limit", "1", "--out", tmp_path / "r", "--quiet") == 0
    err = capsys.readouterr().err
    assert f"{path}:3: Total tokens 99 is not Request tokens + Response tokens (10 + 5); 1 row of the file so: " in err
    assert "replayed" not in err


def test_a_plugin_that_calls_sys_exit_is_refused_not_a_silent_success(tmp_path, capsys):
    """Found by a new-user run: a policy calling sys.exit(0) ended the command with exit 0, no message and
    no run folder; a router changing the request it routes went unnoticed."""
    out = tmp_path / "run"
    assert sim("replay", *SMALL, "--policy", f"{HOSTILE}:Exits", "--out", out, "--quiet") == 2
    assert error_text(capsys) == (f"sim: error: your policy Exits ({HOSTILE}:Exits) called sys.exit(0) in schedule at "
                                  "step 4: it must return, not end the process\n")
    assert not out.exists()
    assert sim("replay", *SMALL, "--replicas", 2, "--router", f"{HOSTILE}:ShorteningRouter", "--out", out,
               "--quiet") == 2
    assert "changed request 0's max_tokens from 44 to 1; a router picks a replica" in error_text(capsys)
    # A router that promised to read nothing of the replicas (it is asked before the run) and read their load
    assert sim("replay", *SMALL, "--replicas", 3, "--router", f"{HOSTILE}:ReadsStateAfterAll", "--out", out,
               "--quiet") == 2
    assert "declares reads_state = False, so it is asked where each request goes before the run starts, but it read " \
           "a replica's num_in_flight" in error_text(capsys)


def test_loading_a_plugin_is_bounded_and_its_errors_are_the_users(tmp_path, capsys, monkeypatch):
    """Found by a new-user run: a plugin module that loops as it loads hung the command past
    --policy-timeout; one calling sys.exit as it loads ended it with that code, silently; a
    `package.module:Class` with a syntax error was an internal error; and a policy that scheduled
    nothing was named by its base class's name ("policy chunked")."""
    out = tmp_path / "run"
    (tmp_path / "hangs.py").write_text("while True:\n    pass\n")
    assert sim("replay", *SMALL, "--policy", f"{tmp_path / 'hangs.py'}:P", "--policy-timeout", 0.5, "--out", out,
               "--quiet") == 2
    assert "loading it did not finish within --policy-timeout 0.5 s" in error_text(capsys)
    (tmp_path / "leaves.py").write_text("import sys\nsys.exit(0)\n")
    assert sim("replay", *SMALL, "--router", f"{tmp_path / 'leaves.py'}:R", "--replicas", 2, "--out", out,
               "--quiet") == 2
    assert "its module called sys.exit(0) as it loaded" in error_text(capsys)
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("")
    (tmp_path / "brokenpkg" / "mod.py").write_text("def (:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert sim("replay", *SMALL, "--policy", "brokenpkg.mod:P", "--out", out, "--quiet") == 2
    assert "--policy: module 'brokenpkg.mod' failed to load: SyntaxError" in error_text(capsys)
    (tmp_path / "starves.py").write_text(
        "from policies.base import Promises\nfrom policies.chunked import ChunkedPolicy\n\n"
        "class Starves(ChunkedPolicy):\n    promises = Promises()\n\n"
        "    def schedule(self, state, now):\n        return super().schedule(state, now) if state.step_index < 3 "
        "else __import__('sim.batch').batch.Batch()\n")
    assert sim("replay", *SMALL, "--policy", f"{tmp_path / 'starves.py'}:Starves", "--out", out, "--quiet") == 2
    err = error_text(capsys)
    assert f"Starves ({tmp_path / 'starves.py'}:Starves)" in err and "policy chunked" not in err


def test_a_policy_that_swallows_the_timeouts_stop_is_ended(tmp_path):
    """Found by a new-user run: a policy polling in a loop with a bare `except:` caught the timeout's
    exception (and SIGTERM's) and ran for ever. Past twice the timeout (at least a second more) the
    watchdog ends the process, exit 2, naming it; the old run folder stays whole."""
    out = tmp_path / "run"
    started = time.monotonic()
    proc = child(["replay", *SMALL, "--policy", f"{HOSTILE}:SwallowsTheStop", "--policy-timeout", "0.5",
                  "--out", out, "--quiet"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and time.monotonic() - started < 30
    assert err.endswith(f"sim: error: your policy SwallowsTheStop ({HOSTILE}:SwallowsTheStop): schedule at step 4 "
                        "did not return within --policy-timeout 0.5 s and went on after it was told to stop (does "
                        "it catch every exception, a bare except:?); ended\n"), err
