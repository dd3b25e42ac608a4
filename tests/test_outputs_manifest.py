"""The record of the files servesim wrote in a folder (sim/app/outputs.py, MANIFEST_NAME): --overwrite
replaces a folder only when each run file in it is recorded there as it is now. A user's file of a
run file's name, a hidden file of theirs, a file edited since, are refused, never deleted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sim.app.outputs import MANIFEST_NAME, atomic_write_text, claim_folder, foreign_entries, read_manifest
from sim.errors import ServesimError
from tests.helpers import one_error_line, sim
from traces import AZURE_CONV_SAMPLE

SMALL = [str(AZURE_CONV_SAMPLE), "--limit", "10"]




def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_users_files_of_run_file_names_are_refused_and_kept(tmp_path, capsys):
    uf = tmp_path / "uf"
    uf.mkdir()
    (uf / "requests.csv").write_text("my precious data\n")
    (uf / "report.html").write_text("notes\n")
    h2 = tmp_path / "h2"
    h2.mkdir()
    (h2 / ".draft.tmp").write_text("precious draft\n")
    (h2 / "summary.json").write_text("{}\n")
    h3 = tmp_path / "h3"
    (h3 / "measured").mkdir(parents=True)
    (h3 / "measured" / "requests.csv").write_text("mine\n")
    before = {folder: tree(folder) for folder in (uf, h2, h3)}
    for folder, named in ((uf, "holds report.html, requests.csv, which servesim did not record writing "
                               f"(no {MANIFEST_NAME}: "),
                          (h2, "holds .draft.tmp, which no servesim command writes; and summary.json, which "
                               "servesim did not record writing"),
                          (h3, "holds measured/requests.csv, which servesim did not record writing")):
        assert sim("replay", *SMALL, "--out", folder, "--overwrite", "--quiet") == 2
        said = one_error_line(capsys)
        assert said.startswith(f"{folder}: {named}"), said
        assert said.endswith("choose another --out, or remove them yourself"), said
        assert tree(folder) == before[folder]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h2", "h3", "uf"]  # nothing left beside them
    # Without --overwrite it is the usual refusal; nothing is written either.
    assert sim("replay", *SMALL, "--out", uf, "--quiet") == 2
    assert "already holds a run (report.html, requests.csv)" in one_error_line(capsys)
    assert tree(uf) == before[uf]


def test_a_run_folder_servesim_wrote_is_overwritten_again_and_again(tmp_path):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    recorded = read_manifest(run)
    assert sorted(recorded) == ["digest.json", "report.html", "requests.csv", "steps.parquet", "summary.json"]
    for policy in ("decode-first", "prefill-first"):
        assert sim("replay", *SMALL, "--policy", policy, "--out", run, "--overwrite", "--quiet") == 0
        assert json.loads((run / "summary.json").read_text())["options"]["scheduler"]["policy"] == policy
        assert foreign_entries(run) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_run_file_edited_since_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    with open(run / "requests.csv", "a") as f:
        f.write("my note at the end\n")
    before = tree(run)
    assert sim("replay", *SMALL, "--out", run, "--overwrite", "--quiet") == 2
    assert one_error_line(capsys).startswith(f"{run}: holds requests.csv, which servesim did not record "
                                         f"writing (not in its {MANIFEST_NAME}, or changed since); ")
    assert tree(run) == before


def test_sim_report_keeps_the_folder_servesims(tmp_path):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    assert sim("report", run) == 0
    assert foreign_entries(run) == []
    assert sim("replay", *SMALL, "--out", run, "--overwrite", "--quiet") == 0
    # A folder without a record (an older servesim's): its report.html is not known for servesim's, so
    # sim report keeps it (below); once it is moved away, sim report records only the page it writes:
    # the other files are still not vouched for, and an --overwrite of the folder is refused.
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    (bare / MANIFEST_NAME).unlink()
    assert sim("report", bare) == 2
    (bare / "report.html").unlink()
    assert sim("report", bare) == 0
    assert list(read_manifest(bare)) == ["report.html"]
    assert sim("replay", *SMALL, "--out", bare, "--overwrite", "--quiet") == 2


def test_sim_report_replaces_no_report_html_servesim_did_not_write(tmp_path, capsys):
    """Found by a new-user run: `sim report DIR` wrote DIR/report.html over a page of the user's (a
    folder of runs holding their own report.html, a run's page edited by hand) and through a link
    (replacing the file it points to, outside the folder). Each is refused and kept; a page sim report
    wrote itself is replaced, in a run folder and in a folder of runs alike."""
    run = tmp_path / "study" / "runA"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    study = tmp_path / "study"
    (study / "report.html").write_text("<h1>My annotated findings</h1>\n")
    assert sim("report", study) == 2
    assert one_error_line(capsys) == (f"{study / 'report.html'} exists and servesim did not record "
                                      "writing it (or it was changed since): sim report would replace it; move or "
                                      "rename it to write the report")
    assert (study / "report.html").read_text() == "<h1>My annotated findings</h1>\n"
    (study / "report.html").unlink()
    assert sim("report", study) == 0 and sim("report", study) == 0  # its own page, again
    # A run's page edited by hand since servesim wrote it
    with open(run / "report.html", "a") as f:
        f.write("<p>my note</p>")
    edited = (run / "report.html").read_bytes()
    assert sim("report", run) == 2 and (run / "report.html").read_bytes() == edited
    assert "changed since" in one_error_line(capsys)
    # A link: its target, anywhere, is kept
    precious = tmp_path / "precious.html"
    precious.write_text("keep me")
    (run / "report.html").unlink()
    (run / "report.html").symlink_to(precious)
    assert sim("report", run) == 2
    assert "is a link (to " in one_error_line(capsys) and precious.read_text() == "keep me"


def test_temporary_files_are_servesims_only_in_atomic_paths_shape(tmp_path):
    with claim_folder(tmp_path / "run") as lock:
        atomic_write_text(lock.folder / "summary.json", "{}")
    run = tmp_path / "run"
    for name in (".requests.csv.a1b2_c3d.tmp", f".{MANIFEST_NAME}.zz99ab12.tmp", ".servesim-probe-x1y2z3w4",
                 ".DS_Store"):
        (run / name).write_text("left by a killed write")
    assert foreign_entries(run) == []
    for name in (".draft.tmp", ".notes.txt.a1b2c3d4.tmp", ".requests.csv.tmp"):
        (run / name).write_text("mine")
    assert foreign_entries(run) == [".draft.tmp", ".notes.txt.a1b2c3d4.tmp", ".requests.csv.tmp"]


def test_compare_subfolders_are_recorded(tmp_path):
    from dataclasses import replace

    from backends.calibration import calibrate
    from backends.profile import save_profile
    from sim.app.compare import compare, write_comparison
    from sim.app.plan import resolve
    from sim.app.replay import ReplayOptions
    from sim.config import CacheConfig, SchedulerConfig
    from tests.helpers import make_trace
    from tests.test_calibrate import StandInBackend

    profile, _ = calibrate(StandInBackend("tiny", num_blocks=512), "tiny", grid="small", warmup=0, repeats=3)
    save_profile(profile, tmp_path / "p.json")
    predicted = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=128, max_num_seqs=8),
                              cache=CacheConfig(num_blocks=256), model="tiny", hardware="H200",
                              profile=str(tmp_path / "p.json"))
    measured = resolve(replace(predicted, profile=None), StandInBackend("tiny", num_blocks=256, seed=4))
    predicted = resolve(predicted)
    trace = make_trace([(0.002 * i, 40 + 37 * i, 3 + (5 * i) % 11) for i in range(6)])
    out = tmp_path / "cmp"
    for overwrite in (False, True):
        with claim_folder(out, overwrite=overwrite) as lock:
            write_comparison(lock.folder, compare(trace, measured, predicted), trace, measured, predicted,
                             {"model": "tiny", "device": "cpu", "policy": "chunked", "trace": "test"})
            assert lock.staged == overwrite
        recorded = read_manifest(out)
        assert {"compare.json", "steps.csv", "report.html", "measured/summary.json", "measured/requests.csv",
                "predicted/summary.json", "predicted/steps.parquet"} <= set(recorded)
        assert foreign_entries(out) == []
    (out / "predicted" / "requests.csv").write_text("edited\n")
    with pytest.raises(ServesimError, match="holds predicted/requests.csv, which servesim did not record writing"):
        claim_folder(out, overwrite=True)


def test_a_failed_command_records_what_it_keeps(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt), claim_folder(run) as lock:  # a sweep keeps its rows when stopped
        atomic_write_text(lock.folder / "results.parquet", "rows")
        raise KeyboardInterrupt
    assert sorted(read_manifest(run)) == ["results.parquet"]
    claim_folder(run, overwrite=True).release()
    with pytest.raises(KeyboardInterrupt), claim_folder(tmp_path / "empty"):  # nothing kept: the folder goes
        raise KeyboardInterrupt
    assert not (tmp_path / "empty").exists()


def test_sweep_resume_then_overwrite(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    out = tmp_path / "S"
    args = ["sweep", *SMALL, "--policy", "chunked,decode-first", "--jobs", 1, "--quiet", "--out", out]
    assert sim(*args) == 0
    assert sim(*args, "--resume") == 0
    assert {"results.parquet", "report.html"} <= set(read_manifest(out))
    assert sim(*args, "--overwrite") == 0
    # --resume writes into a folder whatever it holds, but records only what servesim wrote: a user's
    # capacity.csv in it stays theirs, and an --overwrite is refused.
    (out / "capacity.csv").write_text("mine\n")
    assert sim(*args, "--resume") == 0
    assert "capacity.csv" not in read_manifest(out) and foreign_entries(out) == ["capacity.csv"]
    capsys.readouterr()
    assert sim(*args, "--overwrite") == 2
    assert "holds capacity.csv, which servesim did not record writing" in one_error_line(capsys)
    assert (out / "capacity.csv").read_text() == "mine\n"


def test_ctrl_c_while_a_finished_run_takes_its_folders_place_says_the_run_is_there(tmp_path, monkeypatch, capsys):
    """Found by a new-user run: a Ctrl-C that came after an --overwrite's new run had taken the
    folder's place, while the old run was being removed, said "sim: interrupted", as if the old run
    stood, and left the old run's files beside the folder. The swap and the removal now finish first,
    and the line says the folder holds the new run."""
    import os
    import signal

    from sim.app import outputs

    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    exchange = outputs._exchange

    def exchange_then_ctrl_c(a, b):
        exchange(a, b)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, as the old run is about to be removed

    monkeypatch.setattr(outputs, "_exchange", exchange_then_ctrl_c)
    assert sim("replay", str(AZURE_CONV_SAMPLE), "--limit", "20", "--out", run, "--overwrite", "--quiet") == 130
    assert capsys.readouterr().err == f"sim: interrupted after {run} was written whole (the old run in it replaced)\n"
    assert json.loads((run / "summary.json").read_text())["num_requests"] == 20  # the new run, recorded
    assert foreign_entries(run) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again


def test_the_deferral_leaves_an_ignored_ctrl_c_ignored_and_holds_sigterm_too(tmp_path, monkeypatch, capsys):
    """Found by a review: a Ctrl-C the process ignores (nohup, a script's background job) was caught by the
    deferral and turned into "interrupted"; a SIGTERM as the run took its folder's place said "terminated"
    alone, of a folder that held the new run."""
    import os
    import signal

    from sim.app import outputs

    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    exchange = outputs._exchange

    def exchange_then(number):
        def swap(a, b):
            exchange(a, b)
            os.kill(os.getpid(), number)
        return swap

    monkeypatch.setattr(outputs, "_exchange", exchange_then(signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert sim("replay", str(AZURE_CONV_SAMPLE), "--limit", "15", "--out", run, "--overwrite", "--quiet") == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert json.loads((run / "summary.json").read_text())["num_requests"] == 15
    capsys.readouterr()
    monkeypatch.setattr(outputs, "_exchange", exchange_then(signal.SIGTERM))
    assert sim("replay", str(AZURE_CONV_SAMPLE), "--limit", "25", "--out", run, "--overwrite", "--quiet") == 143
    assert capsys.readouterr().err == f"sim: terminated after {run} was written whole (the old run in it replaced)\n"
    assert json.loads((run / "summary.json").read_text())["num_requests"] == 25
    assert foreign_entries(run) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_sim_report_reads_a_runs_own_record_first_and_a_resumed_sweep_keeps_a_linked_page(tmp_path, capsys):
    """Found by a review: a run named `measured` inside a folder of runs with a record of its own was
    taken for a comparison's and its page refused; a resumed sweep wrote its page through a link."""
    exp = tmp_path / "exp"
    assert sim("replay", *SMALL, "--out", exp / "measured", "--quiet") == 0
    assert sim("report", exp) == 0 and sim("report", exp / "measured") == 0
    assert "measured/report.html" not in read_manifest(exp)
    sweep = tmp_path / "sw"
    args = ("sweep", str(AZURE_CONV_SAMPLE), "--limit", "10", "--policy", "chunked", "--out", sweep, "--quiet")
    assert sim(*args) == 0
    assert sim(*args, "--resume") == 0  # its own page, replaced
    precious = tmp_path / "precious.html"
    precious.write_text("keep me")
    (sweep / "report.html").unlink()
    (sweep / "report.html").symlink_to(precious)
    capsys.readouterr()
    assert sim(*args, "--resume") == 2
    assert "is a link" in one_error_line(capsys) and precious.read_text() == "keep me"


def test_sim_report_says_when_the_folders_record_cannot_be_read(tmp_path, capsys):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    (run / MANIFEST_NAME).write_text("{not json")
    capsys.readouterr()
    assert sim("report", run) == 2
    assert one_error_line(capsys) == (f"{run / 'report.html'} exists and servesim did not record writing it "
                                      f"({run / MANIFEST_NAME}, servesim's record of the folder, cannot be read): "
                                      "sim report would replace it; move or rename it to write the report")
