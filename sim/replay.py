"""One replay: trace + options -> simulated requests and steps -> a run folder."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from backends.presets import derive_num_blocks, get_hardware, get_model
from policies import POLICIES
from sim.block_manager import BlockManager
from sim.config import SLO, CacheConfig, SchedulerConfig
from sim.engine import Engine, SimResult
from sim.errors import ServesimError
from sim.request import Request
from traces.trace import Trace


@dataclass(frozen=True)
class ReplayOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    model: str = "Llama-3.1-8B"
    hardware: str = "H100-SXM"
    backend: str = "costmodel"
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    device: str = "cpu"  # the real backend's device: cpu or cuda
    weights: str | None = None  # the real backend's safetensors folder; None: random weights
    profile: str | None = None  # a calibrated cost-model profile (sim calibrate); None: datasheet roofline

    def __post_init__(self) -> None:
        model = get_model(self.model)
        get_hardware(self.hardware)
        limit = model["max_position_embeddings"]
        if self.scheduler.max_model_len is not None and self.scheduler.max_model_len > limit:
            raise ServesimError(
                f"--max-model-len {self.scheduler.max_model_len} is more than {self.model}'s "
                f"max_position_embeddings ({limit})")
        if self.backend not in BACKENDS:
            raise ServesimError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ServesimError(f"unknown device {self.device!r}; choose cpu or cuda")
        if self.weights is not None and self.backend != "real":
            raise ServesimError(f"--weights loads the real backend's model; it does not apply to --backend {self.backend}")
        if self.profile is not None:
            from backends.profile import load_profile

            if self.backend != "costmodel":
                raise ServesimError(f"--profile calibrates the cost model; it does not apply to --backend {self.backend}")
            load_profile(self.profile, self.model)  # refuses a profile of another model

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or get_model(self.model)["max_position_embeddings"]

    def num_blocks(self) -> int:
        if self.cache.num_blocks is not None:
            return self.cache.num_blocks
        return derive_num_blocks(get_model(self.model), get_hardware(self.hardware), self.cache.block_size,
                                 self.cache.gpu_memory_utilization, self.scheduler.max_num_batched_tokens,
                                 self.scheduler.max_num_seqs)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["scheduler"]["max_model_len"] = self.max_model_len
        d["cache"]["num_blocks"] = self.num_blocks()
        return d


BACKENDS = ("costmodel", "real")


def make_backend(options: ReplayOptions):
    if options.backend == "real":
        from backends.real import RealBackend

        return RealBackend(options.model, device=options.device, block_size=options.cache.block_size,
                           num_blocks=options.cache.num_blocks, seed=options.seed, weights=options.weights,
                           gpu_memory_utilization=options.cache.gpu_memory_utilization,
                           max_num_batched_tokens=options.scheduler.max_num_batched_tokens,
                           max_num_seqs=options.scheduler.max_num_seqs)
    from backends.costmodel import CostModelBackend

    calibration = None
    if options.profile is not None:
        from backends.profile import load_profile

        calibration = load_profile(options.profile, options.model).calibration
    return CostModelBackend(options.model, options.hardware, calibration=calibration)


def with_backend_blocks(options: ReplayOptions, backend) -> ReplayOptions:
    """The options with the KV cache size the backend really allocated (the real backend's), so the
    block manager hands out exactly the block ids the backend's cache has."""
    num_blocks = getattr(backend, "num_blocks", None)
    if num_blocks is None or num_blocks == options.cache.num_blocks:
        return options
    return replace(options, cache=replace(options.cache, num_blocks=num_blocks))


def make_requests(trace: Trace, options: ReplayOptions) -> list[Request]:
    vocab = get_model(options.model)["vocab_size"]
    ids = trace.ids()
    hash_ids = trace.hash_ids
    arrival = trace.arrival_s.tolist()
    prompt = trace.prompt_tokens.tolist()
    output = trace.output_tokens.tolist()
    return [
        Request(i, ids[i], arrival[i], prompt[i], output[i],
                hash_ids=None if hash_ids is None else hash_ids[i], hash_block_tokens=trace.hash_block_tokens,
                token_seed=options.seed, vocab_size=vocab)
        for i in range(len(trace))
    ]


def replay(trace: Trace, options: ReplayOptions, backend=None,
           progress: Callable[[float, int, int], None] | None = None, fast_forward: bool = True) -> SimResult:
    """Simulate the trace. `fast_forward=False` steps every decode step one by one (same answers,
    slower; see sim/engine.py)."""
    backend = backend or make_backend(options)
    options = with_backend_blocks(options, backend)
    cache = options.cache
    block_manager = BlockManager(options.num_blocks(), cache.block_size, cache.enable_prefix_caching)
    policy = POLICIES[options.scheduler.policy](options.scheduler)
    engine = Engine(make_requests(trace, options), policy, backend, block_manager,
                    options.max_model_len, progress=progress, fast_forward=fast_forward)
    return engine.run()


TABLE_FORMATS = ("parquet", "csv")


def write_run(out: Path, result: SimResult, options: ReplayOptions, trace: Trace, steps: str = "parquet",
              requests: str = "csv") -> dict:
    """Write the requests and steps tables (`steps`: parquet, csv or none; `requests`: csv or
    parquet), summary.json, digest.json and report.html; return the summary."""
    from reports.digest import run_digest
    from reports.html import write_run_report
    from reports.metrics import steps_columns, summarize
    from reports.outcomes import outcomes_from_result
    from reports.tables import TableWriter, write_table

    if steps not in (*TABLE_FORMATS, "none"):
        raise ServesimError(f"--steps must be parquet, csv or none, got {steps!r}")
    if requests not in TABLE_FORMATS:
        raise ServesimError(f"--requests must be csv or parquet, got {requests!r}")
    out.mkdir(parents=True, exist_ok=True)
    opts = options.as_dict()
    opts["trace"] = trace.source
    if trace.transforms:
        opts["trace_transforms"] = trace.transforms
    outcomes = outcomes_from_result(result, options.slo, TableWriter(out, "requests", requests))
    summary = summarize(result, outcomes, opts)
    step_columns = steps_columns(result)
    if steps != "none":
        write_table(out, "steps", step_columns, steps)
    (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
    write_run_report(out, _jsonable(summary), run_digest(outcomes, step_columns))  # downsampled: cheap for 500k steps
    return summary


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if np.isnan(value) else float(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, pd.Timestamp):
        return value.isoformat()
    return value
