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

from bisect import bisect_right
from typing import Any

import numpy as np


def log_steps(xs: np.ndarray) -> np.ndarray:
    """log(xs[i + 1] / xs[i]) for each grid point but the last (1.0 there, never used): the
    denominators of the log-space weights, computed once per grid."""
    steps = np.ones(len(xs))
    steps[:-1] = np.log(xs[1:] / xs[:-1])
    return steps


def _bracket(x: np.ndarray, xs: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sizes within [xs[0], xs[-1]]: the left neighbour's index i (x0 = xs[i] <= x), the
    right one's (i + 1, or i itself at the last point) and the log-space weight of the right one,
    log(x / x0) / log(x1 / x0) (0 on a grid point)."""
    last = len(xs) - 1
    i = xs.searchsorted(x, side="right") - 1
    x0 = xs[i]
    w = np.where((x0 == x) | (i == last), 0.0, np.log(x / x0) / steps[i])
    return i, np.minimum(i + 1, last), w


def _blend(t0, t1, w):
    """t0 * (t1 / t0) ** w, returning t0 itself where w == 0 (exact on grid points)."""
    return np.where(w == 0.0, t0, t0 * np.exp(w * np.log(t1 / t0)))


def interp_loglog(x, xs, ys, power: float = 1.0, steps=None) -> tuple[np.ndarray, np.ndarray]:
    """Times at sizes `x` (scalar or array) from the curve (xs, ys): log-log between neighbours,
    scaled by (x / xs[-1]) ** power past the last point, clamped below the first. Returns
    (times, extrapolated mask), both shaped like `x`. `steps`: log_steps(xs), if at hand."""
    x = np.asarray(x, dtype=np.float64)
    inside = np.minimum(np.maximum(x, xs[0]), xs[-1])
    i, j, w = _bracket(inside, xs, log_steps(xs) if steps is None else steps)
    t = _blend(ys[i], ys[j], w)
    above = x > xs[-1]
    if above.any():
        t = np.where(above, ys[-1] * (x / xs[-1]) ** power, t)
    return t, above | (x < xs[0])


def interp_loglog_2d(a, b, xa, xb, grid, power_a: float = 1.0, power_b: float = 1.0, steps_a=None, steps_b=None):
    """Times at (a, b) from grid[len(xa), len(xb)] (full, no gaps): bilinear in log space inside,
    each axis scaled past its last point by (a / xa[-1]) ** power_a, (b / xb[-1]) ** power_b and
    clamped below its first. a and b broadcast together. Returns (times, extrapolated mask).
    `steps_a`, `steps_b`: log_steps of the axes, if at hand."""
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    a_in = np.minimum(np.maximum(a, xa[0]), xa[-1])
    b_in = np.minimum(np.maximum(b, xb[0]), xb[-1])
    ia, ja, wa = _bracket(a_in, xa, log_steps(xa) if steps_a is None else steps_a)
    ib, jb, wb = _bracket(b_in, xb, log_steps(xb) if steps_b is None else steps_b)
    low = _blend(grid[ia, ib], grid[ia, jb], wb)
    high = _blend(grid[ja, ib], grid[ja, jb], wb)
    t = _blend(low, high, wa)
    above_a, above_b = a > xa[-1], b > xb[-1]
    any_a, any_b = above_a.any(), above_b.any()
    if any_a or any_b:
        scale = np.ones_like(t)
        if any_a:
            scale = np.where(above_a, (a / xa[-1]) ** power_a, scale)
        if any_b:
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


# Scalar lookups. A single step's few lookups through the array functions above cost tens of
# numpy calls each; these give exactly the same values (the same operations in the same order,
# with numpy's own log and exp on scalars, which equal its array results element for element,
# where Python's math module may differ in the last bit) at a fraction of the cost. The logs and
# exps are turned into Python floats at once: products and quotients of floats are the same IEEE
# operations in Python as in numpy's scalar arithmetic, which costs several times more. Sizes off
# the grid (rare) go through the array functions themselves, as 1-element arrays.

_log, _exp = np.log, np.exp


def _blend_one(t0, t1, w: np.ndarray) -> np.ndarray:
    """_blend for weights w != 0 or not alike: t0 * (t1 / t0) ** w with no test of w == 0, which gives t0
    itself there all the same (exp(0 * log(r)) is exactly 1 for the positive finite times here)."""
    return t0 * _exp(w * _log(t1 / t0))


def _blend_scalar(t0: float, t1: float, w: float) -> float:
    return t0 if w == 0.0 else t0 * float(_exp(w * float(_log(t1 / t0))))


def _bracket_scalar(x: float, xs: list[float], steps: list[float]) -> tuple[int, int, float]:
    """_bracket for one size within [xs[0], xs[-1]] (the weight a Python float)."""
    i = bisect_right(xs, x) - 1
    last = len(xs) - 1
    if i == last:
        return i, i, 0.0
    x0 = xs[i]
    return i, i + 1, 0.0 if x0 == x else float(_log(x / x0)) / steps[i]


MAX_BRACKETS = 4096  # sizes along a Grid's first axis whose brackets it keeps (see Grid.at)


class Curve:
    """A measured curve (xs, ys) with `interp_loglog` as a scalar lookup (`at`) and an array one
    (`many`), which agree exactly."""

    def __init__(self, xs, ys, power: float = 1.0):
        self.xs, self.ys, self.power = np.asarray(xs, dtype=np.float64), np.asarray(ys), power
        self.steps = log_steps(self.xs)
        self._xl, self._yl, self._sl = self.xs.tolist(), self.ys.tolist(), self.steps.tolist()

    def many(self, x) -> tuple[np.ndarray, np.ndarray]:
        return interp_loglog(x, self.xs, self.ys, self.power, self.steps)

    def at(self, x: float) -> tuple[float, bool]:
        """(time, whether x was off the grid) for one size."""
        xl = self._xl
        if not (xl[0] <= x <= xl[-1]):  # through a 1-element array, exactly as `many` prices an array
            t, off = self.many(np.array([x], dtype=np.float64))
            return float(t[0]), bool(off[0])
        i, j, w = _bracket_scalar(float(x), xl, self._sl)
        return float(_blend_scalar(self._yl[i], self._yl[j], w)), False


class Grid:
    """A full 2-D grid with `interp_loglog_2d` as a scalar lookup (`at`) and an array one
    (`many`), which agree exactly."""

    def __init__(self, xa, xb, grid, power_a: float = 1.0, power_b: float = 1.0):
        self.xa, self.xb = np.asarray(xa, dtype=np.float64), np.asarray(xb, dtype=np.float64)
        self.grid, self.power_a, self.power_b = np.asarray(grid), power_a, power_b
        self.steps_a, self.steps_b = log_steps(self.xa), log_steps(self.xb)
        self._al, self._bl = self.xa.tolist(), self.xb.tolist()
        self._gl = np.asarray(self.grid, dtype=np.float64).tolist()
        self._sa, self._sb = self.steps_a.tolist(), self.steps_b.tolist()
        # log(t1 / t0) between neighbours along b, as _blend_scalar computes it (numpy's log).
        self._lb = [[float(_log(row[j + 1] / row[j])) for j in range(len(row) - 1)] for row in self._gl]
        self._brackets_a: dict[float, tuple[int, int, float]] = {}  # _bracket_scalar along a, by size

    def many(self, a, b) -> tuple[np.ndarray, np.ndarray]:
        return interp_loglog_2d(a, b, self.xa, self.xb, self.grid, self.power_a, self.power_b,
                                self.steps_a, self.steps_b)

    def at(self, a: float, b: float) -> tuple[float, bool]:
        """(time, whether (a, b) was off the grid) for one point. The bracket of a is kept by size
        (the number of requests of a step: the same few sizes recur)."""
        brackets, bl = self._brackets_a, self._bl
        bracket = brackets.get(a)  # kept for sizes within the a axis only
        if bracket is None:
            al = self._al
            if al[0] <= a <= al[-1]:
                bracket = _bracket_scalar(float(a), al, self._sa)
                if len(brackets) < MAX_BRACKETS:
                    brackets[a] = bracket
        if bracket is None or not (bl[0] <= b <= bl[-1]):
            # Through 1-element arrays: numpy may take another route for a 0-d array's power (x ** 2.0
            # as a square) than for an array's, a last-bit difference that fast-forward would see.
            t, off = self.many(np.array([a], dtype=np.float64), np.array([b], dtype=np.float64))
            return float(t[0]), bool(off[0])
        ia, ja, wa = bracket
        ib = bisect_right(bl, b) - 1  # _bracket_scalar along b, written out
        wb = 0.0 if ib == len(bl) - 1 or bl[ib] == b else float(_log(b / bl[ib])) / self._sb[ib]
        g = self._gl
        # _blend_scalar along b (towards ib + 1 where wb != 0), then along a; a blend whose weight
        # is 0 is its first point, so the second is not computed.
        if wb == 0.0:
            low = g[ia][ib]
            if wa == 0.0:
                return low, False
            high = g[ja][ib]
        else:
            lb = self._lb
            low = g[ia][ib] * float(_exp(wb * lb[ia][ib]))
            if wa == 0.0:
                return low, False
            high = g[ja][ib] * float(_exp(wb * lb[ja][ib]))
        return low * float(_exp(wa * float(_log(high / low)))), False

    def along_b(self, a: float, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`many` at one a and sizes b (an array), bracketing a once: exactly `many`'s values."""
        al, bl = self._al, self._bl
        if not (al[0] <= a <= al[-1]) or len(b) == 0:
            return self.many(a, b)
        lo, hi = b.min(), b.max()
        if lo < bl[0] or hi > bl[-1]:
            return self.many(a, b)
        ia, ja, wa = _bracket_scalar(a, al, self._sa)
        ib: Any = self._one_interval(lo, hi)  # an interval, or None; else the brackets' arrays
        if ib is not None:  # every b between the same two grid points (most decode runs)
            wb = _log(b / bl[ib]) / self._sb[ib]
            g = self._gl
            low = _blend_one(g[ia][ib], g[ia][ib + 1], wb)
            if wa != 0.0:
                low = low * _exp(wa * _log(_blend_one(g[ja][ib], g[ja][ib + 1], wb) / low))
            return low, np.zeros(len(b), dtype=bool)
        ib, jb, wb = _bracket(b, self.xb, self.steps_b)
        g = self.grid
        low = _blend(g[ia, ib], g[ia, jb], wb)
        if wa != 0.0:
            low = low * _exp(wa * _log(_blend(g[ja, ib], g[ja, jb], wb) / low))
        return low, np.zeros(len(b), dtype=bool)

    def _one_interval(self, lo: float, hi: float) -> int | None:
        """i when xb[i] <= lo <= hi < xb[i + 1] (sizes within one interval of the b axis), else None."""
        bl = self._bl
        i = bisect_right(bl, lo) - 1
        return i if i < len(bl) - 1 and hi < bl[i + 1] else None

    def along_b_pieces(self, a: list[float], lengths, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`many` at sizes b (an array) whose a is a[k] for the next lengths[k] entries (a step
        function: a decode run whose requests leave), each a bracketed once: exactly `many`'s
        values (the same operations on the same numbers as interp_loglog_2d inside the grid)."""
        al, bl = self._al, self._bl
        if min(a) < al[0] or max(a) > al[-1] or len(b) == 0:
            return self.many(np.repeat(np.asarray(a, dtype=np.float64), lengths), b)
        lo, hi = b.min(), b.max()
        if lo < bl[0] or hi > bl[-1]:
            return self.many(np.repeat(np.asarray(a, dtype=np.float64), lengths), b)
        sa = self._sa
        brackets = [_bracket_scalar(x, al, sa) for x in a]
        ib: Any = self._one_interval(lo, hi)  # an interval, or None; else the brackets' arrays
        if ib is not None:  # every b between the same two grid points: each stretch's four corners
            g = self._gl
            corners = np.repeat(np.array([[g[i][ib] for i, _, _ in brackets], [g[i][ib + 1] for i, _, _ in brackets],
                                          [g[j][ib] for _, j, _ in brackets], [g[j][ib + 1] for _, j, _ in brackets],
                                          [w for _, _, w in brackets]], dtype=np.float64), lengths, axis=1)
            t00, t01, t10, t11, wa = corners
            wb = _log(b / bl[ib]) / self._sb[ib]
            return _blend(_blend_one(t00, t01, wb), _blend_one(t10, t11, wb), wa), np.zeros(len(b), dtype=bool)
        ias, jas, was = zip(*brackets)
        ia, ja, wa = np.repeat(ias, lengths), np.repeat(jas, lengths), np.repeat(np.asarray(was, dtype=np.float64), lengths)
        g = self.grid
        ib, jb, wb = _bracket(b, self.xb, self.steps_b)
        low = _blend(g[ia, ib], g[ia, jb], wb)
        high = _blend(g[ja, ib], g[ja, jb], wb)
        return _blend(low, high, wa), np.zeros(len(b), dtype=bool)
