"""Calibrated profiles: a cost-model `Calibration` fitted to measured steps, and where it came from.

A profile is one JSON file written by `sim calibrate`:

    {"format": "servesim-profile", "version": 1,
     "model": "tiny", "device": "cpu", "device_name": "...", "dtype": "float32", "block_size": 16,
     "created": "2025-...", "software": {"python": ..., "torch": ...},
     "calibration": {"ridge_flops_per_byte": ..., "cache_bytes": ..., "dtype_bytes": 4,
                     "coefficients": {"linear_flops": ...}},
     "fit": {"num_points": ..., "train": {"median_ape": ...}, "cross_validated": {...}}, "grid": {...}}

The fit is non-negative least squares on relative residuals (each measured step weighs by its
own duration, so short decode steps count as much as long prefills), with 1-D searches over the
GEMM ridge point and the cache knee of padded decode K/V. NNLS is Lawson and Hanson's active-set
method, in numpy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends.costmodel import step_aggregates
from backends.costmodel.fitted import FEATURES, Calibration, step_features
from backends.model_config import ModelConfig
from sim.errors import ServesimError
from sim.jsonable import fields_of, read_json_file

PROFILE_FORMAT = "servesim-profile"
PROFILE_VERSION = 1
# Candidate GEMM ridge points (FLOP per byte); 0 is "cost proportional to tokens".
RIDGES = np.concatenate([[0.0], np.geomspace(1.0, 4096.0, 37)])
# Candidate cache sizes (bytes of one layer's padded decode K/V) past which reading gets dearer.
CACHE_SIZES = np.geomspace(2.0**16, 2.0**30, 29)


@dataclass(frozen=True)
class Profile:
    model: str
    calibration: Calibration
    device: str  # "cpu" or "cuda"
    device_name: str  # what the device calls itself, e.g. "NVIDIA H200"
    dtype: str
    block_size: int
    created: str  # ISO 8601, UTC
    software: dict = field(default_factory=dict)  # package -> version
    fit: dict = field(default_factory=dict)  # the fit's own error, see `fit_calibration`
    grid: dict = field(default_factory=dict)  # what was measured: grid name, shapes, warm-up, repeats

    def to_json(self) -> dict:
        cal = self.calibration
        return {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "model": self.model, "device": self.device, "device_name": self.device_name, "dtype": self.dtype,
            "block_size": self.block_size, "created": self.created, "software": self.software,
            "calibration": {"ridge_flops_per_byte": cal.ridge_flops_per_byte, "cache_bytes": cal.cache_bytes,
                            "dtype_bytes": cal.dtype_bytes, "coefficients": cal.as_dict()},
            "fit": self.fit, "grid": self.grid,
        }


def save_profile(profile: Profile, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from sim.files import atomic_write_text

    atomic_write_text(path, json.dumps(profile.to_json(), indent=2) + "\n")  # never a truncated profile


SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size")


def load_profile(path: str | Path, model: str | ModelConfig | None = None) -> Profile:
    """Read a profile; with `model` (a name, or the run's ModelConfig), refuse one calibrated for another
    model: another name, or (a ModelConfig, whose name may be a config folder's) other shapes than the
    preset the profile was calibrated on (`sim calibrate` calibrates presets). Found by a review: a
    folder named tiny holding a larger model took the tiny preset's profile."""
    path = Path(path)
    data = read_json_file(path, "profile", "make one with `sim calibrate`")
    if data.get("format") != PROFILE_FORMAT:
        raise ServesimError(f"{path}: not a servesim profile (no \"format\": \"{PROFILE_FORMAT}\")")
    if data.get("version") != PROFILE_VERSION:
        raise ServesimError(f"{path}: profile version {data.get('version')!r}; this servesim reads version "
                            f"{PROFILE_VERSION} (calibrate again)")
    with fields_of(path):
        cal = data["calibration"]
        coefficients = cal["coefficients"]
        missing = [k for k in FEATURES if k not in coefficients]
        if missing:
            raise ServesimError(f"the calibration lacks coefficients {', '.join(missing)} (calibrate again)")
        cache_bytes = cal.get("cache_bytes")
        calibration = Calibration(tuple(float(coefficients[k]) for k in FEATURES),
                                  float(cal["ridge_flops_per_byte"]), int(cal["dtype_bytes"]),
                                  None if cache_bytes is None else float(cache_bytes))
        profile = Profile(str(data["model"]), calibration, str(data["device"]), str(data["device_name"]),
                          str(data["dtype"]), int(data["block_size"]), str(data["created"]),
                          dict(data.get("software", {})), dict(data.get("fit", {})), dict(data.get("grid", {})))
    name = model.name if isinstance(model, ModelConfig) else model
    if name is not None and profile.model != name:
        raise ServesimError(
            f"{path} was calibrated for model {profile.model!r} on {profile.device_name}, not for {name!r}; "
            f"use --model {profile.model}, or calibrate {name} with `sim calibrate --model {name} ...`")
    if isinstance(model, ModelConfig):
        try:
            preset = ModelConfig.from_preset(profile.model)
        except ServesimError:
            return profile  # (not a preset's: its name is all there is to compare)
        differ = [f for f in SHAPE_FIELDS if getattr(model, f) != getattr(preset, f)]
        if differ:
            shown = ", ".join(f"{f} {getattr(model, f)} (the profile's {getattr(preset, f)})" for f in differ)
            raise ServesimError(f"{path} was calibrated for the preset {profile.model!r}, and this model {name!r} "
                                f"differs from it: {shown}; calibrate this model with `sim calibrate`")
    return profile


# Fitting.

def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson 1974, active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * max(m, n) * np.finfo(float).eps * max(np.abs(a).sum(axis=0).max(), 1.0)
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)  # minus the gradient; positive where raising x_j helps
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                x = s
                break
            # Step from x toward s until the first passive coefficient reaches zero; drop it.
            blocking = passive & (s <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - s[blocking]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


def ape_stats(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float | int | None]:
    """Median, p90 and max absolute percentage error, and the median signed error (bias), as
    fractions: 0.05 is 5%."""
    predicted, measured = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if len(measured) == 0:
        return {"count": 0, "median_ape": None, "p90_ape": None, "max_ape": None, "median_error": None}
    error = (predicted - measured) / measured
    ape = np.abs(error)
    return {"count": int(len(ape)), "median_ape": float(np.median(ape)), "p90_ape": float(np.percentile(ape, 90)),
            "max_ape": float(ape.max()), "median_error": float(np.median(error))}


def pad(rows: list) -> np.ndarray:
    """Ragged per-step lists -> [steps, max requests] int64, zero-padded."""
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _nnls_relative(features: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, float]:
    """NNLS on relative residuals; returns coefficients and the sum of squared relative errors."""
    a = features / seconds[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    x = nnls(a / scale, np.ones(len(seconds))) / scale
    return x, float(np.sum((a @ x - 1.0) ** 2))


def _search(loss, grid: np.ndarray, num_golden: int = 30) -> float:
    """The grid value of least loss, refined by golden-section search on its log between its
    neighbours when they are positive."""
    losses = [loss(v) for v in grid]
    i = int(np.argmin(losses))
    if not 0 < i < len(grid) - 1 or grid[i - 1] <= 0:
        return float(grid[i])
    lo, hi = np.log(grid[i - 1]), np.log(grid[i + 1])
    g = (np.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(np.exp(a)), loss(np.exp(b))
    for _ in range(num_golden):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(np.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(np.exp(b))
    best, value = min((fa, np.exp(a)), (fb, np.exp(b)))
    return float(value) if best < losses[i] else float(grid[i])


def fit_calibration(model: ModelConfig, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray, seconds: np.ndarray,
                    dtype_bytes: int = 2, ridges: np.ndarray = RIDGES,
                    cache_sizes: np.ndarray = CACHE_SIZES) -> Calibration:
    """The calibration that best predicts `seconds` of the steps given by q, c: [points, requests] and
    num_logits: [points]: NNLS for the coefficients, searches for the GEMM ridge point and the
    cache size (the ridge first without a cache knee, then the knee; then both in turn, twice)."""
    seconds = np.asarray(seconds, dtype=np.float64)
    if len(seconds) < len(FEATURES):
        raise ServesimError(f"a fit needs at least {len(FEATURES)} measured shapes, got {len(seconds)}")
    if not np.all(np.isfinite(seconds) & (seconds > 0)):
        raise ServesimError("measured step times must be finite and positive")

    def loss(ridge: float, cache: float | None) -> float:
        return _nnls_relative(step_features(model, q, c, num_logits, dtype_bytes, ridge, cache), seconds)[1]

    ridge = _search(lambda r: loss(r, None), ridges)
    cache: float | None = None
    # A knee only where enough points lie past it (a knee past all but one would fit that one exactly).
    agg = step_aggregates(q, c, num_logits)
    padded = 2.0 * model.num_key_value_heads * model.head_dim * dtype_bytes * agg.num_decodes * agg.max_decode_context
    enough = max(len(FEATURES), len(seconds) // 10)
    cache_sizes = cache_sizes[cache_sizes < np.sort(padded)[-enough]] if len(padded) >= enough else cache_sizes[:0]
    if len(cache_sizes):
        best_cache = _search(lambda size: loss(ridge, size), cache_sizes)
        without = loss(ridge, None)
        if loss(ridge, best_cache) < without - max(1e-6 * without, 1e-12 * len(seconds)):
            cache = best_cache
            for _ in range(2):  # coordinate descent: the ridge and the knee trade off a little
                ridge = _search(lambda r: loss(r, cache), ridges)
                cache = _search(lambda size: loss(ridge, size), cache_sizes)
    x, _ = _nnls_relative(step_features(model, q, c, num_logits, dtype_bytes, ridge, cache), seconds)
    if cache is not None and x[FEATURES.index("kv_read_padded_excess_bytes")] == 0:
        cache = None  # the knee did not matter after all
    return Calibration(tuple(float(v) for v in x), ridge, dtype_bytes, cache)


def predict(model: ModelConfig, calibration: Calibration, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
    terms = step_features(model, q, c, num_logits, calibration.dtype_bytes, calibration.ridge_flops_per_byte,
                          calibration.cache_bytes)
    return terms @ np.asarray(calibration.coefficients)


def fit_report(model: ModelConfig, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray, seconds: np.ndarray,
               calibration: Calibration, dtype_bytes: int = 2, num_folds: int = 5, seed: int = 0) -> dict:
    """The fit's own error: on the points it was fitted to, and k-fold cross-validated (each point
    predicted by a fit that did not see it)."""
    seconds = np.asarray(seconds, dtype=np.float64)
    report = {"num_points": int(len(seconds)),
              "train": ape_stats(predict(model, calibration, q, c, num_logits), seconds)}
    if len(seconds) >= 2 * len(FEATURES) and num_folds >= 2:
        fold = np.random.default_rng(seed).permutation(len(seconds)) % num_folds
        held_out = np.zeros(len(seconds))
        for k in range(num_folds):
            test, train = fold == k, fold != k
            cal = fit_calibration(model, q[train], c[train], num_logits[train], seconds[train], dtype_bytes)
            held_out[test] = predict(model, cal, q[test], c[test], num_logits[test])
        report["cross_validated"] = ape_stats(held_out, seconds)
    return report
