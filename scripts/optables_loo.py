"""The operator tables' own interpolation error, measured on the tables (no model, no silicon rows).

1. GEMM, leave-one-out in (n, k): every interior grid shape's curve over m is predicted from its
   neighbours n-1, n+1 and k-1, k+1 (bilinear in log n, log k of log time, as backends/costmodel/optables/derive.py
   interpolates an off-grid shape) and compared with its measured times at every m.
2. GEMM, leave-one-out in m: every interior m of every shape predicted from m-1 and m+1 (log-log,
   as backends/costmodel/optables/interp.py interpolates between grid m).
3. Decode attention of unequal lengths priced as one batch at the mean length (backends/costmodel/optables/model.py):
   a batch of 2b sequences, b at length L1 and b at L2, is measured by the table as two calls,
   t(b, L1) + t(b, L2) minus one call's floor; the model says t(2b, (L1 + L2) / 2).

    PYTHONPATH=$PWD python scripts/optables_loo.py [--ops DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from backends.costmodel.optables.interp import fill_rows_by_scaling, interp_loglog_2d
from backends.costmodel.optables.tables import GEMM_DTYPES, KERNELS, load_tables, systems_in

DATA = Path(__file__).resolve().parents[1] / ".." / ".." / "shared" / "gpu-data" / "aiconfigurator"


def ape_row(errors: np.ndarray) -> dict:
    a = np.abs(errors) * 100
    return {"points": len(a), "median %": np.median(a), "p90 %": np.percentile(a, 90), "mean %": a.mean(),
            "max %": a.max(), "bias %": np.median(errors) * 100}


def gemm_cube(rows: pd.DataFrame):
    ms, ns, ks = (np.sort(rows[c].unique()) for c in ("m", "n", "k"))
    cube = rows.pivot_table(index=["n", "k"], columns="m", values="seconds").reindex(columns=ms)
    return ms, ns, ks, cube


def loo_nk(ms, ns, ks, cube) -> np.ndarray:
    errors = []
    for i in range(1, len(ns) - 1):
        for j in range(1, len(ks) - 1):
            n, k = ns[i], ks[j]
            corners = [(a, b) for a in (ns[i - 1], ns[i + 1]) for b in (ks[j - 1], ks[j + 1])]
            if (n, k) not in cube.index or any(c not in cube.index for c in corners):
                continue
            wn = np.log(n / ns[i - 1]) / np.log(ns[i + 1] / ns[i - 1])
            wk = np.log(k / ks[j - 1]) / np.log(ks[j + 1] / ks[j - 1])
            weights = [(1 - wn) * (1 - wk), (1 - wn) * wk, wn * (1 - wk), wn * wk]
            log_t = sum(w * np.log(cube.loc[c].to_numpy()) for w, c in zip(weights, corners))
            measured = cube.loc[(n, k)].to_numpy()
            errors.append(np.exp(log_t) / measured - 1)
    return np.concatenate(errors)


def loo_m(ms, cube) -> np.ndarray:
    t = cube.to_numpy()
    lm = np.log(ms.astype(float))
    w = (lm[1:-1] - lm[:-2]) / (lm[2:] - lm[:-2])
    predicted = np.exp((1 - w) * np.log(t[:, :-2]) + w * np.log(t[:, 2:]))
    return (predicted / t[:, 1:-1] - 1).ravel()


def mean_length_check(tables, heads=32, kv_heads=8, head_dim=128) -> np.ndarray:
    g = tables.generation_attention
    rows = g[(g["kernel_source"] == KERNELS[("attention", None)]) & (g["window_size"] == 0)
             & (g["kv_cache_dtype"] == "bfloat16") & (g["num_heads"] == heads)
             & (g["num_key_value_heads"] == kv_heads) & (g["head_dim"] == head_dim)]
    piv = rows.pivot_table(index="batch_size", columns="step", values="seconds")
    batch, lengths, grid = piv.index.to_numpy(float), piv.columns.to_numpy(float) + 1, piv.to_numpy()
    floor = grid[0, 0]
    full, _ = fill_rows_by_scaling(batch, grid)
    errors = []
    for bi, b in enumerate(batch[:-1]):
        for i in range(len(lengths)):
            for j in range(i + 1, len(lengths)):
                if np.isnan(grid[bi, i]) or np.isnan(grid[bi, j]):
                    continue
                measured = grid[bi, i] + grid[bi, j] - floor
                model, _ = interp_loglog_2d(2 * b, (lengths[i] + lengths[j]) / 2, batch, lengths, full)
                errors.append(float(model) / measured - 1)
    return np.array(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=str(DATA))
    args = ap.parse_args()
    out = []
    for system in systems_in(args.ops):
        tables = load_tables(args.ops, system)
        g = tables.gemm
        for dtype, table_dtype in GEMM_DTYPES.items():
            rows = g[(g["gemm_dtype"] == table_dtype) & (g["kernel_source"] == KERNELS[("gemm", dtype)])]
            ms, ns, ks, cube = gemm_cube(rows)
            out.append({"system": system, "what": f"GEMM {dtype}, leave one (n, k) out", **ape_row(loo_nk(ms, ns, ks, cube))})
            out.append({"system": system, "what": f"GEMM {dtype}, leave one m out", **ape_row(loo_m(ms, cube))})
        out.append({"system": system, "what": "decode at mean length vs two lengths (32/8/128)",
                    **ape_row(mean_length_check(tables))})
    pd.set_option("display.width", 200)
    print(pd.DataFrame(out).round(2).to_string(index=False))


if __name__ == "__main__":
    main()
