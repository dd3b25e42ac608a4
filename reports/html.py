"""Self-contained HTML reports drawn by plotly.js: one file, plotly.js inline, opens offline.

Every report is drawn from rows (reports.digest.summary_row: options, summary metrics, latency
quantile sketches, a binned step timeline), so one run, a folder of runs, a sweep and a capacity
search share the same figures:

- latency CDFs (TTFT, TPOT, ITL, E2E), one line per policy, a menu for the other options;
- throughput against latency across rate scales, one line per policy and budget (sweeps);
- capacity per policy and budget (capacity searches);
- the step timeline of one run: prefill and decode tokens per step, KV blocks used, waiting
  requests (a menu picks the run);
- a table of the numbers.

The figures are plain dicts (plotly.js's JSON), and each one's <div> is the text that
plotly.io.to_html writes for it (`figure_div`), written here without importing plotly (about a
tenth of a replay's start-up); plotly.js is read from the plotly package's files (`plotly_js`).
tests/test_report.py checks both against plotly's own, byte for byte. plotly is imported only in
reports/ (reports/compare_page.py draws with it; import-linter checks it).
"""

from __future__ import annotations

import html
import json
import math
from functools import cache
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING

from reports.axes import AXES, LATER_AXES
from reports.axes import axis_name as _axis_name
from reports.axes import format_axis as _fmt_axis
from reports.digest import TIMELINE, flat_options, make_digest, summary_row
from reports.figures import (
    capacity_figure,
    cdf_figure,
    first_seed,
    fmt,
    is_list,
    replica_figure,
    seed_note,
    throughput_figure,
    timeline_figure,
)
from reports.outcomes import TTFT_PART_LABELS
from reports.run_tables import find_table, read_run_table
from sim.errors import ServesimError
from sim.jsonable import jsonable

if TYPE_CHECKING:
    import pandas as pd  # imported where a page of many rows is drawn: one run's page needs no pandas

TIMELINE_NOTE = "Steps binned by start time; each bin shows the mean per step."
REPLICA_NOTE = ("Requests routed to each replica, the fraction of the time it is busy, its mean KV usage while busy, "
                "and its prefix-cache hit rate.")

# Entry points.

def run_report_files(summary: dict, digest: dict) -> dict[str, str]:
    """digest.json and report.html of one replay, by file name (sim.app.run_folder writes them)."""
    return {"digest.json": json.dumps(jsonable(digest)) + "\n", "report.html": run_report_html(summary, digest)}


def run_report_html(summary: dict, digest: dict | None, measured: dict | None = None) -> str:
    """One replay's report.html; `measured`: its measured.json (a replay of a measured run,
    reports/measured.py), drawn as a table after the numbers."""
    options = summary.get("options", {})
    trace = Path(str(options.get("trace", ""))).name
    scheduler = options.get("scheduler")
    title = f"{scheduler.get('policy', '') if isinstance(scheduler, dict) else ''} on {trace}"
    subtitle = f"{options.get('model', '')} on {options.get('hardware', '')}, {options.get('backend', '')} backend"
    transforms = options.get("trace_transforms")
    if isinstance(transforms, dict) and transforms:  # the trace as the run read it (--limit, --rate-scale, ...)
        subtitle += "; trace " + ", ".join(f"{str(k).replace('_', '-')} {v}" for k, v in transforms.items())
    row = summary_row(summary, digest)
    if row.get("status", "ok") != "ok":  # a failed point: report_html's table of rows names its error
        import pandas as pd

        return report_html(pd.DataFrame([row]), title=title, subtitle=subtitle)
    return _run_page(row, title, subtitle, measured, summary.get("reject_reasons"))


def folder_report_html(directory: str | Path) -> str:
    """The report.html of whatever DIR holds: a sweep, a capacity search, a run, or run folders."""
    return folder_report(directory)[0]


def folder_report(directory: str | Path) -> tuple[str, list[tuple[str, str]]]:
    """The report.html of whatever DIR holds, and what it must warn of: (label, sentence) pairs, each
    to be drawn in a box under the page's title and printed on the terminal (sim.app.report)."""
    from reports.tables import RESULTS, read_table

    d = Path(directory)
    if not d.is_dir():
        raise ServesimError(f"{d}: no such folder")
    # A sweep's folder holds a capacity search's capacity.csv only beside its probes.parquet (a file of that
    # name without them is not servesim's, and a sweep's report leaves it out).
    has_search = (d / "capacity.csv").exists() and ((d / "probes.parquet").exists() or not (d / RESULTS).exists())
    capacity = _read_capacity(d / "capacity.csv") if has_search else None
    if (d / RESULTS).exists():  # a sweep, and the capacity search run into the same folder if any
        rows, _ = read_table(d / RESULTS)
        return report_html(rows, capacity=capacity, title=f"Sweep of {_trace_name(rows)}",
                           subtitle=_grid_description(rows)), _left_out_warning(d, "the sweep's table")
    if capacity is not None:
        rows, _ = read_table(d / "probes.parquet")
        return report_html(rows, capacity=capacity, at_capacity=True, title=f"Capacity on {_trace_name(rows)}",
                           subtitle=f"SLO: {capacity['slo'].iloc[0]}" if len(capacity) else ""), \
            _left_out_warning(d, "the capacity search's tables")
    if (d / "summary.json").exists():
        summary, digest = _read_run(d)
        if digest is None:
            raise ServesimError(f"{d}: holds summary.json but neither digest.json nor the requests and steps tables, "
                                "so there is nothing to draw; replay the trace again into a new folder")
        measured = None
        if (d / "measured.json").exists():
            try:
                measured = json.loads((d / "measured.json").read_text())
            except (OSError, ValueError) as e:
                raise ServesimError(f"{d / 'measured.json'}: cannot read ({type(e).__name__}: {e})") from None
            metrics = measured.get("metrics") if isinstance(measured, dict) else None
            if not (isinstance(metrics, dict) and all(isinstance(m, dict) for m in metrics.values())
                    and isinstance(measured.get("requests", 0), int)):
                raise ServesimError(f"{d / 'measured.json'}: not a comparison sim replay writes (an object with "
                                    "requests and metrics, one object a metric); replay the trace again")
        return run_report_html(summary, digest, measured), _left_out_warning(d, "the run")
    if (d / "compare.json").exists():
        raise ServesimError(f"{d}: a comparison by sim compare; its report.html is sim compare's own page (step times "
                            "predicted against measured, the error figures), which sim report cannot draw again and "
                            f"would replace; sim report {d / 'measured'} or {d / 'predicted'} reports either run")
    if (d / "validate.json").exists() and (d / "validate.csv").exists():
        raise ServesimError(f"{d}: the measured deployments of sim validate; its report.html is sim validate's own "
                            "page (the errors by group and row), written with it, which sim report cannot draw again "
                            "and would replace")
    runs = sorted(p.parent for p in d.glob("*/summary.json"))
    if not runs:
        others = left_out_folders(d)
        raise ServesimError(f"{d}: holds no {RESULTS}, capacity.csv, summary.json or run folders; nothing to report"
                            + (f"; its sub-folder{'s' * (len(others) != 1)} {_listed(others)} "
                               f"{'are' if len(others) != 1 else 'is'} not drawn here. {_how_to_report(d, others)}"
                               if others else ""))
    page, warnings = runs_report(d, runs)
    return page, warnings + _left_out_warning(d, f"the {len(runs)} run folder{'s' * (len(runs) != 1)} directly in it",
                                              runs)


def left_out_folders(d: Path, drawn: list[Path] | tuple[Path, ...] = ()) -> list[tuple[str, str]]:
    """The sub-folders of DIR, but `drawn`, that hold what servesim writes, each (name, what it holds):
    a report of DIR draws only what DIR itself holds (or its run folders, `drawn`), and says what it
    left out (sweeps, capacity searches, comparisons, validations, runs further down)."""
    out, skip = [], set(drawn)
    try:
        subs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".") and p not in skip)
    except OSError:
        return []
    for sub in subs:
        what = _what_folder_holds(sub)
        if what is None:
            try:
                inner = sum(_what_folder_holds(p) is not None for p in sub.iterdir() if p.is_dir())
            except OSError:
                inner = 0
            what = f"a folder of {inner} servesim output folder{'s' * (inner != 1)}" if inner else None
        if what is not None:
            out.append((sub.name, what))
    return out


def _what_folder_holds(d: Path) -> str | None:
    """What servesim output a folder holds, in words (None: none)."""
    from reports.tables import RESULTS

    if (d / "compare.json").exists():
        return "a comparison by sim compare"
    if (d / RESULTS).exists():
        return "a sweep"
    if (d / "capacity.csv").exists() or (d / "probes.parquet").exists():
        return "a capacity search"
    if (d / "validate.json").exists() or (d / "validate.csv").exists():
        return "a validation by sim validate"
    if (d / "summary.json").exists():
        return "a run"
    try:
        runs = sum(1 for _ in d.glob("*/summary.json"))
    except OSError:
        return None
    return f"a folder of {runs} run{'s' * (runs != 1)}" if runs else None


def _listed(folders: list[tuple[str, str]]) -> str:
    return ", ".join(f"{name}/ ({what})" for name, what in folders)


def _left_out_warning(d: Path, drawn_what: str, drawn: list[Path] | tuple[Path, ...] = ()) -> list[tuple[str, str]]:
    """The warning naming the sub-folders a report of DIR leaves out, if any."""
    others = left_out_folders(d, drawn)
    if not others:
        return []
    return [("Left out", f"left out {len(others)} sub-folder{'s' * (len(others) != 1)}, {_listed(others)}: this "
                         f"page draws {drawn_what} only. {_how_to_report(d, others)}")]


# Folders whose page their own command wrote, which `sim report` does not draw again: their report.html is it.
OWN_PAGES = {"a comparison by sim compare": "a comparison's", "a validation by sim validate": "a validation's"}


def _how_to_report(d: Path, others: list[tuple[str, str]]) -> str:
    """How to report the folders left out: `sim report` of each, but a comparison's or a validation's
    page is its own report.html (found by a review: a validation was pointed at `sim report`, which
    refuses it)."""
    reportable = [name for name, what in others if what not in OWN_PAGES]
    own = [(name, what) for name, what in others if what in OWN_PAGES]
    kinds = " and ".join(dict.fromkeys(OWN_PAGES[what] for _, what in own))
    pages = f"{kinds} page{'s are their' if len(own) > 1 else ' is its'} own report.html"
    if not reportable:
        return f"{pages[0].upper()}{pages[1:]} ({d / own[0][0] / 'report.html'}{', ...' if len(own) > 1 else ''})."
    tail = f"; {pages} ({d / own[0][0] / 'report.html'}{', ...' if len(own) > 1 else ''})" if own else ""
    return f"Report each on its own (sim report {d / reportable[0]}{', ...' if len(reportable) > 1 else ''}{tail})."


def runs_report(d: Path, runs: list[Path]) -> tuple[str, list[tuple[str, str]]]:
    """The page comparing the run folders `runs` of DIR, and its warnings. Every option in which the runs
    differ is a column of the table (and named under the title), so that a difference of model, hardware,
    TP, dtype, backend or trace is never read as the policy's. Runs of different traces are drawn, each
    run's trace named; the latency CDFs show one trace at a time, and the page and the terminal warn."""
    import pandas as pd

    read = [(run, *_read_run(run)) for run in runs]
    options = [summary.get("options") if isinstance(summary.get("options"), dict) else {} for _, summary, _ in read]
    differ = differing_options(options)
    flat = [flat_options(o) for o in options]
    # The options' own values (a summary key of the same flat name must not stand in for one).
    rows = pd.DataFrame([summary_row(summary, digest) | {name: f.get(name) for name in differ} | {"run": run.name}
                         for (run, summary, digest), f in zip(read, flat)])
    what = (f"The runs differ in {', '.join(differ)}: a column each in the table of numbers." if differ else
            "The runs' options are the same.")
    warnings = []
    if "trace" in differ:
        warnings.append(("Different traces", different_traces_note([run.name for run in runs],
                                                                   [f.get("trace") for f in flat])))
    page = report_html(rows, title=f"{len(runs)} run{'s' * (len(runs) != 1)} in {d}", subtitle=what,
                       label_column="run", option_columns=differ)
    return page, warnings


def differing_options(options: list[dict]) -> list[str]:
    """The options (by flat_options' names: policy, model, tp, trace, trace_transforms_limit...) whose
    values are not the same in every run, an option a run does not record counting as a value (but an
    axis added since, LATER_AXES, which a run written before it ran at its unset value): the trace and
    its transforms first, then the sweep axes, then the rest as the runs list them."""
    flat = [flat_options(o) for o in options]
    names = list(dict.fromkeys(name for f in flat for name in f))
    missing = object()

    def same(value) -> str:
        return "\0missing" if value is missing else json.dumps(jsonable(value), sort_keys=True)

    differ = [n for n in names if len({same(f.get(n, LATER_AXES.get(n, missing))) for f in flat}) > 1]
    axes = list(AXES)

    def rank(name: str) -> tuple[int, int]:
        first = (0 if name == "trace" else 1 if name.startswith("trace_") else
                 2 + axes.index(name) if name in AXES else 2 + len(axes))
        return first, names.index(name)

    return sorted(differ, key=rank)


def different_traces_note(runs: list[str], traces: list) -> str:
    """The sentence that says runs replay different traces, naming each trace and its runs."""
    by_trace: dict[str, list[str]] = {}
    for run, trace in zip(runs, traces):
        by_trace.setdefault("(none recorded)" if trace is None else str(trace), []).append(run)
    parts = []
    for trace, names in by_trace.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{shown} {'replays' if len(names) == 1 else 'replay'} {trace}")
    return (f"these runs replay {len(by_trace)} different traces ({'; '.join(parts)}): their latencies differ by "
            "workload as well as by options. The latency CDFs show one trace at a time (the menu picks it) and the "
            "table names each run's trace.")


CAPACITY_COLUMNS = ("point", "slo", "status", "capacity_request_rate")  # what the capacity sections draw from


def _read_capacity(path: Path):
    """A capacity search's capacity.csv (sim.app.capacity_cli), refused naming it when it is not one."""
    import pandas as pd

    try:
        capacity = pd.read_csv(path)
    except (OSError, ValueError) as e:  # pandas' parser and empty-file errors are ValueErrors; so is bad UTF-8
        raise ServesimError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    missing = [c for c in CAPACITY_COLUMNS if c not in capacity]
    if missing or not pd.api.types.is_numeric_dtype(capacity["capacity_request_rate"]):
        what = f"no {', '.join(missing)} column" if missing else "capacity_request_rate is not all numbers"
        raise ServesimError(f"{path}: not the capacity.csv sim capacity writes ({what}); run the search again "
                            "with --resume")
    return capacity


def _read_run(d: Path) -> tuple[dict, dict | None]:
    summary, digest = _read_run_files(d)
    # A summary.json or digest.json of another shape (edited, or another program's) is named here, not
    # met as a KeyError deep in the drawing: its row is what every page draws from.
    for name, value in (("summary.json", summary), ("digest.json", digest)):
        if value is not None and not isinstance(value, dict):
            raise ServesimError(f"{d / name}: not the JSON object servesim writes (a {type(value).__name__}); "
                                "replay the trace again into a new folder")
    try:
        row = summary_row(summary, digest)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ServesimError(f"{d}: summary.json or digest.json is not as servesim writes it ({type(e).__name__}: "
                            f"{e}); replay the trace again into a new folder") from None
    # The figures the page prints as numbers: text or a list there was an internal error (ValueError in fmt).
    for key, value in row.items():
        if (key in _COUNT_KEYS or key.endswith(_STAT_SUFFIXES)) and value is not None \
                and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ServesimError(f"{d / 'summary.json'}: {key} = {_short(value)}, not a number as servesim writes "
                                "it; replay the trace again into a new folder")
    # The digest's curves (quantiles, each metric's (null: no such latency), the timeline's series), drawn as
    # numbers: a list of text, or a timeline's series null, was an internal error (ValueError, TypeError).
    series = [] if digest is None else [
        *((name, values) for name, values in digest.items() if name != "timeline" and values is not None),
        *((f"timeline's {name}", values) for name, values in digest["timeline"].items())]
    for name, values in series:
        if not isinstance(values, list) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            raise ServesimError(f"{d / 'digest.json'}: {name} = {_short(values)}, not the list of numbers servesim "
                                "writes; replay the trace again into a new folder")
    # Lengths: a sketch is drawn against the quantile levels, a timeline's series against its bins' starts;
    # one cut short (or of other levels) was drawn against the first of them, silently.
    if digest is not None:
        from reports.digest import QUANTILES

        for name, values in series:
            if name.startswith("timeline's "):
                want, what = len(digest["timeline"].get("start_s") or []), "one a bin of the timeline's start_s"
            else:
                want, what = len(QUANTILES), "one a quantile level"
            if len(values) != want:
                raise ServesimError(f"{d / 'digest.json'}: {name} holds {len(values)} values, not {want} ({what}); "
                                    "replay the trace again into a new folder")
    return summary, digest


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_run_files(d: Path) -> tuple:
    def read_json(name: str):
        try:
            return json.loads((d / name).read_text())
        except (OSError, ValueError) as e:  # (which file: a cut summary.json and digest.json read alike)
            raise ServesimError(f"{d / name}: cannot read ({type(e).__name__}: {e}); replay the trace again into a "
                                "new folder") from None

    summary = read_json("summary.json")
    try:
        if (d / "digest.json").exists():
            return summary, read_json("digest.json")
        if find_table(d, "requests") and find_table(d, "steps"):  # a run from before digest.json
            steps = read_run_table(d, "steps", ["start_s", *TIMELINE])
            requests = read_run_table(d, "requests")
            expected = summary.get("num_requests") if isinstance(summary, dict) else None
            if isinstance(expected, int) and len(requests) != expected:  # cut short, or another run's
                rows = f"{len(requests):,} row{'s' * (len(requests) != 1)}"
                raise ServesimError(f"{find_table(d, 'requests')}: {rows}, but summary.json counts {expected:,} "
                                    "requests; replay the trace again into a new folder")
            return summary, make_digest(requests, None,
                                        {name: steps[name].to_numpy() for name in ("start_s", *TIMELINE)})
    except (OSError, ValueError, KeyError) as e:
        raise ServesimError(f"{d}: cannot read the run ({type(e).__name__}: {e})") from None
    return summary, None


# The report.

def report_html(rows: pd.DataFrame, capacity: pd.DataFrame | None = None, at_capacity: bool = False,
                title: str = "servesim report", subtitle: str = "", label_column: str | None = None,
                option_columns: list[str] | tuple[str, ...] = ()) -> str:
    """The whole page. `rows`: one per run (sweep rows or summary_row); `capacity`: one per searched
    configuration, with the probe row at capacity named in its `point` column; `at_capacity`: the
    rows are that search's probes, and the CDFs and timelines show the probes at capacity;
    `option_columns`: options in which the rows differ, a column each in the table (runs_report's),
    and the latency CDFs and rate curves one trace at a time where `trace` is one of them."""
    ok = rows[rows["status"] == "ok"] if "status" in rows else rows
    swept = [a for a in AXES if a in rows and rows[a].astype(str).nunique() > 1]
    by_trace = ["trace"] if "trace" in option_columns else []  # different traces are never drawn as one
    sections = []
    has_capacity = capacity is not None and len(capacity) > 0
    if has_capacity:
        sections.append(_section("Capacity per policy and budget", capacity_figure(capacity),
                                 "The highest request rate meeting the SLO: " + html.escape(str(capacity["slo"].iloc[0]))))
    if has_capacity and at_capacity:
        focus = ok[ok["point"].isin(capacity["point"].dropna())]
        group_by = [a for a in swept if a not in ("policy", "rate_scale", "seed")]
        sections.append(_section("Latency CDFs at capacity", cdf_figure(focus, group_by, label_column)))
    else:
        focus = first_seed(ok)
        group_by = by_trace + [a for a in swept if a not in ("policy", "seed")]
        sections.append(_section("Latency CDFs", cdf_figure(focus, group_by, label_column),
                                 seed_note(ok, by_trace + swept)))
    if "rate_scale" in swept:
        sections.append(_section("Throughput against latency across rates",
                                 throughput_figure(ok, by_trace + [a for a in swept if a not in ("rate_scale", "seed")]),
                                 "One point per rate scale, averaged over seeds; log latency axis."))
    if "timeline_start_s" in focus and len(focus):
        sections.append(_section("Step timeline", timeline_figure(focus, swept, label_column), TIMELINE_NOTE))
    if has_capacity:
        sections.append(f"<h2>Capacity</h2>{_capacity_table(capacity)}")
    if len(rows) == 1 and is_list(rows.iloc[0].get("replica_requests")):
        sections.append(_section("Load per replica", replica_figure(rows.iloc[0]), REPLICA_NOTE))
    if len(rows) == 1 and len(ok) == 1:
        sections.append(_section("TTFT in parts", ttft_parts_figure(rows.iloc[0].to_dict()),
                                 ttft_parts_note(rows.iloc[0].to_dict())))
        sections.append(f"<h2>Numbers</h2>{_stats_table(rows.iloc[0])}")
    else:
        sections.append(f"<h2>Numbers</h2>{_rows_table(rows, swept, label_column, option_columns)}")
    return _page(title, subtitle, plotly_js(), sections)


def _run_page(row: dict, title: str, subtitle: str, measured: dict | None = None,
              reject_reasons: dict | None = None) -> str:
    """report_html of one run that did not fail (its summary_row), to the byte, without pandas: the
    sections report_html draws for a single row; and, for a replay of a measured run, the table of
    `measured` after them. `reject_reasons` (summary.json's): listed under the numbers."""
    rows = [row]
    sections = [_section("Latency CDFs", cdf_figure(rows, [], None), seed_note(rows, []))]
    if "timeline_start_s" in row:
        sections.append(_section("Step timeline", timeline_figure(rows, [], None), TIMELINE_NOTE))
    if is_list(row.get("replica_requests")):
        sections.append(_section("Load per replica", replica_figure(row), REPLICA_NOTE))
    sections.append(_section("TTFT in parts", ttft_parts_figure(row), ttft_parts_note(row)))
    numbers = f"<h2>Numbers</h2>{_stats_table(row)}"
    if isinstance(reject_reasons, dict) and reject_reasons:
        listed = "".join(f'<tr><td class="t">{html.escape(str(why))}</td><td>{html.escape(str(n))}</td></tr>'
                         for why, n in reject_reasons.items())
        numbers += f'<h3>Rejected, by reason</h3><table><tr><th class="t">reason</th><th>requests</th></tr>{listed}</table>'
    sections.append(numbers)
    if measured is not None:
        sections.append(_measured_section(measured))
    return _page(title, subtitle, plotly_js(), sections)


MEASURED_NOTE = ("The replay beside the run's own measurements (measured.json), for the requests finished in both, "
                 "joined on request_id. The measured TTFT and E2E are the benchmark client's (from its send); the "
                 "replay's are from the send too where it modelled vLLM's API server (predicted from: send), else "
                 "the engine's (from its arrival). The network's time is in the measurement alone. server_ttft: the "
                 "server's own TTFT beside the engine's. MAPE: the mean of the per-request absolute percentage "
                 "errors.")
MEASURED_COLUMNS = (("requests", "requests"), ("measured_mean_ms", "measured mean (ms)"),
                    ("predicted_mean_ms", "predicted mean (ms)"), ("mean_error_pct", "error of the mean (%)"),
                    ("measured_p50_ms", "measured p50"), ("predicted_p50_ms", "predicted p50"),
                    ("measured_p99_ms", "measured p99"), ("predicted_p99_ms", "predicted p99"),
                    ("mape_pct", "MAPE (%)"), ("median_ape_pct", "median APE (%)"))


def _measured_section(measured: dict) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in MEASURED_COLUMNS)
    body = "".join(f'<tr><td class="t">{html.escape(str(name))}</td>'
                   + "".join(f"<td>{fmt(values.get(key), 1)}</td>" for key, _ in MEASURED_COLUMNS)
                   + "</tr>" for name, values in measured.get("metrics", {}).items())
    source = html.escape(str(measured.get("source", "")))
    since = html.escape(str(measured.get("predicted_from", "arrival")))
    return (f'<h2>Against the run\'s own measurements</h2><div class="note">{html.escape(MEASURED_NOTE)} '
            f"Source: {source}; {int(measured.get('requests', 0))} requests in both; predicted from: {since}.</div>"
            f'<table><tr><th class="t">metric</th>{head}</tr>{body}</table>')


TTFT_PARTS_NOTE = ("Mean TTFT split into its parts (docs/async-scheduling.md): the API server's share (a client's "
                   "send to the engine's arrival, where a client is modelled), queueing (arrival to first scheduled), "
                   "the wait for the GPU after scheduling (host time before the launch; under asynchronous "
                   "scheduling, the step already queued ahead), and the prefill (the first step's start to the "
                   "first token). Each request's parts add up to its TTFT exactly (requests.csv).")
FROM_SEND_NOTE = (" With an API server modelled, they add up to the TTFT from the client's send (the table's "
                  "'ttft from send'), not to the engine's TTFT (from its arrival).")


def ttft_parts_note(row: dict) -> str:
    client = row.get("client_ttft_mean")
    return TTFT_PARTS_NOTE + (FROM_SEND_NOTE if client is not None and not _is_nan(client) else "")


def ttft_parts_figure(row: dict) -> dict | None:
    """One stacked bar of the run's mean TTFT parts in milliseconds (None when the run has none)."""
    parts = [(name, row.get(f"{name}_mean")) for name in TTFT_PART_LABELS]
    parts = [(name, value) for name, value in parts if value is not None and not _is_nan(value)]
    if not parts:
        return None
    data = [{"type": "bar", "orientation": "h", "name": TTFT_PART_LABELS[name], "x": [value * 1e3],
             "y": ["mean TTFT"], "hovertemplate": f"{TTFT_PART_LABELS[name]}: %{{x:.2f}} ms<extra></extra>"}
            for name, value in parts]
    layout = {"barmode": "stack", "height": 220, "margin": {"l": 90, "r": 20, "t": 10, "b": 40},
              "xaxis": {"title": {"text": "ms"}}, "legend": {"orientation": "h", "y": -0.35}}
    return {"data": data, "layout": layout}


def _page(title: str, subtitle: str, plotly_js: str, sections: list[str]) -> str:
    style = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}"
             "h1{font-size:22px;margin-bottom:2px}h2{font-size:18px;margin-top:28px}"
             ".sub{color:#666;margin-bottom:12px}.note{color:#666;font-size:13px}"
             "table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
             "text-align:right}th{background:#f4f4f4;vertical-align:bottom}td.t,th.t{text-align:left}"
             ".err{color:#b00;text-align:left;min-width:16em;max-width:40em;overflow-wrap:anywhere}"
             # A table wider than the page scrolls inside its box; the page itself never does.
             ".wide{overflow-x:auto;max-width:100%}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{style}</style><script type="text/javascript">{plotly_js}</script></head><body>'
            f'<h1>{html.escape(title)}</h1><div class="sub">{html.escape(subtitle)}</div>'
            + "\n".join(sections) + "</body></html>\n")


def _section(title: str, figure, note: str = "") -> str:
    if figure is None:
        return ""
    figure_id = "figure-" + "".join(c if c.isalnum() else "-" for c in title.lower())
    div = figure_div(figure, figure_id, FIGURE_CONFIG)
    note_html = f'<div class="note">{note}</div>' if note else ""
    return f"<h2>{html.escape(title)}</h2>{note_html}{div}"


# plotly's HTML, without plotly.

FIGURE_CONFIG = {"displaylogo": False, "responsive": True}
# What plotly.io.to_html writes around a figure (plotly/io/_html.py), with no MathJax, no plotly.js
# (the page holds it once), no frames and no post script: the same spaces, the same line joins.
_NEW_PLOT = """\
                if (document.getElementById("{id}")) {{\
                    Plotly.newPlot(\
                        "{id}",\
                        {data},\
                        {layout},\
                        {config}\
                    )\
                }}"""
_DIV = """\
<div style="height:{height}; width:{width};">\
        \
        \
            <div id="{id}" class="plotly-graph-div" \
style="height:100%; width:100%;"></div>\
            <script>\
                window.PLOTLYENV=window.PLOTLYENV || {{}};\
                {script};\
            </script>\
        </div>"""


def figure_div(figure: dict, div_id: str, config: dict | None = None) -> str:
    """plotly.io.to_html(figure, include_plotlyjs=False, full_html=False, validate=False,
    default_width="100%", div_id=div_id, config=config), to the byte, for a figure dict (data
    and layout, no frames)."""
    layout = figure.get("layout", {})
    template = layout.get("template", {}).get("layout", {})
    width = _css_length(layout.get("width", template.get("width", "100%")))
    height = _css_length(layout.get("height", template.get("height", "100%")))
    config = dict(config or {})
    config.setdefault("responsive", True)
    if not config.get("showSendToCloud", False):
        config.pop("plotlyServerURL", None)
    script = _NEW_PLOT.format(id=div_id, data=plotly_json(figure.get("data", [])), layout=plotly_json(layout),
                              config=json.dumps(config))
    return _DIV.format(height=height, width=width, id=div_id, script=script)


def _css_length(value) -> str:
    """A number in pixels, anything else as it is (plotly's rule for the div's width and height)."""
    try:
        float(value)
    except (ValueError, TypeError):
        return value
    return f"{value}px"


def plotly_json(value) -> str:
    """plotly.io.json.to_json_plotly(value) as plotly writes it without orjson: compact JSON, NaN
    and infinities as null, arrays and numpy numbers as lists and numbers, and <, > and / escaped
    so that the text cannot end its <script>."""
    text = json.dumps(value, separators=(",", ":"), default=_as_list)
    if "NaN" in text or "Infinity" in text:  # plotly's check: a string holding either word is read again too
        text = json.dumps(json.loads(text, parse_constant=lambda _: None), separators=(",", ":"))
    for unsafe, safe in (("<", "\\u003c"), (">", "\\u003e"), ("/", "\\u002f")):
        if unsafe in text:
            text = text.replace(unsafe, safe)
    return text


def _as_list(value):
    """What plotly's JSON encoder makes of a value json cannot write: an array or a numpy number via
    tolist()."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


@cache
def plotly_js() -> str:
    """plotly.js, as plotly.offline.get_plotlyjs() returns it: the plotly package's
    package_data/plotly.min.js, read without importing plotly."""
    from importlib.util import find_spec

    spec = find_spec("plotly")  # finds the package without running its __init__
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec and spec.origin else None
    if path is None or not path.is_file():  # plotly installed some other way (a zip): let it say
        from plotly.offline import get_plotlyjs

        return get_plotlyjs()
    return path.read_bytes().decode("utf-8")


# Figures: plain dicts (plotly.js's JSON), because plotly's figure objects validate every property
# and cost a few hundred milliseconds per figure.

def _rows_table(rows: pd.DataFrame, swept: list[str], label_column: str | None,
                option_columns: list[str] | tuple[str, ...] = ()) -> str:
    varying = [*option_columns, *(a for a in swept if a not in option_columns)]
    columns = ([label_column] if label_column else []) + (varying or [a for a in ("policy",) if a in rows])
    metrics = [("request_rate", "offered req/s", 1), ("request_throughput", "req/s", 1),
               ("output_throughput", "output tok/s", 1), ("ttft_p50", "p50 TTFT ms", 1e3),
               ("ttft_p99", "p99 TTFT ms", 1e3), ("tpot_p50", "p50 TPOT ms", 1e3),
               ("itl_p99", "p99 ITL ms", 1e3), ("e2e_p99", "p99 E2E ms", 1e3),
               ("scheduling_delay_p50", "p50 delay ms", 1e3), ("preemptions", "preemptions", 1),
               ("goodput", "goodput req/s", 1)]
    metrics = [m for m in metrics if m[0] in rows and rows[m[0]].notna().any()]
    if "rejected" in rows and any(isinstance(n, Real) and n > 0 for n in rows["rejected"]):
        # The requests a run rejected (HTTP 503 under the admission limits, too long) are in none of its
        # figures: a run that shed most of its load shows low latencies beside one that served it all.
        names = [m[0] for m in metrics]
        at = names.index("request_throughput") + 1 if "request_throughput" in names else 0
        metrics.insert(at, ("rejected", "rejected", 1))
    head = "".join(f'<th class="t">{html.escape(_axis_name(c))}</th>' for c in columns)
    head += "".join(f"<th>{html.escape(name)}</th>" for _, name, _ in metrics)
    has_errors = "status" in rows and (rows["status"] != "ok").any()
    if has_errors:
        head += '<th class="t">error</th>'
    body = []
    for _, row in rows.head(2000).iterrows():
        cells = "".join(f'<td class="t">{html.escape(_fmt_option(c, row.get(c)))}</td>' for c in columns)
        cells += "".join(f"<td>{fmt(row.get(name), scale)}</td>" for name, _, scale in metrics)
        if has_errors:
            cells += f'<td class="t err">{html.escape(str(row.get("error") or ""))}</td>'
        body.append(f"<tr>{cells}</tr>")
    return f"<div class=\"wide\"><table><tr>{head}</tr>{''.join(body)}</table></div>"


def _fmt_option(column: str, value) -> str:
    """A table cell of an axis ('budget 256') or another option (as recorded; '-' where not recorded): a
    whole number a table read back as a float (pandas' column with a blank) as the whole number, a list
    as its items ('960, -'), not Python's spelling of them."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if column in AXES:
        return _fmt_axis(column, value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    if isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and not isinstance(value, (str, bytes))):
        items = value.tolist() if hasattr(value, "tolist") else value
        if isinstance(items, list):
            return ", ".join(_fmt_option(column, item) for item in items) or "-"
    return str(value)


_COUNTS = (("requests", "num_requests"), ("completed", "completed"), ("rejected", "rejected"),
           ("preemptions", "preemptions"), ("steps", "num_steps"), ("duration s", "duration_s"),
           ("req/s", "request_throughput"), ("output tok/s", "output_throughput"),
           ("total tok/s", "total_token_throughput"), ("goodput req/s", "goodput"))
_COUNT_KEYS = {key for _, key in _COUNTS} | {"simulated_s", "total_prompt_tokens", "total_output_tokens",
                                              "prefix_cache_hit_rate"}
_STAT_SUFFIXES = tuple(f"_{stat}" for stat in ("mean", "p50", "p90", "p99"))


_WHOLE_COUNTS = frozenset({"num_requests", "completed", "rejected", "preemptions", "num_steps"})
_RUN_SHARES = (("prefix cache hits %", "prefix_cache_hit_rate"), ("SLO attainment %", "slo_attainment"))


def _stats_table(row) -> str:
    """One run: counts, throughputs, its prefix-cache hit rate and SLO attainment (percent), and every
    latency's mean and percentiles in milliseconds."""
    counts = [(name, key, 1) for name, key in _COUNTS if row.get(key) is not None and not _is_nan(row.get(key))]
    counts += [(name, key, 100) for name, key in _RUN_SHARES if row.get(key) is not None and not _is_nan(row.get(key))]

    def cell(key, scale) -> str:
        value = row.get(key)
        if key in _WHOLE_COUNTS and isinstance(value, Real) and float(value).is_integer():
            return str(int(value))  # a count, not a float
        return fmt(value, scale)
    first = "".join(f"<th>{html.escape(name)}</th>" for name, _, _ in counts)
    values = "".join(f"<td>{cell(key, scale)}</td>" for _, key, scale in counts)
    lines = [f"<table><tr>{first}</tr><tr>{values}</tr></table><br>",
             '<table><tr><th class="t">ms</th>' + "".join(f"<th>{s}</th>" for s in ("mean", "p50", "p90", "p99"))
             + "</tr>"]
    # With an API server, TTFT and E2E from the client's send too (the parts add up to the TTFT from the send);
    # with --stream-interval above 1, the ITL between the chunks the client receives.
    for metric in ("ttft", "client_ttft", *(f"  {p}" for p in TTFT_PART_LABELS), "tpot", "itl", "client_itl", "e2e",
                   "client_e2e", "scheduling_delay"):
        key = metric.strip()
        if (key != metric or key.startswith("client_")) and row.get(f"{key}_mean") is None:
            continue  # a part the run does not report (a run from before the parts; no API server)
        cells = "".join(f"<td>{fmt(row.get(f'{key}_{stat}'), 1e3)}</td>" for stat in ("mean", "p50", "p90", "p99"))
        label = (f"&nbsp;&nbsp;{html.escape(TTFT_PART_LABELS[key])}" if key != metric else
                 "itl per chunk" if key == "client_itl" else
                 f"{key.removeprefix('client_')} from send" if key.startswith("client_") else metric)
        lines.append(f'<tr><td class="t">{label}</td>{cells}</tr>')
    return "".join(lines) + "</table>"


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _capacity_table(capacity: pd.DataFrame) -> str:
    columns = [c for c in capacity.columns if c not in ("point", "slo", "trace")
               and not (c in AXES and c != "policy" and capacity[c].astype(str).nunique() == 1)]
    head = "".join(f"<th>{html.escape(c.replace('_', ' '))}</th>" for c in columns)  # names wrap at spaces
    body = "".join("<tr>" + "".join(f'<td{_cell_class(c)}>{html.escape(_fmt_cell(row[c]))}</td>' for c in columns)
                   + "</tr>" for _, row in capacity.iterrows())
    return f'<div class="wide"><table><tr>{head}</tr>{body}</table></div>'


def _cell_class(column: str) -> str:
    return ' class="err"' if column == "error" else ' class="t"' if column in ("policy", "status") else ""


# Helpers.


def _fmt_cell(value) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _trace_name(rows: pd.DataFrame) -> str:
    return Path(str(rows["trace"].iloc[0])).name if "trace" in rows and len(rows) else "a trace"


def _grid_description(rows: pd.DataFrame) -> str:
    plural = {"policy": "policies", "max_num_seqs": "max seqs values"}
    parts = [f"{rows[a].nunique()} {plural.get(a, _axis_name(a) + 's')}" for a in AXES
             if a in rows and rows[a].nunique() > 1]
    failed = int((rows["status"] != "ok").sum()) if "status" in rows else 0
    first = rows.iloc[0]
    return (f"{len(rows)} points ({' x '.join(parts) or 'one point'}), {first.get('model')} on "
            f"{first.get('hardware')}" + (f"; {failed} failed" if failed else ""))
