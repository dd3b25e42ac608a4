"""`sim sweep --executor ray --address` against a real two-node Ray cluster on this machine
(Ray's own ray.cluster_utils.Cluster: a head node and two worker nodes, each a raylet of its own).
A worker node is removed while it runs a point; that point is recorded as failed, and
`--resume` on the head alone finishes with rows identical to a local run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sim.app.cli import main
from sim.app.sweep import RESULTS, read_table
from traces import AZURE_CONV_SAMPLE

ray = pytest.importorskip("ray")
pytest.importorskip("pyarrow")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SLOW = str(ROOT / "tests" / "data" / "policies" / "slow.py") + ":SlowChunked"
# Four points of a few seconds each (the slow policy takes 20 ms per step), two at a time.
ARGS = [str(AZURE_CONV_SAMPLE), "--limit", "6", "--policy", f"chunked,{SLOW}", "--max-num-batched-tokens", "256,1024"]


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=["wall_s"]).reset_index(drop=True)


def test_sweep_on_two_nodes_loses_one_and_resumes_to_the_local_rows(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    local = tmp_path / "local"
    assert main(["sweep", *ARGS, "--out", str(local), "--jobs", "2", "--quiet"]) == 0
    expected = comparable(read_table(local / RESULTS)[0])

    marks = tmp_path / "marks"  # the slow policy marks each process running a point (tests/data/policies/slow.py)
    marks.mkdir()
    monkeypatch.setenv("SLOW_POLICY_MARKS", str(marks))  # the raylets, and so their workers, inherit it
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    # The head runs no points; two worker nodes of one CPU each run them, and the one found running a
    # slow point is removed (which node Ray gives a slow point to is Ray's choice: waiting for one
    # chosen node could see every slow point run on the other and the sweep end first).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        out = tmp_path / "cluster"
        command = [sys.executable, "-m", "sim.app.cli", "sweep", *ARGS, "--out", str(out), "--executor", "ray",
                   "--address", cluster.address, "--quiet"]
        driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ))
        deadline = time.monotonic() + 180
        # In the middle: a worker node is busy with a slow point (seconds long, marked at its first step).
        while (busy := next((n for n in workers if _worker_node_busy(marks, n)), None)) is None:
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
            time.sleep(0.1)
        cluster.remove_node(busy, allow_graceful=False)
        assert driver.wait(timeout=300) == 1, driver.stderr.read()  # the lost point failed; the rest ran
        lost = read_table(out / RESULTS)[0]
        assert len(lost) == 4 and (lost["status"] == "error").sum() >= 1
        assert lost.loc[lost["status"] == "error", "error"].str.startswith("worker failed: ").all()

        resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=dict(os.environ),
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        pd.testing.assert_frame_equal(comparable(read_table(out / RESULTS)[0]), expected)
    finally:
        cluster.shutdown()


def _worker_node_busy(marks: Path, node) -> bool:
    """A Ray worker process of `node` has started a slow point (its pid left a mark)."""
    pids = {int(p.name) for p in marks.iterdir()}
    return any(_is_descendant(pid, node.all_processes) for pid in pids)


def _is_descendant(pid: int, processes: dict) -> bool:
    """Whether `pid` descends from one of the node's own processes (its raylet starts its workers)."""
    roots = {info.process.pid for infos in processes.values() for info in infos}
    while pid > 1:
        if pid in roots:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False
