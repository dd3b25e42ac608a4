"""Log-log interpolation of measured operator times, exact on grid points, monotone between them.

Every curve here is a positive time measured at positive sizes (tokens, batch, bytes). Between
two neighbouring grid points x0 < x < x1 the time is the straight line in log-log space:

    t(x) = t0 * (t1 / t0) ** w,   w = log(x / x0) / log(x1 / x0)

which is a power law through both points: exact at the grid points (they are returned as
stored, not recomputed) and monotone between them (it always lies between t0 and t1). On a 2-D
grid the same is done along each axis in turn (bilinear in log space).

Nothing is extrapolated silently: a size past the grid's last point is priced by *scaling* the
last point with the operator's work, t(x) = t(x_max) * (x / x_max) ** power, where the caller
states the power (1 for work proportional to the size, 2 for causal attention over a length);
a size below the first point is clamped to it (a smaller operator is no slower than the smallest
measured one, within noise). Functions return a mask of the points that were scaled or clamped,
so callers can record it.
"""

from __future__ import annotations

import numpy as np


def check_grid(xs, ys, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A grid as float arrays: sizes strictly increasing and positive, times positive and finite."""
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if xs.ndim != 1 or len(xs) == 0 or xs.shape[0] != ys.shape[0]:
        raise ValueError(f"{what}: a grid needs as many sizes as times, got {xs.shape} and {ys.shape}")
    if not (np.all(xs > 0) and np.all(np.diff(xs) > 0)):
        raise ValueError(f"{what}: grid sizes must be positive and strictly increasing")
    if not np.all(np.isfinite(ys) & (ys > 0)):
        raise ValueError(f"{what}: grid times must be positive and finite")
    return xs, ys


def _bracket(x: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sizes within [xs[0], xs[-1]]: the left neighbour's index i (x0 = xs[i] <= x), the
    right one's (i + 1, or i itself at the last point) and the log-space weight of the right one
    (0 on a grid point)."""
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 1)
    j = np.minimum(i + 1, len(xs) - 1)
    on_grid = xs[i] == x
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(on_grid | (i == j), 0.0, np.log(x / xs[i]) / np.log(xs[j] / xs[i]))
    return i, j, w


def _blend(t0, t1, w):
    """t0 * (t1 / t0) ** w, returning t0 itself where w == 0 (exact on grid points)."""
    return np.where(w == 0.0, t0, t0 * np.exp(w * np.log(t1 / t0)))


def interp_loglog(x, xs, ys, power: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Times at sizes `x` (scalar or array) from the curve (xs, ys): log-log between neighbours,
    scaled by (x / xs[-1]) ** power past the last point, clamped below the first. Returns
    (times, extrapolated mask), both shaped like `x`."""
    x = np.asarray(x, dtype=np.float64)
    inside = np.clip(x, xs[0], xs[-1])
    i, j, w = _bracket(inside, xs)
    t = _blend(ys[i], ys[j], w)
    above = x > xs[-1]
    if np.any(above):
        t = np.where(above, ys[-1] * (x / xs[-1]) ** power, t)
    return t, above | (x < xs[0])


def interp_loglog_2d(a, b, xa, xb, grid, power_a: float = 1.0, power_b: float = 1.0):
    """Times at (a, b) from grid[len(xa), len(xb)] (full, no gaps): bilinear in log space inside,
    each axis scaled past its last point by (a / xa[-1]) ** power_a, (b / xb[-1]) ** power_b and
    clamped below its first. a and b broadcast together. Returns (times, extrapolated mask)."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    a_in, b_in = np.clip(a, xa[0], xa[-1]), np.clip(b, xb[0], xb[-1])
    ia, ja, wa = _bracket(a_in, xa)
    ib, jb, wb = _bracket(b_in, xb)
    low = _blend(grid[ia, ib], grid[ia, jb], wb)
    high = _blend(grid[ja, ib], grid[ja, jb], wb)
    t = _blend(low, high, wa)
    scale = np.ones_like(t)
    above_a, above_b = a > xa[-1], b > xb[-1]
    if np.any(above_a):
        scale = np.where(above_a, (a / xa[-1]) ** power_a, scale)
    if np.any(above_b):
        scale = scale * np.where(above_b, (b / xb[-1]) ** power_b, 1.0)
    t = np.where(above_a | above_b, t * scale, t)
    return t, above_a | above_b | (a < xa[0]) | (b < xb[0])


def fill_rows_by_scaling(xa, grid: np.ndarray, power: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A triangular grid[len(xa), n] (NaN where not measured: large a at a given column) made
    full: each column's missing cells past its last measured row are that row scaled by
    (a / a_last) ** power. Returns (full grid, mask of filled cells). A column with no measured
    cell, or a gap below a measured cell, is an error."""
    grid = np.array(grid, dtype=np.float64)
    filled = np.isnan(grid)
    for col in range(grid.shape[1]):
        measured = np.flatnonzero(~filled[:, col])
        if len(measured) == 0:
            raise ValueError(f"column {col} of the grid has no measured cell")
        last = measured[-1]
        if len(measured) != last + 1:
            raise ValueError(f"column {col} of the grid has a gap below its last measured cell")
        grid[last + 1:, col] = grid[last, col] * (np.asarray(xa[last + 1:]) / xa[last]) ** power
    return grid, filled
