"""Self-contained HTML reports with plotly: one file, plotly.js inline, opens offline.

Every report is drawn from rows (reports.digest.summary_row: options, summary metrics, latency
quantile sketches, a binned step timeline), so one run, a folder of runs, a sweep and a capacity
search share the same figures:

- latency CDFs (TTFT, TPOT, ITL, E2E), one line per policy, a menu for the other options;
- throughput against latency across rate scales, one line per policy and budget (sweeps);
- capacity per policy and budget (capacity searches);
- the step timeline of one run: prefill and decode tokens per step, KV blocks used, waiting
  requests (a menu picks the run);
- a table of the numbers.

plotly is imported only here.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from reports.digest import QUANTILES, TIMELINE, make_digest, run_digest, summary_row
from sim.errors import ServesimError

AXES = ("policy", "model", "hardware", "max_num_batched_tokens", "max_num_seqs", "rate_scale", "seed")
POLICY_COLORS = {"decode-first": "#1f77b4", "prefill-first": "#d62728", "chunked": "#2ca02c"}
OTHER_COLORS = ("#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL (time between tokens)"), ("e2e", "E2E latency"))
TIMELINE_TITLES = ("prefill tokens per step", "decode tokens per step", "KV blocks used", "waiting requests")
MAX_MENU_ENTRIES = 48  # a menu longer than this shows its first entries only
_TEMPLATE = {"layout": {"plot_bgcolor": "#f5f6f8", "paper_bgcolor": "white", "font": {"size": 12},
                        "xaxis": {"gridcolor": "white"}, "yaxis": {"gridcolor": "white"}}}


# Entry points.

def write_run_report(out: Path, result, requests: pd.DataFrame, summary: dict) -> None:
    """digest.json and report.html of one replay (called by sim.app.replay.write_run)."""
    digest = run_digest(result, requests)
    (out / "digest.json").write_text(json.dumps(_nulls(digest)) + "\n")
    (out / "report.html").write_text(run_report_html(summary, digest))


def run_report_html(summary: dict, digest: dict | None) -> str:
    options = summary.get("options", {})
    trace = Path(str(options.get("trace", ""))).name
    title = f"{options.get('scheduler', {}).get('policy', '')} on {trace}"
    subtitle = f"{options.get('model', '')} on {options.get('hardware', '')}, {options.get('backend', '')} backend"
    return report_html(pd.DataFrame([summary_row(summary, digest)]), title=title, subtitle=subtitle)


def write_report(directory: str | Path) -> Path:
    """Write DIR/report.html for whatever DIR holds: a sweep, a capacity search, a run, or run folders."""
    from reports.tables import RESULTS, read_table

    d = Path(directory)
    if not d.is_dir():
        raise ServesimError(f"{d}: no such folder")
    capacity = pd.read_csv(d / "capacity.csv") if (d / "capacity.csv").exists() else None
    if (d / RESULTS).exists():  # a sweep, and the capacity search run into the same folder if any
        rows, _ = read_table(d / RESULTS)
        text = report_html(rows, capacity=capacity, title=f"Sweep of {_trace_name(rows)}",
                           subtitle=_grid_description(rows))
    elif capacity is not None:
        rows, _ = read_table(d / "probes.parquet")
        text = report_html(rows, capacity=capacity, at_capacity=True, title=f"Capacity on {_trace_name(rows)}",
                           subtitle=f"SLO: {capacity['slo'].iloc[0]}" if len(capacity) else "")
    elif (d / "summary.json").exists():
        summary, digest = _read_run(d)
        text = run_report_html(summary, digest)
    else:
        runs = sorted(p.parent for p in d.glob("*/summary.json"))
        if not runs:
            raise ServesimError(f"{d}: holds no {RESULTS}, capacity.csv, summary.json or run folders; "
                                "nothing to report")
        rows = pd.DataFrame([summary_row(*_read_run(run)) | {"run": run.name} for run in runs])
        text = report_html(rows, title=f"{len(runs)} runs in {d}", label_column="run")
    out = d / "report.html"
    out.write_text(text)
    return out


def _read_run(d: Path) -> tuple[dict, dict | None]:
    try:
        summary = json.loads((d / "summary.json").read_text())
        if (d / "digest.json").exists():
            return summary, json.loads((d / "digest.json").read_text())
        if (d / "requests.csv").exists() and (d / "steps.csv").exists():  # a run from before digest.json
            steps = pd.read_csv(d / "steps.csv")
            return summary, make_digest(pd.read_csv(d / "requests.csv"), None,
                                        {name: steps[name].to_numpy() for name in ("start_s", *TIMELINE)})
    except (OSError, ValueError, KeyError) as e:
        raise ServesimError(f"{d}: cannot read the run ({type(e).__name__}: {e})") from None
    return summary, None


# The report.

def report_html(rows: pd.DataFrame, capacity: pd.DataFrame | None = None, at_capacity: bool = False,
                title: str = "servesim report", subtitle: str = "", label_column: str | None = None) -> str:
    """The whole page. `rows`: one per run (sweep rows or summary_row); `capacity`: one per searched
    configuration, with the probe row at capacity named in its `point` column; `at_capacity`: the
    rows are that search's probes, and the CDFs and timelines show the probes at capacity."""
    from plotly.offline import get_plotlyjs

    ok = rows[rows["status"] == "ok"] if "status" in rows else rows
    swept = [a for a in AXES if a in rows and rows[a].astype(str).nunique() > 1]
    sections = []
    has_capacity = capacity is not None and len(capacity) > 0
    if has_capacity:
        sections.append(_section("Capacity per policy and budget", _capacity_figure(capacity),
                                 "The highest request rate meeting the SLO: " + html.escape(str(capacity["slo"].iloc[0]))))
    if has_capacity and at_capacity:
        focus = ok[ok["point"].isin(capacity["point"].dropna())]
        group_by = [a for a in swept if a not in ("policy", "rate_scale", "seed")]
        sections.append(_section("Latency CDFs at capacity", _cdf_figure(focus, group_by, label_column)))
    else:
        focus = _first_seed(ok)
        group_by = [a for a in swept if a not in ("policy", "seed")]
        sections.append(_section("Latency CDFs", _cdf_figure(focus, group_by, label_column),
                                 _seed_note(ok, swept)))
    if "rate_scale" in swept:
        sections.append(_section("Throughput against latency across rates",
                                 _throughput_figure(ok, [a for a in swept if a not in ("rate_scale", "seed")]),
                                 "One point per rate scale, averaged over seeds; log latency axis."))
    if "timeline_start_s" in focus and len(focus):
        sections.append(_section("Step timeline", _timeline_figure(focus, swept, label_column),
                                 "Steps binned by start time; each bin shows the mean per step."))
    if has_capacity:
        sections.append(f"<h2>Capacity</h2>{_capacity_table(capacity)}")
    if len(rows) == 1 and len(ok) == 1:
        sections.append(f"<h2>Numbers</h2>{_stats_table(rows.iloc[0])}")
    else:
        sections.append(f"<h2>Numbers</h2>{_rows_table(rows, swept, label_column)}")
    return _page(title, subtitle, get_plotlyjs(), sections)


def _page(title: str, subtitle: str, plotly_js: str, sections: list[str]) -> str:
    style = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}"
             "h1{font-size:22px;margin-bottom:2px}h2{font-size:18px;margin-top:28px}"
             ".sub{color:#666;margin-bottom:12px}.note{color:#666;font-size:13px}"
             "table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
             "text-align:right}th{background:#f4f4f4}td.t,th.t{text-align:left}.err{color:#b00}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{style}</style><script type="text/javascript">{plotly_js}</script></head><body>'
            f'<h1>{html.escape(title)}</h1><div class="sub">{html.escape(subtitle)}</div>'
            + "\n".join(sections) + "</body></html>\n")


def _section(title: str, figure, note: str = "") -> str:
    import plotly.io as pio

    if figure is None:
        return ""
    figure_id = "figure-" + "".join(c if c.isalnum() else "-" for c in title.lower())
    div = pio.to_html(figure, include_plotlyjs=False, full_html=False, validate=False, default_width="100%",
                      div_id=figure_id, config={"displaylogo": False, "responsive": True})
    note_html = f'<div class="note">{note}</div>' if note else ""
    return f"<h2>{html.escape(title)}</h2>{note_html}{div}"


# Figures: plain dicts (plotly.js's JSON), because plotly's figure objects validate every property
# and cost a few hundred milliseconds per figure.

def _grid(num_rows: int, num_cols: int, titles: list[str], shared_x: bool = False, gap_x: float = 0.07,
          gap_y: float = 0.18) -> dict:
    """A layout of num_rows x num_cols subplots; subplot i (row-major, from 0) uses axes x{i+1}, y{i+1}."""
    layout: dict = {"annotations": [], "template": _TEMPLATE}
    width = (1 - gap_x * (num_cols - 1)) / num_cols
    height = (1 - gap_y * (num_rows - 1)) / num_rows
    for i in range(num_rows * num_cols):
        r, c = divmod(i, num_cols)
        x0, y1 = c * (width + gap_x), 1 - r * (height + gap_y)
        suffix = "" if i == 0 else str(i + 1)
        layout[f"xaxis{suffix}"] = {"domain": [x0, x0 + width], "anchor": f"y{suffix}"}
        layout[f"yaxis{suffix}"] = {"domain": [y1 - height, y1], "anchor": f"x{suffix}"}
        if shared_x and i > 0:
            layout[f"xaxis{suffix}"]["matches"] = "x"
        if shared_x and r < num_rows - 1:
            layout[f"xaxis{suffix}"]["showticklabels"] = False
        if i < len(titles):
            layout["annotations"].append({"text": titles[i], "x": x0 + width / 2, "y": y1, "xref": "paper",
                                          "yref": "paper", "xanchor": "center", "yanchor": "bottom",
                                          "showarrow": False, "font": {"size": 14}})
    return layout


def _axes(i: int) -> dict:
    suffix = "" if i == 0 else str(i + 1)
    return {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}


def _cdf_figure(rows: pd.DataFrame, group_by: list[str], label_column: str | None) -> dict | None:
    if not len(rows):
        return None
    layout = _grid(2, 2, [title for _, title in CDF_METRICS])
    y = (QUANTILES / 100.0).tolist()
    groups = _groups(rows, group_by)
    traces, trace_groups = [], []
    for g, (_, group) in enumerate(groups):
        for r, (_, row) in enumerate(group.iterrows()):
            label = _label(row, label_column)
            for k, (metric, _) in enumerate(CDF_METRICS):
                sketch = row.get(f"{metric}_quantiles")
                if not _is_list(sketch):
                    continue
                traces.append({"type": "scatter", "mode": "lines", "x": _finite(sketch), "y": y, "name": label,
                               "legendgroup": label, "showlegend": k == 0, "visible": g == 0,
                               "line": {"color": _color(row, r), "width": 2},
                               "hovertemplate": "%{x:.4g} s: %{y:.1%}<extra>" + html.escape(label) + "</extra>",
                               **_axes(k)})
                trace_groups.append(g)
    for k in range(4):
        suffix = "" if k == 0 else str(k + 1)
        layout[f"xaxis{suffix}"].update(type="log", title={"text": "seconds"})
        layout[f"yaxis{suffix}"].update(range=[0, 1.01], title={"text": "fraction" if k % 2 == 0 else ""})
    layout.update(height=700, margin={"t": 70, "b": 40}, legend={"orientation": "h", "y": -0.1},
                  updatemenus=_menu([name for name, _ in groups], trace_groups))
    return {"data": traces, "layout": layout}


def _throughput_figure(rows: pd.DataFrame, series_by: list[str]) -> dict | None:
    metrics = (("itl_p99", "P99 time between tokens"), ("scheduling_delay_p50", "median scheduling delay"),
               ("ttft_p99", "P99 TTFT"), ("e2e_p99", "P99 E2E latency"))
    rows = rows[[c for c in rows.columns if not c.endswith("_quantiles") and not c.startswith("timeline_")]]
    means = rows.groupby(series_by + ["rate_scale"], dropna=False, sort=False).mean(numeric_only=True).reset_index()
    if not len(means):
        return None
    layout = _grid(2, 2, [title for _, title in metrics])
    budgets = sorted(means["max_num_batched_tokens"].unique()) if "max_num_batched_tokens" in means else []
    traces = []
    for s, (_, series) in enumerate(_groups(means, series_by, limit=None)):
        series = series.sort_values("rate_scale")
        first = series.iloc[0]
        label = _label(first, None, series_by) or "all"
        dash = DASHES[budgets.index(first["max_num_batched_tokens"]) % len(DASHES)] if budgets else "solid"
        hover = [f"rate ×{scale:g}" for scale in series["rate_scale"]]
        for k, (metric, _) in enumerate(metrics):
            if metric not in series:
                continue
            traces.append({"type": "scatter", "mode": "lines+markers", "x": _finite(series["request_throughput"]),
                           "y": _finite(series[metric]), "name": label, "legendgroup": label, "showlegend": k == 0,
                           "text": hover, "line": {"color": _color(first, s), "dash": dash},
                           "hovertemplate": "%{x:.2f} req/s, %{y:.4g} s, %{text}<extra>" + html.escape(label)
                                            + "</extra>", **_axes(k)})
    for k in range(4):
        suffix = "" if k == 0 else str(k + 1)
        layout[f"xaxis{suffix}"]["title"] = {"text": "request throughput (req/s)"}
        layout[f"yaxis{suffix}"].update(type="log", title={"text": "seconds" if k % 2 == 0 else ""})
    layout.update(height=700, margin={"t": 40, "b": 40}, legend={"orientation": "h", "y": -0.12})
    return {"data": traces, "layout": layout}


def _capacity_figure(capacity: pd.DataFrame) -> dict:
    config_axes = [a for a in AXES if a in capacity and a not in ("policy", "rate_scale")
                   and capacity[a].astype(str).nunique() > 1]
    traces = []
    groups = capacity.groupby("policy", sort=False) if "policy" in capacity else [("", capacity)]
    for p, (policy, group) in enumerate(groups):
        x = [_label(row, None, config_axes) or str(policy) for _, row in group.iterrows()]
        y = _finite(group["capacity_request_rate"])
        text = [f"{v:.2f}" if v is not None else str(status) for v, status in zip(y, group["status"])]
        traces.append({"type": "bar", "x": x, "y": [v or 0 for v in y], "name": str(policy), "text": text,
                       "textposition": "outside",
                       "marker": {"color": POLICY_COLORS.get(str(policy), OTHER_COLORS[p % len(OTHER_COLORS)])},
                       "hovertemplate": "%{x}: %{y:.3f} req/s<extra>" + html.escape(str(policy)) + "</extra>"})
    layout = {"template": _TEMPLATE, "barmode": "group", "height": 440, "margin": {"t": 30, "b": 40},
              "yaxis": {"title": {"text": "capacity (requests/s)"}},
              "xaxis": {"title": {"text": ", ".join(_axis_name(a) for a in config_axes) or "policy"}}}
    return {"data": traces, "layout": layout}


def _timeline_figure(rows: pd.DataFrame, swept: list[str], label_column: str | None) -> dict:
    layout = _grid(4, 1, list(TIMELINE_TITLES), shared_x=True, gap_y=0.06)
    labels, traces, trace_groups = [], [], []
    for _, row in rows.head(MAX_MENU_ENTRIES).iterrows():
        x = row.get("timeline_start_s")
        if not _is_list(x):
            continue
        labels.append(_label(row, label_column, [a for a in swept if a != "seed"]))
        for k, name in enumerate(TIMELINE):
            traces.append({"type": "scatter", "mode": "lines", "x": _finite(x), "y": _finite(row[f"timeline_{name}"]),
                           "name": TIMELINE_TITLES[k], "showlegend": False, "visible": len(labels) == 1,
                           "line": {"color": OTHER_COLORS[k], "width": 1.5}, **_axes(k)})
            trace_groups.append(len(labels) - 1)
    layout["xaxis4"]["title"] = {"text": "simulated seconds"}
    layout.update(height=740, margin={"t": 70, "b": 40}, updatemenus=_menu(labels, trace_groups))
    return {"data": traces, "layout": layout}


def _menu(labels: list[str], trace_groups: list[int]) -> list[dict]:
    """A dropdown showing one group of traces at a time (none when there is one group)."""
    if len(labels) <= 1:
        return []
    buttons = [{"label": label, "method": "restyle", "args": [{"visible": [t == g for t in trace_groups]}]}
               for g, label in enumerate(labels)]
    return [{"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left", "y": 1.12, "yanchor": "top",
             "showactive": True}]


# Tables.

def _rows_table(rows: pd.DataFrame, swept: list[str], label_column: str | None) -> str:
    columns = ([label_column] if label_column else []) + (swept or [a for a in ("policy",) if a in rows])
    metrics = [("request_rate", "offered req/s", 1), ("request_throughput", "req/s", 1),
               ("output_throughput", "output tok/s", 1), ("ttft_p50", "p50 TTFT ms", 1e3),
               ("ttft_p99", "p99 TTFT ms", 1e3), ("tpot_p50", "p50 TPOT ms", 1e3),
               ("itl_p99", "p99 ITL ms", 1e3), ("e2e_p99", "p99 E2E ms", 1e3),
               ("scheduling_delay_p50", "p50 delay ms", 1e3), ("preemptions", "preemptions", 1),
               ("goodput", "goodput req/s", 1)]
    metrics = [m for m in metrics if m[0] in rows and rows[m[0]].notna().any()]
    head = "".join(f'<th class="t">{html.escape(_axis_name(c))}</th>' for c in columns)
    head += "".join(f"<th>{html.escape(name)}</th>" for _, name, _ in metrics)
    has_errors = "status" in rows and (rows["status"] != "ok").any()
    if has_errors:
        head += '<th class="t">error</th>'
    body = []
    for _, row in rows.head(2000).iterrows():
        cells = "".join(f'<td class="t">{html.escape(_fmt_axis(c, row.get(c)))}</td>' for c in columns)
        cells += "".join(f"<td>{_fmt(row.get(name), scale)}</td>" for name, _, scale in metrics)
        if has_errors:
            cells += f'<td class="t err">{html.escape(str(row.get("error") or ""))}</td>'
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _stats_table(row) -> str:
    """One run: counts, throughputs, and every latency's mean and percentiles in milliseconds."""
    counts = [("requests", "num_requests"), ("completed", "completed"), ("rejected", "rejected"),
              ("preemptions", "preemptions"), ("steps", "num_steps"), ("duration s", "duration_s"),
              ("req/s", "request_throughput"), ("output tok/s", "output_throughput"),
              ("total tok/s", "total_token_throughput"), ("goodput req/s", "goodput")]
    counts = [(name, key) for name, key in counts if row.get(key) is not None and not _is_nan(row.get(key))]
    first = "".join(f"<th>{html.escape(name)}</th>" for name, _ in counts)
    values = "".join(f"<td>{_fmt(row.get(key), 1)}</td>" for _, key in counts)
    lines = [f"<table><tr>{first}</tr><tr>{values}</tr></table><br>",
             '<table><tr><th class="t">ms</th>' + "".join(f"<th>{s}</th>" for s in ("mean", "p50", "p90", "p99"))
             + "</tr>"]
    for metric in ("ttft", "tpot", "itl", "e2e", "scheduling_delay"):
        cells = "".join(f"<td>{_fmt(row.get(f'{metric}_{stat}'), 1e3)}</td>" for stat in ("mean", "p50", "p90", "p99"))
        lines.append(f'<tr><td class="t">{metric}</td>{cells}</tr>')
    return "".join(lines) + "</table>"


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _capacity_table(capacity: pd.DataFrame) -> str:
    columns = [c for c in capacity.columns if c not in ("point", "slo", "trace")
               and not (c in AXES and c != "policy" and capacity[c].astype(str).nunique() == 1)]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt_cell(row[c]))}</td>" for c in columns) + "</tr>"
                   for _, row in capacity.iterrows())
    return f"<table><tr>{head}</tr>{body}</table>"


# Helpers.

def _groups(rows: pd.DataFrame, by: list[str], limit: int | None = MAX_MENU_ENTRIES) -> list[tuple[str, pd.DataFrame]]:
    if not by:
        return [("", rows)]
    out = []
    for _, group in rows.groupby(by, sort=False, dropna=False):
        out.append((_label(group.iloc[0], None, by), group))
    return out[:limit]


def _first_seed(rows: pd.DataFrame) -> pd.DataFrame:
    if "seed" in rows and rows["seed"].nunique() > 1:
        return rows[rows["seed"] == rows["seed"].min()]
    return rows


def _seed_note(rows: pd.DataFrame, swept: list[str]) -> str:
    menu = "The menu picks the other options. " if len(swept) > (2 if "seed" in swept else 1) else ""
    seed = f"Seed {rows['seed'].min()} of {rows['seed'].nunique()}. " if "seed" in swept else ""
    return menu + seed


def _label(row, label_column: str | None, axes: list[str] | tuple[str, ...] = ("policy",)) -> str:
    if label_column:
        return str(row.get(label_column))
    return ", ".join(_fmt_axis(a, row.get(a)) for a in axes if a in row)


def _axis_name(axis: str) -> str:
    return {"max_num_batched_tokens": "budget", "max_num_seqs": "max seqs", "rate_scale": "rate"}.get(axis, axis)


def _fmt_axis(axis: str, value) -> str:
    if axis == "max_num_batched_tokens":
        return f"budget {value}"
    if axis == "max_num_seqs":
        return f"max seqs {value}"
    if axis == "rate_scale":
        return f"rate ×{float(value):g}"
    if axis == "seed":
        return f"seed {value}"
    return str(value)


def _color(row, index: int) -> str:
    return POLICY_COLORS.get(str(row.get("policy")), OTHER_COLORS[index % len(OTHER_COLORS)])


def _is_list(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0


def _finite(values) -> list:
    """Floats with NaN as None (a gap in a line)."""
    out = []
    for v in values:
        out.append(None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v))
    return out


def _fmt(value, scale: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    value = float(value) * scale
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def _fmt_cell(value) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _nulls(value):
    """JSON without NaN."""
    if isinstance(value, dict):
        return {k: _nulls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nulls(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


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
