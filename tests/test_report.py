"""HTML reports: self-contained, the expected figures, cheap for long runs, and clean in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.digest import NUM_TIMELINE_BINS, QUANTILES, TIMELINE, make_digest, quantile_sketch, summary_row, timeline
from reports.figures import capacity_figure, replica_figure, timeline_figure
from reports.figures import cdf_figure as _cdf_figure
from reports.figures import throughput_figure as _throughput_figure
from reports.html import FIGURE_CONFIG, figure_div, plotly_js, plotly_json, report_html, run_report_html
from reports.run_tables import read_run_table
from sim.app.cli import main
from traces import AZURE_CONV_SAMPLE, MOONCAKE_SAMPLE

ROOT = Path(__file__).resolve().parents[1]
SMALL = [str(AZURE_CONV_SAMPLE), "--limit", "60"]
FIGURE_IDS = ("figure-latency-cdfs", "figure-step-timeline")
RUN_FIGURE_IDS = (*FIGURE_IDS, "figure-ttft-in-parts")  # one run's page adds its TTFT in parts


def figure_ids(text: str) -> list[str]:
    return re.findall(r'<div id="(figure-[a-z-]+)"', text)


def assert_self_contained(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>")
    assert "<script src" not in text and "<link" not in text  # nothing fetched: no CDN, no stylesheet
    assert text.count("<script") == 1 + len(figure_ids(text))  # plotly.js inline, then one per figure
    assert "Plotly.newPlot" in text
    # plotly.js itself is inline, whole and once: the page opens offline.
    from plotly.offline import get_plotlyjs

    assert text.count(get_plotlyjs()) == 1


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "chunked"
    assert main(["replay", *SMALL, "--out", str(out), "--quiet"]) == 0
    return out


def test_every_replay_writes_a_report(run_dir):
    text = (run_dir / "report.html").read_text()
    assert_self_contained(text)
    assert figure_ids(text) == list(RUN_FIGURE_IDS)
    for title in ("TTFT", "TPOT", "ITL (time between tokens)", "E2E latency", "prefill tokens per step",
                  "decode tokens per step", "KV blocks used", "waiting requests"):
        assert title in text
    digest = json.loads((run_dir / "digest.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    # The sketches agree with the summary's exact percentiles.
    p99 = list(QUANTILES).index(99.0)
    for metric in ("ttft", "tpot", "itl", "e2e", "scheduling_delay"):
        assert digest[metric][p99] == pytest.approx(summary[metric]["p99"])
    steps = read_run_table(run_dir, "steps")
    assert len(digest["timeline"]["start_s"]) == min(NUM_TIMELINE_BINS, len(steps))


def test_report_command_rebuilds_a_run_report_byte_for_byte(run_dir, capsys):
    before = (run_dir / "report.html").read_text()
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").read_text() == before
    assert "report.html" in capsys.readouterr().out


def test_report_of_a_folder_of_runs_compares_them(tmp_path):
    for policy in ("prefill-first", "chunked"):
        assert main(["replay", *SMALL, "--policy", policy, "--out", str(tmp_path / policy), "--quiet"]) == 0
    (tmp_path / "chunked" / "digest.json").unlink()  # a run from before digest.json: read from its CSVs
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.html").read_text()
    assert_self_contained(text)
    assert figure_ids(text) == list(FIGURE_IDS)
    assert "2 runs in" in text and '"name":"prefill-first"' in text and '"name":"chunked"' in text


def numbers_table(text: str) -> list[list[str]]:
    """The cells of the page's table of numbers, row by row (the header first)."""
    table = text[text.index("<h2>Numbers</h2>"):]
    table = table[:table.index("</table>")]
    return [[re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", table)]


def test_report_of_runs_that_differ_names_every_option_in_which_they_differ(tmp_path, capsys):
    """A folder of runs of other models, TP, hardware or traces was compared with only a model column (or
    none): a reader took the differences for the policy's. Every differing option is a column now, and
    runs of different traces are drawn each with its trace, one trace at a time in the CDFs, with a warning."""
    for name, args in (("base", SMALL), ("qwen", [*SMALL, "--model", "Qwen3-8B"]), ("tp2", [*SMALL, "--tp", "2"]),
                       ("h200", [*SMALL, "--hardware", "H200"]),
                       ("mooncake", [str(MOONCAKE_SAMPLE), "--limit", "30"])):
        assert main(["replay", *args, "--out", str(tmp_path / name), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    text = (tmp_path / "report.html").read_text()
    rows = numbers_table(text)
    header = rows[0]
    for column in ("run", "trace", "trace_transforms_limit", "model", "hardware", "tp", "num_blocks", "profile"):
        assert column in header, column
    cells = {row[0]: dict(zip(header, row)) for row in rows[1:]}
    assert cells["qwen"]["model"] == "Qwen3-8B" and cells["base"]["model"] == "Llama-3.1-8B"
    assert cells["tp2"]["tp"] == "2" and cells["base"]["tp"] == "1" and cells["h200"]["hardware"] == "H200"
    assert cells["mooncake"]["trace"] == str(MOONCAKE_SAMPLE) and cells["base"]["trace"] == str(AZURE_CONV_SAMPLE)
    assert cells["mooncake"]["trace_transforms_limit"] == "30" and cells["base"]["trace_transforms_limit"] == "60"
    assert "The runs differ in trace, trace_transforms_limit, model, hardware, " in text
    # Different traces: a warning on the page and on the terminal, naming each trace and its runs.
    note = (f"these runs replay 2 different traces (base, h200, qwen and 1 more replay {AZURE_CONV_SAMPLE}; "
            f"mooncake replays {MOONCAKE_SAMPLE}): their latencies differ by workload as well as by options")
    assert f"sim: warning: {tmp_path}: {note}" in err and err.count("\n") == 1
    assert "<b>Different traces:</b> T" + note[1:] in text
    # No view of the latency CDFs draws runs of two traces.
    figure = json.loads(re.search(r'Plotly\.newPlot\(\s*"figure-latency-cdfs",\s*(\[.*?\]),\s*\{', text).group(1))
    menu = re.search(r'"figure-latency-cdfs".*?"buttons":(\[.*?\]),"direction"', text).group(1)
    for button in json.loads(menu):
        shown = {line["name"] for line, visible in zip(figure, button["args"][0]["visible"]) if visible}
        assert shown and (shown == {"mooncake"} or "mooncake" not in shown), (button["label"], shown)


def test_report_of_runs_with_the_same_options_says_so(tmp_path, capsys):
    for name in ("one", "two"):
        assert main(["replay", *SMALL, "--out", str(tmp_path / name), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err
    text = (tmp_path / "report.html").read_text()
    assert "The runs&#x27; options are the same." in text and numbers_table(text)[0][:2] == ["run", "policy"]


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "nothing to report" in error and error.count("\n") == 1


def test_sweep_report_has_cdfs_per_policy_with_a_menu_and_throughput_curves(tmp_path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "sweep"
    assert main(["sweep", *SMALL, "--policy", "prefill-first,chunked", "--max-num-batched-tokens", "256,1024",
                 "--rate-scale", "1,2", "--seed", "0,1", "--out", str(out), "--jobs", "2", "--quiet"]) == 0
    text = (out / "report.html").read_text()
    assert_self_contained(text)
    assert figure_ids(text) == ["figure-latency-cdfs", "figure-throughput-against-latency-across-rates",
                                "figure-step-timeline"]
    from sim.app.sweep import read_table

    rows = read_table(out / "results.parquet")[0]
    first_seed = rows[rows["seed"] == 0]
    cdf = _cdf_figure(first_seed, ["max_num_batched_tokens", "rate_scale"], None)
    # One menu entry per (budget, rate); in each, one line per policy in each of the 4 panels.
    labels = [b["label"] for b in cdf["layout"]["updatemenus"][0]["buttons"]]
    assert labels == ["budget 256, rate ×1", "budget 256, rate ×2", "budget 1024, rate ×1", "budget 1024, rate ×2"]
    assert len(cdf["data"]) == 4 * 2 * 4
    assert sum(trace["visible"] for trace in cdf["data"]) == 2 * 4
    throughput = _throughput_figure(rows, ["policy", "max_num_batched_tokens"])
    # One line per (policy, budget) in each of the 4 panels, a point per rate, seeds averaged.
    assert len(throughput["data"]) == 4 * 4
    assert all(len(trace["x"]) == 2 for trace in throughput["data"])
    assert throughput["data"][0]["name"] == "prefill-first, budget 256"


def test_a_long_run_report_stays_small_and_fast():
    """A one-hour trace: ~20k requests, ~500k steps, ~4M inter-token gaps."""
    rng = np.random.default_rng(0)
    num_requests, num_steps = 20_000, 500_000
    ttft = rng.lognormal(-3, 1, num_requests)
    requests = pd.DataFrame({"status": "finished", "ttft_s": ttft, "tpot_s": rng.lognormal(-5, 0.2, num_requests),
                             "e2e_s": ttft + rng.lognormal(0, 1, num_requests),
                             "scheduling_delay_s": rng.lognormal(-4, 1, num_requests)})
    itl = rng.lognormal(-5, 0.5, 4_000_000)
    steps = {"start_s": np.cumsum(rng.uniform(0.005, 0.01, num_steps))}
    steps.update({name: rng.integers(0, 500, num_steps) for name in TIMELINE})
    summary = {"options": {"scheduler": {"policy": "chunked"}, "trace": "long.csv"}, "num_requests": num_requests}
    started = time.perf_counter()
    digest = make_digest(requests, itl, steps)
    text = run_report_html(summary, digest)
    seconds = time.perf_counter() - started
    assert seconds < 2.0  # about 0.3 s here; the bound leaves room for a slow CI machine
    assert len(digest["itl"]) == len(QUANTILES)
    assert all(len(v) == NUM_TIMELINE_BINS for v in digest["timeline"].values())
    from plotly.offline import get_plotlyjs

    assert len(text) - len(get_plotlyjs()) < 300_000
    # The tail of the sketch is exact even when its body comes from a sample.
    tail = QUANTILES >= 98
    assert np.array(digest["itl"])[tail] == pytest.approx(np.percentile(itl, QUANTILES[tail]), rel=1e-12)


def test_quantile_sketch_is_numpys_percentile_up_to_the_exact_limit():
    values = np.random.default_rng(1).exponential(size=5000)
    assert quantile_sketch(values) == pytest.approx(np.percentile(values, QUANTILES).tolist(), rel=1e-12)
    assert quantile_sketch(np.array([np.nan])) is None
    assert quantile_sketch(np.array([3.0, np.nan])) == [3.0] * len(QUANTILES)


def test_timeline_bins_are_means_per_step_with_gaps_when_idle():
    start = np.array([0.0, 0.5, 1.0, 9.0, 9.5])
    binned = timeline(start, {"num_waiting": np.array([1, 3, 5, 7, 9])}, num_bins=4)
    assert binned["start_s"] == [0.0, 2.375, 4.75, 7.125]
    assert binned["num_waiting"][0] == 3.0 and binned["num_waiting"][3] == 8.0
    assert np.isnan(binned["num_waiting"][1]) and np.isnan(binned["num_waiting"][2])


def test_report_html_of_failed_points_lists_their_errors():
    rows = pd.DataFrame([{"point": "a", "status": "error", "error": "ValueError: boom", "policy": "chunked"}])
    text = report_html(rows)
    assert "ValueError: boom" in text and figure_ids(text) == []


# The figures' HTML without plotly: plotly's own, byte for byte.

@pytest.fixture
def plotly_to_html(monkeypatch):
    """plotly.io.to_html as a page calls it, with plotly's json engine (the one it uses without orjson)."""
    import plotly.io as pio

    monkeypatch.setattr(pio.json.config, "default_engine", "json")

    def to_html(figure, div_id, config):
        return pio.to_html(figure, include_plotlyjs=False, full_html=False, validate=False, default_width="100%",
                           div_id=div_id, config=config)
    return to_html


def test_plotly_js_is_plotlys():
    from plotly.offline import get_plotlyjs

    assert plotly_js() == get_plotlyjs()


def test_a_run_page_imports_no_plotly(run_dir):
    done = subprocess.run([sys.executable, "-c", "import sys, json\nfrom reports.html import run_report_html\n"
                           f"d = {str(run_dir)!r}\n"
                           "page = run_report_html(json.load(open(d + '/summary.json')), json.load(open(d + '/digest.json')))\n"
                           "print(len(page), 'plotly' in sys.modules)"],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == "False"


def test_figure_divs_are_plotlys_for_every_figure(run_dir, tmp_path, plotly_to_html):
    summary = json.loads((run_dir / "summary.json").read_text())
    row = summary_row(summary, json.loads((run_dir / "digest.json").read_text()))
    rows = pd.DataFrame([{**row, "policy": policy, "rate_scale": rate, "max_num_batched_tokens": budget,
                          "request_throughput": rate * 2.0}
                         for policy in ("chunked", "prefill-first") for rate in (1.0, 2.0) for budget in (256, 1024)])
    capacity = pd.DataFrame({"policy": ["chunked", "decode-first"], "capacity_request_rate": [3.5, np.nan],
                             "status": ["ok", "no rate meets the SLO"], "max_num_batched_tokens": [256, 1024]})
    replicas = {"replica_replica": [0, 1], "replica_role": ["prefill", "decode"], "replica_requests": [10, 12],
                "replica_busy_fraction": [0.5, 0.25], "replica_mean_kv_usage": [0.1, np.float64(0.2)],
                "replica_prefix_cache_hit_rate": [0.0, 1.0]}
    figures = [_cdf_figure([row], [], None), timeline_figure([row], [], None),
               _cdf_figure(rows, ["max_num_batched_tokens", "rate_scale"], None), timeline_figure(rows, ["policy"], None),
               _throughput_figure(rows, ["policy", "max_num_batched_tokens"]), capacity_figure(capacity),
               replica_figure(replicas)]
    for i, figure in enumerate(figures):
        for config in (FIGURE_CONFIG, None, {"showSendToCloud": True, "plotlyServerURL": "https://x/"}):
            assert figure_div(figure, f"figure-{i}", config) == plotly_to_html(figure, f"figure-{i}", config)


def test_figure_divs_are_plotlys_for_awkward_values(plotly_to_html):
    layouts = [{}, {"width": 640, "height": 480.5}, {"width": "50%"}, {"template": {"layout": {"width": 300}}},
               {"height": "30em", "title": {"text": "NaN </script> <b>Infinity</b> \u2028 ×"}}]
    data = [{"type": "scatter", "x": np.array([1.5, np.nan, np.inf]), "y": [np.int64(3), np.float32(0.1), None, -np.inf],
             "name": "a/b <c>", "visible": np.bool_(True), "customdata": np.arange(3).reshape(3, 1)}]
    for i, layout in enumerate(layouts):
        figure = {"data": data, "layout": layout}
        assert figure_div(figure, f"f{i}", FIGURE_CONFIG) == plotly_to_html(figure, f"f{i}", FIGURE_CONFIG)
    assert figure_div({}, "empty") == plotly_to_html({}, "empty", None)


JSON_LEAVES = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
               | st.text(alphabet=st.sampled_from("aN/<>\"\\\u2028×é\n Infity0"), max_size=12))


@settings(max_examples=300, deadline=None)
@given(st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(alphabet="ab/<N", max_size=3), inner, max_size=4), max_leaves=20))
def test_plotly_json_is_plotlys(value):
    from plotly.io.json import to_json_plotly

    assert plotly_json(value) == to_json_plotly(value, engine="json")


# The browser test: headless Chromium (Debian's package), offline, no console output at all.

def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _browse(page: Path, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: any CDN fetch would fail
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", *args, page.as_uri()],
            capture_output=True, text=True, timeout=120)


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs chromium (apt-get install chromium)")
def test_report_loads_in_chromium_without_console_errors(run_dir, tmp_path):
    # The check can fail: a page with a script error is caught.
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>undefinedFunction()</script></body></html>")
    assert any("undefinedFunction" in line for line in _console(_browse(broken, "--dump-dom").stderr))

    report = run_dir / "report.html"
    dom = _browse(report, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console(dom.stderr) == []
    assert dom.stdout.count('class="plot-container plotly"') == len(RUN_FIGURE_IDS)  # plotly drew every figure
    screenshot = tmp_path / "report.png"
    shot = _browse(report, "--window-size=1280,2000", f"--screenshot={screenshot}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert _console(shot.stderr) == []
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 50_000


def test_a_runs_page_shows_its_hit_rate_slo_attainment_rejections_and_trace_transforms(tmp_path):
    """Found by a new-user run: report.html left out summary.json's prefix-cache hit rate, SLO attainment,
    reasons for rejection and the trace's transforms (--limit, --rate-scale), and printed counts as floats
    (requests 300.0)."""
    from sim.app.cli import main
    from traces import AZURE_CONV_SAMPLE

    run = tmp_path / "run"
    assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "300", "--rate-scale", "3", "--num-gpu-blocks", "300",
                 "--max-num-queued-reqs", "20", "--slo", "ttft=0.5", "--out", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    text = re.sub(r"<[^>]+>", " ", (run / "report.html").read_text())
    text = re.sub(r"\s+", " ", text)
    assert "trace limit 300, rate-scale 3.0" in text
    assert "prefix cache hits % SLO attainment %" in text
    assert f" {summary['slo_attainment'] * 100:.1f} " in text
    (reason, count), = summary["reject_reasons"].items()
    assert f"Rejected, by reason reason requests {reason} {count} " in text
    assert "requests completed rejected" in text and f" 300 {summary['completed']} {summary['rejected']} " in text


def test_a_folder_comparisons_option_cells_are_plain_values():
    """Found by a new-user run: a folder comparison's table showed options as Python spelled them after a
    table read them back: `[960.0, None]`, `cluster_num_replicas 3.0`."""
    from reports.html import _fmt_option

    assert _fmt_option("cluster_num_replicas", 3.0) == "3" and _fmt_option("x", 2.5) == "2.5"
    assert _fmt_option("x", [960.0, None]) == "960, -" and _fmt_option("x", np.array([1.0, 2.0])) == "1, 2"
    assert _fmt_option("x", None) == "-" and _fmt_option("x", "chunked") == "chunked"
