"""The page of `sim compare`: predicted against measured step times, and the two runs' metrics."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pandas as pd

from sim.engine import SimResult

STEP_KINDS = ("prefill", "decode", "mixed")


def _cdf(values: np.ndarray, num_points: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    values = np.asarray(values, dtype=np.float64)  # (None, a request that never finished, is NaN)
    values = np.sort(values[~np.isnan(values)])
    if len(values) == 0:
        return values, values
    fraction = np.linspace(0, 1, min(num_points, len(values)))
    return np.quantile(values, fraction), fraction


def write_compare_report(path: Path, steps: pd.DataFrame, runs: dict[str, SimResult], figures: dict, title: str,
                         differ: dict[str, list] | None = None) -> None:
    """A self-contained HTML page (plotly.js inline): the error table, a predicted-vs-measured scatter
    of the step times (`steps`: kind, measured_s, predicted_s) and overlaid CDFs of the request
    metrics of `runs` ({"measured": result, "predicted": result}); under the title, the options in
    which the two runs differ (`differ`: name -> [measured value, predicted value])."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from reports.metrics import inter_token_latencies, requests_table

    scatter = go.Figure()
    for kind in STEP_KINDS:
        rows = steps[steps["kind"] == kind]
        scatter.add_trace(go.Scattergl(x=rows["measured_s"] * 1e3, y=rows["predicted_s"] * 1e3, mode="markers",
                                       name=f"{kind} ({len(rows)})", marker={"size": 4, "opacity": 0.6}))
    if len(steps):
        lo = float(min(steps["measured_s"].min(), steps["predicted_s"].min())) * 1e3
        hi = float(max(steps["measured_s"].max(), steps["predicted_s"].max())) * 1e3
        scatter.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="predicted = measured",
                                     line={"dash": "dash", "color": "gray"}))
    scatter.update_layout(title="Step time: predicted vs measured (same batches)", height=560,
                          xaxis={"title": "measured (ms)", "type": "log"},
                          yaxis={"title": "predicted (ms)", "type": "log"})

    tables = {name: requests_table(result) for name, result in runs.items()}
    cdfs = make_subplots(rows=2, cols=2, subplot_titles=("TTFT", "TPOT", "ITL", "E2E latency"))
    colors = {"measured": "#1f77b4", "predicted": "#d62728"}
    for i, metric in enumerate(("ttft", "tpot", "itl", "e2e")):
        for name, result in runs.items():
            frame = tables[name][tables[name]["status"] == "finished"]
            values = inter_token_latencies(result) if metric == "itl" else frame[f"{metric}_s"].to_numpy()
            x, y = _cdf(values * 1e3)
            cdfs.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name, legendgroup=name, showlegend=i == 0,
                                      line={"color": colors[name]}), row=i // 2 + 1, col=i % 2 + 1)
        cdfs.update_xaxes(title_text="ms", row=i // 2 + 1, col=i % 2 + 1)
    cdfs.update_layout(title="Request metrics: measured run vs independent cost-model run (CDF)", height=720)

    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{'-' if v is None else f'{100 * v:+.2f}%'}</td></tr>"
                   for k, v in figures["errors"].items())
    def value(v) -> str:
        return "-" if v is None else str(v)

    differences = "; ".join(f"{name}: {value(m)} (measured), {value(p)} (predicted)"
                            for name, (m, p) in (differ or {}).items())
    line = f"The two runs differ only in {differences}." if differences else "The two runs' options are the same."
    body = (f"<h1>{html.escape(title)}</h1><p>{html.escape(line)}</p>"
            + scatter.to_html(full_html=False, include_plotlyjs=True)
            + cdfs.to_html(full_html=False, include_plotlyjs=False)
            + f"<h2>Error figures</h2><table>{rows}</table>")
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                    "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head>"
                    f"<body>{body}</body></html>\n")
