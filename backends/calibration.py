"""Calibration: measure a grid of batch shapes on the real backend and fit a cost-model profile
(the command is sim/app/calibrate.py).

The grid covers what the policies schedule:

    decode   B requests, one token each, contexts spread around L            (B x L)
    prefill  one chunk of q tokens after c cached ones (c = 0: a whole prompt), and
             four whole prompts of q/4 tokens                               (q x c)
    mixed    D decodes around L plus one prefill chunk of q after c cached  (D x q x L x c)

A batch's contexts are spread log-normally around L (seeded by the shape, so a grid is always
the same), as a trace's are: the longest and the sum of a batch's contexts then vary
independently, and the fit can tell the terms that follow each apart.

Each shape is one `Batch` whose block tables use scattered block ids below the backend's
`num_blocks`. Every shape runs `warmup` times unmeasured, then `repeats` rounds run every shape
once each, from the fastest shape to the slowest, each right after unmeasured runs of the step
that precedes it in a replay (see `measure`); the median of a shape's repeats is fitted. The raw measurements go to a CSV beside
the profile (one row per measured run).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pandas as pd

from backends.model_config import ModelConfig
from backends.profile import Profile, fit_calibration, fit_report, pad
from sim.batch import Batch
from sim.errors import ServesimError

GRIDS: dict[str, dict[str, tuple[int, ...]]] = {
    "full": {  # a GPU and a production-size model: about 150 shapes
        "decode_batch": (1, 2, 4, 8, 16, 32, 64, 128, 256),
        "decode_context": (128, 512, 1024, 2048, 4096, 8192),
        "prefill_chunk": (16, 32, 64, 128, 256, 512, 1024, 2048),
        "prefill_cached": (0, 512, 2048, 8192),
        "mixed_decodes": (4, 16, 64, 128),
        "mixed_chunk": (64, 256, 1024),
        "mixed_context": (512, 2048),
        "mixed_cached": (0, 1024),
    },
    "cpu": {  # a CPU and the tiny model: what a chunked replay on a CPU schedules, in a minute or two
        "decode_batch": (1, 2, 3, 4, 6, 8, 12, 16),
        "decode_context": (64, 128, 256, 512, 1024, 1536, 2048, 3072),
        "prefill_chunk": (16, 64, 256, 512, 1024, 2048),
        "prefill_cached": (0, 512, 2048),
        "mixed_decodes": (1, 2, 4, 8),
        "mixed_chunk": (32, 256, 1024),
        "mixed_context": (256, 1024),
        "mixed_cached": (0, 512),
    },
    "small": {  # for tests and a quick look: seconds on a CPU with the tiny model
        "decode_batch": (1, 4, 16),
        "decode_context": (32, 256),
        "prefill_chunk": (8, 64, 256),
        "prefill_cached": (0, 256),
        "mixed_decodes": (2, 8),
        "mixed_chunk": (32, 128),
        "mixed_context": (128,),
        "mixed_cached": (0, 128),
    },
}
# Unmeasured runs of a shape's predecessor before each measured run: a replay runs a stretch of
# similar steps, and after a much larger step caches and allocator take a few steps to settle.
SETTLE_RUNS = 3
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Shape:
    kind: str  # "decode", "prefill" or "mixed"
    query_lens: tuple[int, ...]  # tokens scheduled this step, per request
    context_lens: tuple[int, ...]  # context after the step (cached + query), per request
    needs_logits: tuple[bool, ...]
    is_decode: tuple[bool, ...]

    def num_blocks(self, block_size: int) -> int:
        return sum(-(-c // block_size) for c in self.context_lens)


def _contexts(mean: int, n: int, limit: int) -> list[int]:
    """n decode contexts around `mean`, log-normal (sigma 0.6), seeded by (n, mean); at least 2
    (a decode has a cached token) and at most `limit`."""
    if n == 1:
        return [min(mean, limit)]
    z = np.random.default_rng([n, mean]).standard_normal(n)
    return sorted(np.clip(np.rint(mean * np.exp(0.6 * z - 0.18)), 2, limit).astype(int).tolist())


def make_grid(name: str, max_model_len: int) -> list[Shape]:
    if name not in GRIDS:
        raise ServesimError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}")
    g, limit = GRIDS[name], max_model_len
    shapes = []
    for b in g["decode_batch"]:
        for ctx in g["decode_context"]:
            contexts = _contexts(ctx, b, limit)
            shapes.append(Shape("decode", (1,) * b, tuple(contexts), (True,) * b, (True,) * b))
    for q in g["prefill_chunk"]:
        for cached in g["prefill_cached"]:
            if cached + q <= limit:  # a chunk after a cached prefix is a partial prompt: no logits
                shapes.append(Shape("prefill", (q,), (cached + q,), (cached == 0,), (False,)))
        if q >= 16:
            n = 4
            shapes.append(Shape("prefill", (q // n,) * n, (q // n,) * n, (True,) * n, (False,) * n))
    for d in g["mixed_decodes"]:
        for q in g["mixed_chunk"]:
            for ctx in g["mixed_context"]:
                for cached in g["mixed_cached"]:
                    if cached + q > limit:
                        continue
                    contexts = _contexts(ctx, d, limit)
                    shapes.append(Shape("mixed", (1,) * d + (q,), tuple(contexts) + (cached + q,),
                                        (True,) * d + (cached == 0,), (True,) * d + (False,)))
    return shapes


def predecessor(shape: Shape) -> Shape:
    """The step a replay typically runs just before a step of this shape, to be run unmeasured
    before each measured run: the same decodes (consecutive decode steps are alike); for a mixed
    step, its decodes alone (the step before the chunk joined them); for a prefill-only step, a
    single short decode (an almost idle engine)."""
    if shape.kind == "decode":
        return shape
    decodes = [i for i, d in enumerate(shape.is_decode) if d]
    if not decodes:
        return Shape("decode", (1,), (64,), (True,), (True,))
    return Shape("decode", tuple(shape.query_lens[i] for i in decodes), tuple(shape.context_lens[i] for i in decodes),
                 tuple(shape.needs_logits[i] for i in decodes), (True,) * len(decodes))


def shape_batch(shape: Shape, block_size: int, num_blocks: int, vocab_size: int,
                rng: np.random.Generator) -> Batch:
    """A batch of `shape` with random token ids and scattered block ids below `num_blocks`."""
    needed = shape.num_blocks(block_size)
    ids = rng.permutation(num_blocks)[np.arange(needed) % num_blocks].tolist()
    batch, start = Batch(), 0
    for i, (q, ctx, logits, decode) in enumerate(zip(shape.query_lens, shape.context_lens, shape.needs_logits,
                                                       shape.is_decode)):
        n = -(-ctx // block_size)
        tokens = rng.integers(0, vocab_size, ctx, dtype=np.int64)
        batch.add(f"cal{i}", ctx - q, q, ids[start:start + n], needs_logits=logits, is_decode=decode,
                  token_source=tokens)
        start += n
    return batch


def measure(backend, shapes: list[Shape], vocab_size: int, warmup: int = 2, repeats: int = 5, seed: int = 0,
            progress=None) -> pd.DataFrame:
    """Run every shape `warmup` times, then `repeats` rounds over all shapes; one row per measured run.
    `progress`, if given, has update(num_runs_done).

    A round goes through the shapes from the fastest to the slowest (by their last warm-up), and
    each measured run directly follows `SETTLE_RUNS` unmeasured runs of its `predecessor`, the
    step a replay runs before such a step: a decode step after the same decodes, a step with a prefill chunk
    after a small decode step. What ran just before matters: after a much larger step, caches and
    the allocator take a few steps to settle (a small decode step can take twice its steady
    time), and a large step after small ones pays for its fresh buffers. A slow spell of the
    machine (other processes, clocks, heat) lands on one round of a run of shapes, and the median
    over rounds leaves it out."""
    if repeats < 1 or warmup < 0:
        raise ServesimError(f"--repeats must be >= 1 and --warmup >= 0, got {repeats} and {warmup}")
    rng = np.random.default_rng(seed)
    batches = [shape_batch(shape, backend.block_size, backend.num_blocks, vocab_size, rng) for shape in shapes]
    before = [batch if shape.kind == "decode" else shape_batch(predecessor(shape), backend.block_size,
                                                                backend.num_blocks, vocab_size, rng)
              for shape, batch in zip(shapes, batches)]
    # Without warm-up runs to time, order by the work: query-key pairs, K/V read, tokens.
    size = [sum(q * c + c + 64 * q for q, c in zip(s.query_lens, s.context_lens)) for s in shapes]
    for index, batch in enumerate(batches):
        for _ in range(warmup):
            size[index] = backend.execute(batch).seconds
    order = np.argsort(size, kind="stable").tolist()
    seconds = np.zeros((len(shapes), repeats))
    done = 0
    for repeat in range(repeats):
        for index in order:
            for _ in range(SETTLE_RUNS):
                backend.execute(before[index])
            seconds[index, repeat] = backend.execute(batches[index]).seconds
            done += 1
            if progress is not None:
                progress.update(done)
    rows = [
        {"shape": index, "kind": shape.kind, "num_requests": len(batch), "num_tokens": batch.num_tokens,
         "num_decode_tokens": batch.num_decode_tokens, "num_logits": sum(shape.needs_logits),
         "query_lens": " ".join(map(str, shape.query_lens)), "context_lens": " ".join(map(str, shape.context_lens)),
         "repeat": repeat, "seconds": float(seconds[index, repeat])}
        for index, (shape, batch) in enumerate(zip(shapes, batches)) for repeat in range(repeats)
    ]
    return pd.DataFrame(rows)


def medians(raw: pd.DataFrame) -> pd.DataFrame:
    """One row per shape with the median of its repeats."""
    first = raw.groupby("shape", sort=True).first()
    first["seconds"] = raw.groupby("shape", sort=True)["seconds"].median()
    return first.reset_index()


def fit_measurements(model: str, raw: pd.DataFrame, dtype_bytes: int):
    """(calibration, fit report) from raw measurements (the CSV that `measure` writes)."""
    shapes = medians(raw)
    q = pad([list(map(int, s.split())) for s in shapes["query_lens"]])
    c = pad([list(map(int, s.split())) for s in shapes["context_lens"]])
    num_logits = shapes["num_logits"].to_numpy()
    seconds = shapes["seconds"].to_numpy(dtype=np.float64)
    m = ModelConfig.from_preset(model)
    calibration = fit_calibration(m, q, c, num_logits, seconds, dtype_bytes)
    report = fit_report(m, q, c, num_logits, seconds, calibration, dtype_bytes)
    # How much a shape's own repeats disagree: the floor under any model's error on single steps.
    by_shape = raw.groupby("shape")["seconds"]
    spread = (by_shape.quantile(0.75) - by_shape.quantile(0.25)) / by_shape.median()
    report["repeat_noise"] = {"median_iqr_over_median": float(spread.median()),
                              "p90_iqr_over_median": float(spread.quantile(0.9))}
    for kind in ("decode", "prefill", "mixed"):
        rows = (shapes["kind"] == kind).to_numpy()
        if rows.any():
            report[kind] = fit_report(m, q[rows], c[rows], num_logits[rows], seconds[rows], calibration,
                                      dtype_bytes, num_folds=0)["train"]
    return calibration, report


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("servesim", "numpy", "torch", "triton"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")  # only if the backend loaded it
    if torch is not None and getattr(torch.version, "cuda", None):
        versions["cuda"] = torch.version.cuda
    return versions


def calibrate(backend, model: str, grid: str = "full", warmup: int = 2, repeats: int = 5, seed: int = 0,
              progress=None) -> tuple[Profile, pd.DataFrame]:
    """Measure `grid` on `backend` (a Backend with block_size and num_blocks) and fit a profile.
    `progress`, if given, is told the number of measured runs (`total`) and each one done (update)."""
    m = ModelConfig.from_preset(model)
    shapes = make_grid(grid, m.max_position_embeddings)
    fitting = [s for s in shapes if s.num_blocks(backend.block_size) <= backend.num_blocks]
    if len(fitting) < len(shapes) // 2:
        raise ServesimError(f"only {len(fitting)} of the {len(shapes)} shapes of grid {grid!r} fit in "
                            f"{backend.num_blocks} KV blocks; give more with --num-blocks")
    if progress is not None:
        progress.total = len(fitting) * repeats
    raw = measure(backend, fitting, m.vocab_size, warmup, repeats, seed, progress)
    dtype = str(backend.dtype).removeprefix("torch.")
    calibration, report = fit_measurements(model, raw, DTYPE_BYTES.get(dtype, 2))
    profile = Profile(
        model=model, calibration=calibration, device=str(backend.device),
        device_name=backend.device_name, dtype=dtype, block_size=int(backend.block_size),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), software=software_versions(),
        fit=report, grid={"name": grid, "num_shapes": len(fitting), "num_skipped": len(shapes) - len(fitting),
                          "warmup": warmup, "repeats": repeats, "seed": seed},
    )
    return profile, raw


def default_grid(device: str) -> str:
    return "cpu" if device == "cpu" else "full"


def grid_num_blocks(model: str, grid: str, block_size: int) -> int:
    """KV blocks for the largest shape of the grid: what a CPU calibration allocates."""
    shapes = make_grid(grid, ModelConfig.from_preset(model).max_position_embeddings)
    return max(s.num_blocks(block_size) for s in shapes)


def format_profile(profile: Profile) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    fit = profile.fit
    lines = [f"{profile.model} on {profile.device_name} ({profile.device}, {profile.dtype}), "
             f"{fit['num_points']} shapes, ridge {profile.calibration.ridge_flops_per_byte:.3g} FLOP/B"]
    for name, value in profile.calibration.as_dict().items():
        lines.append(f"  {name:<30}{value:.4g} s/unit")
    if "repeat_noise" in fit:
        noise = fit["repeat_noise"]
        lines.append(f"repeat noise (IQR / median of a shape's repeats): median {pct(noise['median_iqr_over_median'])}, "
                     f"p90 {pct(noise['p90_iqr_over_median'])}")
    lines.append(f"{'fit error':<26}{'median':>8}{'p90':>8}{'max':>8}")
    for name in ("train", "cross_validated", "decode", "prefill", "mixed"):
        if name in fit:
            s = fit[name]
            lines.append(f"  {name:<24}{pct(s['median_ape']):>8}{pct(s['p90_ape']):>8}{pct(s['max_ape']):>8}")
    return "\n".join(lines)
