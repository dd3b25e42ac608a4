"""The HTML page of `sim validate`: predicted against measured TTFT and TPOT, per group of measured
deployments (system, model, serving framework and version, precision), and the rows' numbers."""

from __future__ import annotations

import html

import pandas as pd

from reports.figures import OTHER_COLORS, _axes, _grid
from reports.html import _page, _section, plotly_js

METRICS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))


def _label(row) -> str:
    version = f" {row['backend_version']}" if str(row["backend_version"]) else ""
    precision = str(row["precision"]) or "bf16"
    return f"{row['system']} {row['model'].split('/')[-1]} {row['backend']}{version} {precision}"


def scatter_figure(rows: pd.DataFrame) -> dict | None:
    """One panel per metric, log-log, one colour per group, and the line predicted = measured."""
    if not len(rows):
        return None
    layout = _grid(1, 2, [title for _, title in METRICS])
    layout["height"] = 520
    data = []
    groups = list(rows.groupby(rows.apply(_label, axis=1), sort=True))
    for i, (metric, _) in enumerate(METRICS):
        measured, predicted = rows[f"measured_{metric}_ms"], rows[f"predicted_{metric}_ms"]
        lo, hi = 0.8 * min(measured.min(), predicted.min()), 1.25 * max(measured.max(), predicted.max())
        for j, (label, g) in enumerate(groups):
            text = [f"{r.id}<br>TP {r.tp}, {r.isl}/{r.osl}, C {r.concurrency}<br>error {getattr(r, f'{metric}_error_pct'):+.1f}%"
                    for r in g.itertuples()]
            data.append({"type": "scatter", "mode": "markers", "name": label, "legendgroup": label,
                         "showlegend": i == 0, "x": g[f"measured_{metric}_ms"].tolist(),
                         "y": g[f"predicted_{metric}_ms"].tolist(), "text": text, "hoverinfo": "text",
                         "marker": {"color": OTHER_COLORS[j % len(OTHER_COLORS)], "size": 7}, **_axes(i)})
        data.append({"type": "scatter", "mode": "lines", "x": [lo, hi], "y": [lo, hi], "showlegend": False,
                     "line": {"color": "#888", "dash": "dash"}, "hoverinfo": "skip", **_axes(i)})
        suffix = "" if i == 0 else str(i + 1)
        layout[f"xaxis{suffix}"].update({"type": "log", "title": {"text": "measured"}})
        layout[f"yaxis{suffix}"].update({"type": "log", "title": {"text": "predicted"}})
    return {"data": data, "layout": layout}


def _table(frame: pd.DataFrame, columns: list[tuple[str, str, str]]) -> str:
    head = "".join(f'<th class="{"t" if fmt == "s" else ""}">{html.escape(title)}</th>' for _, title, fmt in columns)
    body = []
    for _, row in frame.iterrows():
        cells = []
        for key, _, fmt in columns:
            value = row[key]
            text = html.escape(str(value)) if fmt == "s" else (f"{value:{fmt}}" if pd.notna(value) else "")
            cells.append(f'<td class="{"t" if fmt == "s" else ""}">{text}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def validate_report_html(rows: pd.DataFrame, summary: dict, protocol, source: str) -> str:
    groups = pd.DataFrame(summary["groups"])
    sections = [_section("Predicted against measured", scatter_figure(rows),
                         "Mean TTFT (client-side) and TPOT of every simulated row; the dashed line is "
                         "predicted = measured.")]
    if len(groups):
        sections.append("<h2>Groups</h2>" + _table(groups, [
            ("system", "system", "s"), ("model", "model", "s"), ("backend", "backend", "s"),
            ("backend_version", "version", "s"), ("precision", "precision", "s"), ("rows", "rows", "d"),
            ("ttft_mape", "TTFT MAPE %", ".1f"), ("tpot_mape", "TPOT MAPE %", ".1f")]))
    overall = summary["all"]
    if overall["rows"]:
        sections.append(f'<div class="note">All {overall["rows"]} rows: TTFT MAPE {overall["ttft_mape"]:.1f}%, '
                        f'TPOT MAPE {overall["tpot_mape"]:.1f}%.</div>')
    if len(rows):
        sections.append("<h2>Rows</h2>" + _table(rows, [
            ("id", "id", "s"), ("tp", "TP", "d"), ("isl", "ISL", "d"), ("osl", "OSL", "d"),
            ("concurrency", "C", "d"), ("measured_ttft_ms", "TTFT ms", ".1f"), ("predicted_ttft_ms", "predicted", ".1f"),
            ("ttft_error_pct", "error %", "+.1f"), ("measured_tpot_ms", "TPOT ms", ".2f"),
            ("predicted_tpot_ms", "predicted", ".2f"), ("tpot_error_pct", "error %", "+.1f"),
            ("num_preemptions", "preemptions", "d"), ("kv_cache_dtype", "KV", "s"),
            ("warmup_waves", "waves left out", "d"), ("implied_tokens_per_s", "implied tok/s", ",.0f"),
            ("tables_max_tokens_per_s", "tables' GEMM max tok/s", ",.0f")]
            + ([("tables", "vLLM tables (per kind; the nearest where not the row's version)", "s")]
               if "tables" in rows.columns else [])))
        fast = rows[rows["faster_than_tables"].astype(bool)]
        if len(fast):
            sections.append(f'<div class="note">{len(fast)} of {len(rows)} rows imply a token rate above what '
                            "the operator tables' GEMMs alone allow (C x (mean prompt + mean output - 1) / (TTFT + "
                            "(mean output - 1) x TPOT) against the tables' best tokens/s): they ran faster than the "
                            "kernels they were "
                            "measured with, so the simulation cannot match them. They are counted in the "
                            "MAPEs all the same.</div>")
    if summary["skipped"]:
        skipped = pd.DataFrame(summary["skipped"])
        counts = skipped.groupby("reason").size().reset_index(name="rows").sort_values("rows", ascending=False)
        sections.append("<h2>Skipped</h2>" + _table(counts, [("reason", "reason", "s"), ("rows", "rows", "d")]))
    subtitle = (f"{source}: lengths uniform in [{protocol.range_ratio:g} x, 1 x] ISL and OSL, "
                f"{protocol.prompts_per_client} x C requests"
                + (" (the first wave left out where the measured TTFT rules it out, column 'waves left out')"
                   if protocol.warmup_waves == "auto" else
                   f" (the first {protocol.warmup_waves} x C not counted)" if protocol.warmup_waves else "")
                + f", max_num_batched_tokens {protocol.max_num_batched_tokens}, KV cache dtype "
                + ("per the sources' launch scripts (column KV)" if protocol.kv_cache_dtype == "recipe"
                   else protocol.kv_cache_dtype))
    return _page("sim validate: predicted against measured deployments", subtitle, plotly_js(), sections)
