"""The plotly figures of the reports, as plain figure dicts (no plotly import): latency CDFs,
throughput against latency, capacity, the step timeline; menus, colours and groupings.

The latency CDFs and the step timeline take a DataFrame of rows, or a list of row dicts (one
run's summary_row): a run's page is drawn without pandas."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from reports.axes import AXES
from reports.axes import axis_name as _axis_name
from reports.axes import format_axis as _fmt_axis
from reports.digest import QUANTILES, TIMELINE

POLICY_COLORS = {"decode-first": "#1f77b4", "prefill-first": "#d62728", "chunked": "#2ca02c"}
OTHER_COLORS = ("#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL (time between tokens)"), ("e2e", "E2E latency"))
TIMELINE_TITLES = ("prefill tokens per step", "decode tokens per step", "KV blocks used", "waiting requests")
MAX_MENU_ENTRIES = 48  # a menu longer than this shows its first entries only
_TEMPLATE = {"layout": {"plot_bgcolor": "#f5f6f8", "paper_bgcolor": "white", "font": {"size": 12},
                        "xaxis": {"gridcolor": "white"}, "yaxis": {"gridcolor": "white"}}}


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


def cdf_figure(rows: pd.DataFrame | list[dict], group_by: list[str], label_column: str | None) -> dict | None:
    """`rows`: a DataFrame, or a list of row dicts when `group_by` is empty."""
    if not len(rows):
        return None
    layout = _grid(2, 2, [title for _, title in CDF_METRICS])
    y = (QUANTILES / 100.0).tolist()
    groups = group_rows(rows, group_by)
    traces, trace_groups = [], []
    for g, (_, group) in enumerate(groups):
        for r, row in enumerate(iter_rows(group)):
            label = row_label(row, label_column)
            for k, (metric, _) in enumerate(CDF_METRICS):
                sketch = row.get(f"{metric}_quantiles")
                if not is_list(sketch):
                    continue
                traces.append({"type": "scatter", "mode": "lines", "x": finite(sketch), "y": y, "name": label,
                               "legendgroup": label, "showlegend": k == 0, "visible": g == 0,
                               "line": {"color": _color(row, r), "width": 2},
                               "hovertemplate": "%{x:.4g} s: %{y:.1%}<extra>" + html.escape(label) + "</extra>",
                               **_axes(k)})
                trace_groups.append(g)
                chunks = row.get("client_itl_quantiles") if metric == "itl" else None
                if is_list(chunks):  # --stream-interval above 1: the gaps a streaming client sees, beside the engine's
                    name = f"{label}: client, per chunk" if label else "client, per chunk"
                    traces.append({"type": "scatter", "mode": "lines", "x": finite(chunks), "y": y, "name": name,
                                   "legendgroup": label, "showlegend": True, "visible": g == 0,
                                   "line": {"color": _color(row, r), "width": 2, "dash": "dot"},
                                   "hovertemplate": "%{x:.4g} s: %{y:.1%}<extra>" + html.escape(name) + "</extra>",
                                   **_axes(k)})
                    trace_groups.append(g)
    for k in range(4):
        suffix = "" if k == 0 else str(k + 1)
        layout[f"xaxis{suffix}"].update(type="log", title={"text": "seconds"})
        layout[f"yaxis{suffix}"].update(range=[0, 1.01], title={"text": "fraction" if k % 2 == 0 else ""})
    layout.update(height=700, margin={"t": 70, "b": 40}, legend={"orientation": "h", "y": -0.1},
                  updatemenus=_menu([name for name, _ in groups], trace_groups))
    return {"data": traces, "layout": layout}


def throughput_figure(rows: pd.DataFrame, series_by: list[str]) -> dict | None:
    metrics = (("itl_p99", "P99 time between tokens"), ("scheduling_delay_p50", "median scheduling delay"),
               ("ttft_p99", "P99 TTFT"), ("e2e_p99", "P99 E2E latency"))
    rows = rows[[c for c in rows.columns if not c.endswith("_quantiles") and not c.startswith("timeline_")]]
    means = rows.groupby(series_by + ["rate_scale"], dropna=False, sort=False).mean(numeric_only=True).reset_index()
    if not len(means):
        return None
    layout = _grid(2, 2, [title for _, title in metrics])
    budgets = sorted(means["max_num_batched_tokens"].unique()) if "max_num_batched_tokens" in means else []
    traces = []
    for s, (_, series) in enumerate(group_rows(means, series_by, limit=None)):
        series = series.sort_values("rate_scale")
        first = series.iloc[0]
        label = row_label(first, None, series_by) or "all"
        dash = DASHES[budgets.index(first["max_num_batched_tokens"]) % len(DASHES)] if budgets else "solid"
        hover = [f"rate ×{scale:g}" for scale in series["rate_scale"]]
        for k, (metric, _) in enumerate(metrics):
            if metric not in series:
                continue
            traces.append({"type": "scatter", "mode": "lines+markers", "x": finite(series["request_throughput"]),
                           "y": finite(series[metric]), "name": label, "legendgroup": label, "showlegend": k == 0,
                           "text": hover, "line": {"color": _color(first, s), "dash": dash},
                           "hovertemplate": "%{x:.2f} req/s, %{y:.4g} s, %{text}<extra>" + html.escape(label)
                                            + "</extra>", **_axes(k)})
    for k in range(4):
        suffix = "" if k == 0 else str(k + 1)
        layout[f"xaxis{suffix}"]["title"] = {"text": "request throughput (req/s)"}
        layout[f"yaxis{suffix}"].update(type="log", title={"text": "seconds" if k % 2 == 0 else ""})
    layout.update(height=700, margin={"t": 40, "b": 40}, legend={"orientation": "h", "y": -0.12})
    return {"data": traces, "layout": layout}


def capacity_figure(capacity: pd.DataFrame) -> dict:
    config_axes = [a for a in AXES if a in capacity and a not in ("policy", "rate_scale")
                   and capacity[a].astype(str).nunique() > 1]
    traces = []
    groups = capacity.groupby("policy", sort=False) if "policy" in capacity else [("", capacity)]
    for p, (policy, group) in enumerate(groups):
        x = [row_label(row, None, config_axes) or str(policy) for _, row in group.iterrows()]
        y = finite(group["capacity_request_rate"])
        text = [f"{v:.2f}" if v is not None else str(status) for v, status in zip(y, group["status"])]
        traces.append({"type": "bar", "x": x, "y": [v or 0 for v in y], "name": str(policy), "text": text,
                       "textposition": "outside",
                       "marker": {"color": POLICY_COLORS.get(str(policy), OTHER_COLORS[p % len(OTHER_COLORS)])},
                       "hovertemplate": "%{x}: %{y:.3f} req/s<extra>" + html.escape(str(policy)) + "</extra>"})
    layout = {"template": _TEMPLATE, "barmode": "group", "height": 440, "margin": {"t": 30, "b": 40},
              "yaxis": {"title": {"text": "capacity (requests/s)"}},
              "xaxis": {"title": {"text": ", ".join(_axis_name(a) for a in config_axes) or "policy"}}}
    return {"data": traces, "layout": layout}


def timeline_figure(rows: pd.DataFrame | list[dict], swept: list[str], label_column: str | None) -> dict:
    layout = _grid(4, 1, list(TIMELINE_TITLES), shared_x=True, gap_y=0.06)
    labels, traces, trace_groups = [], [], []
    for row in iter_rows(rows, MAX_MENU_ENTRIES):
        x = row.get("timeline_start_s")
        if not is_list(x):
            continue
        labels.append(row_label(row, label_column, [a for a in swept if a != "seed"]))
        for k, name in enumerate(TIMELINE):
            traces.append({"type": "scatter", "mode": "lines", "x": finite(x), "y": finite(row[f"timeline_{name}"]),
                           "name": TIMELINE_TITLES[k], "showlegend": False, "visible": len(labels) == 1,
                           "line": {"color": OTHER_COLORS[k], "width": 1.5}, **_axes(k)})
            trace_groups.append(len(labels) - 1)
    layout["xaxis4"]["title"] = {"text": "simulated seconds"}
    layout.update(height=740, margin={"t": 70, "b": 40}, updatemenus=_menu(labels, trace_groups))
    return {"data": traces, "layout": layout}


ROLE_COLORS = {"colocated": "#2ca02c", "prefill": "#d62728", "decode": "#1f77b4"}


def replica_figure(row) -> dict:
    """A cluster's load per replica (summary_row's replica_* lists), one bar per replica."""
    panels = (("replica_requests", "requests", 1), ("replica_busy_fraction", "busy %", 100),
              ("replica_mean_kv_usage", "mean KV usage %", 100), ("replica_prefix_cache_hit_rate", "prefix hit %", 100))
    layout = _grid(1, 4, [title for _, title, _ in panels], gap_x=0.05)
    names = [f"{r} {role}" if role != "colocated" else str(r)
             for r, role in zip(row["replica_replica"], row["replica_role"])]
    colors = [ROLE_COLORS.get(role, OTHER_COLORS[0]) for role in row["replica_role"]]
    traces = [{"type": "bar", "x": names, "y": [v * scale for v in row[key]], "marker": {"color": colors},
               "showlegend": False, "hovertemplate": "replica %{x}: %{y:.4g}<extra>" + title + "</extra>", **_axes(i)}
              for i, (key, title, scale) in enumerate(panels)]
    layout.update(height=320, margin={"t": 40, "b": 40})
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

def iter_rows(rows: pd.DataFrame | list[dict], limit: int | None = None) -> list:
    """The first `limit` rows (all when None): a DataFrame's as pandas Series (iterrows), a list's as they are."""
    if isinstance(rows, list):
        return rows[:limit]
    return [row for _, row in (rows if limit is None else rows.head(limit)).iterrows()]


def group_rows(rows: pd.DataFrame | list[dict], by: list[str],
               limit: int | None = MAX_MENU_ENTRIES) -> list[tuple[str, pd.DataFrame | list[dict]]]:
    """Rows grouped by the values of `by` (none: one group of every row, a DataFrame or a list)."""
    if not by:
        return [("", rows)]
    out = []
    for _, group in rows.groupby(by, sort=False, dropna=False):
        out.append((row_label(group.iloc[0], None, by), group))
    return out[:limit]


def first_seed(rows: pd.DataFrame) -> pd.DataFrame:
    if "seed" in rows and rows["seed"].nunique() > 1:
        return rows[rows["seed"] == rows["seed"].min()]
    return rows


def seed_note(rows: pd.DataFrame, swept: list[str]) -> str:
    menu = "The menu picks the other options. " if any(a not in ("policy", "seed") for a in swept) else ""
    seed = f"Seed {rows['seed'].min()} of {rows['seed'].nunique()}. " if "seed" in swept else ""
    return menu + seed


def row_label(row, label_column: str | None, axes: list[str] | tuple[str, ...] = ("policy",)) -> str:
    if label_column:
        return str(row.get(label_column))
    return ", ".join(_fmt_axis(a, row.get(a)) for a in axes if a in row)


def _color(row, index: int) -> str:
    return POLICY_COLORS.get(str(row.get("policy")), OTHER_COLORS[index % len(OTHER_COLORS)])


def is_list(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0


def finite(values) -> list:
    """Floats with NaN as None (a gap in a line)."""
    out = []
    for v in values:
        out.append(None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v))
    return out


def fmt(value, scale: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    value = float(value) * scale
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
