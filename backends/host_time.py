"""Host time per step: the seconds vLLM's engine core spends on the CPU each step, and how they meet the GPU's.

A profile (profiles/host/vllm-<version>-<cpu>.json, measured by bench/host_time.py running vLLM's own
scheduler and worker CPU code) gives each piece of a step (`schedule`, `prepare_inputs`,
`sample_bookkeeping`, `update_from_output`) as fixed_s + per_request_s * requests + per_token_s * tokens,
every coefficient non-negative, so a step's host time never falls when it has more requests or tokens.

Carried to the serving host's CPU by one ratio: the host's reference loop seconds over the profile's
(`bench/host_time.py --reference-only` run on that host; bench/replay_speed.py's loop). The engine core is one
Python thread doing interpreter-bound work (dicts, lists, small numpy calls), which is what a single-threaded
pure-Python loop measures; a clock-speed ratio would miss the difference in instructions per clock between
CPU generations. Without the host's figure the profile is used as measured (scale 1).

How host and GPU time make a step (`overlap`): synchronously (vLLM's `EngineCore.step`) the CPU schedules,
prepares, waits for the GPU, then processes the output, so they add; asynchronously
(`EngineCore.step_with_batch_queue`, docs/async-scheduling.md) the CPU's work for the next step runs while
the GPU runs this one, so a step takes the longer of the two.

Which host work is in series (`HostTime.critical_seconds`): with one GPU vLLM runs the model runner in the
engine core's own process (`ParallelConfig`: distributed_executor_backend "uni" at world size 1), so every
piece is on one thread; with tensor parallelism (world size > 1, "mp") the model runner's pieces
(`prepare_inputs`, `sample_bookkeeping`) run in the worker processes. Synchronously they still run one after
the other (schedule, then the workers prepare, the GPU, the workers' bookkeeping, then update_from_output);
asynchronously the engine core's thread and the workers each work on a different step, so the busier of
the two sets the pace.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.backend import StepResult
from sim.errors import ServesimError
from sim.jsonable import read_json_file

HOST_DIR = Path(__file__).resolve().parents[1] / "profiles" / "host"
PIECES = ("schedule", "prepare_inputs", "sample_bookkeeping", "update_from_output")
ENGINE_CORE_PIECES = ("schedule", "update_from_output")  # the engine core's thread (vllm/v1/engine/core.py)
WORKER_PIECES = ("prepare_inputs", "sample_bookkeeping")  # the model runner's (vllm/v1/worker/gpu_model_runner.py)
PROFILE_NAME = re.compile(r"vllm-(?P<version>\d+(?:\.\d+)+)-(?P<cpu>[a-z0-9-]+)\.json")


def measured_profiles(folder: Path = HOST_DIR) -> dict[str, Path]:
    """The committed profiles by the vLLM version they measured (vllm-<version>-<cpu>.json; one per version)."""
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("vllm-*.json")) if folder.is_dir() else []:
        match = PROFILE_NAME.fullmatch(path.name)
        if match is not None:
            found.setdefault(match["version"], path)
    return found


def choose_profile(vllm_version: str | None, folder: Path = HOST_DIR) -> tuple[Path, str]:
    """(the profile, how it was chosen) for a run of `vllm_version`: that version's, else the nearest measured
    one (as the operator tables' version is chosen: a tie goes to the newer), None: the newest. Measured: vLLM
    0.12 (the synchronous deployments' version: its own scheduler, bench/host_time.py), 0.33 and 0.34."""
    from backends.costmodel.optables.systems import choose_version

    profiles = measured_profiles(folder)
    if not profiles:
        raise ServesimError(f"no host time profile (vllm-<version>-<cpu>.json) in {folder}: measure one with "
                            "bench/host_time.py, or run with --no-host-time")
    version, how = choose_version(profiles, vllm_version)
    return profiles[version], how


DEFAULT_PROFILE = choose_profile(None)[0]  # the newest measured vLLM's


def overlap(gpu_s: float, host_s: float, asynchronous: bool) -> float:
    """A step's seconds from its GPU and host seconds: their sum when scheduling is synchronous, the longer
    of the two when it is asynchronous (the host's work overlaps the GPU's)."""
    if gpu_s < 0 or host_s < 0:
        raise ValueError(f"negative seconds: gpu {gpu_s}, host {host_s}")
    return max(gpu_s, host_s) if asynchronous else gpu_s + host_s


@dataclass(frozen=True)
class Piece:
    """One piece of a step's host work: fixed_s + per_request_s * requests + per_token_s * tokens."""

    fixed_s: float
    per_request_s: float
    per_token_s: float

    def seconds(self, num_reqs: int, num_tokens: int) -> float:
        return self.fixed_s + self.per_request_s * num_reqs + self.per_token_s * num_tokens


class HostTime:
    """The host seconds of a step of `num_reqs` requests and `num_tokens` scheduled tokens."""

    def __init__(self, pieces: dict[str, Piece], scale: float = 1.0, cpu: str = "", vllm_version: str = "",
                 reference_loop_s: float | None = None, source: str = "", asked_version: str | None = None,
                 version_choice: str = ""):
        if not math.isfinite(scale) or scale <= 0:
            raise ServesimError(f"host time scale must be a positive number, not {scale}")
        for name, piece in pieces.items():
            for value in (piece.fixed_s, piece.per_request_s, piece.per_token_s):
                if not math.isfinite(value) or value < 0:
                    raise ServesimError(f"host time piece {name!r}{' of ' + source if source else ''}: coefficients "
                                        f"must be finite and non-negative, got {piece}")
        self.pieces = dict(pieces)
        self.scale = scale
        self.cpu = cpu
        self.vllm_version = vllm_version
        self.reference_loop_s = reference_loop_s
        self.source = source
        self.asked_version = asked_version
        self.version_choice = version_choice

    @classmethod
    def load(cls, path: str | Path | None = None, host_reference_loop_s: float | None = None,
             vllm_version: str | None = None) -> HostTime:
        """A profile file (default: the committed one of `vllm_version`, else the nearest measured version;
        None: the newest: `choose_profile`), carried to a host whose reference loop takes
        `host_reference_loop_s` seconds (None: used as measured)."""
        how = "as given"
        if path is None:
            path, how = choose_profile(vllm_version)
        path = Path(path)
        data = read_json_file(path, "host time profile")
        try:
            pieces = {name: Piece(float(c["fixed_s"]), float(c["per_request_s"]), float(c["per_token_s"]))
                      for name, c in data["pieces"].items()}
            reference = data.get("reference_loop_s")
            reference = None if reference is None else float(reference)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ServesimError(f"host time profile {path}: needs 'pieces' of fixed_s, per_request_s and "
                                f"per_token_s ({type(e).__name__}: {e})") from None
        scale = 1.0
        if host_reference_loop_s is not None:
            if reference is None or reference <= 0:
                raise ServesimError(f"host time profile {path}: has no reference_loop_s to carry it to another CPU")
            if not math.isfinite(host_reference_loop_s) or host_reference_loop_s <= 0:
                raise ServesimError(f"host reference loop seconds must be a positive number, not "
                                    f"{host_reference_loop_s}")
            scale = host_reference_loop_s / reference
        return cls(pieces, scale, str(data.get("cpu", "")), str(data.get("vllm_version", "")), reference, str(path),
                   vllm_version, how)

    def note(self) -> str:
        """One line: whose host time the run's steps carry."""
        how = self.version_choice if self.asked_version is None else f"{self.asked_version} asked: {self.version_choice}"
        return f"host time: vLLM {self.vllm_version}'s profile ({Path(self.source).name}, {how})"

    def piece_seconds(self, num_reqs: int, num_tokens: int) -> dict[str, float]:
        """Each piece's seconds for the step (scaled to the host)."""
        if num_reqs <= 0:
            return {name: 0.0 for name in self.pieces}
        return {name: self.scale * piece.seconds(num_reqs, num_tokens) for name, piece in self.pieces.items()}

    def critical_seconds(self, num_reqs: int, num_tokens: int, asynchronous: bool, multiprocess: bool) -> float:
        """The host seconds that set a step's pace (the module's docstring): every piece added, except
        under asynchronous scheduling with worker processes, where it is the longer of the engine core's
        pieces and the workers'."""
        seconds = self.piece_seconds(num_reqs, num_tokens)
        if asynchronous and multiprocess:
            core = sum(v for k, v in seconds.items() if k not in WORKER_PIECES)
            worker = sum(v for k, v in seconds.items() if k in WORKER_PIECES)
            return max(core, worker)
        return sum(seconds.values())

    def step_seconds(self, num_reqs: int, num_tokens: int) -> float:
        """The step's host seconds: every piece's, added (0 for a step that schedules nothing)."""
        if num_reqs < 0 or num_tokens < 0:
            raise ValueError(f"negative requests or tokens: {num_reqs}, {num_tokens}")
        if num_reqs == 0:
            return 0.0
        fixed = sum(p.fixed_s for p in self.pieces.values())
        per_request = sum(p.per_request_s for p in self.pieces.values())
        per_token = sum(p.per_token_s for p in self.pieces.values())
        return self.scale * (fixed + per_request * num_reqs + per_token * num_tokens)


class HostTimedBackend:
    """A backend whose every step is its GPU seconds (the wrapped backend's) met with the step's host
    seconds (`HostTime.critical_seconds` of the step's requests and scheduled tokens) as `overlap` states:
    added when scheduling is synchronous, the longer of the two when asynchronous. Each step's breakdown
    gains `gpu_s` and `host_s` (columns of the step log). Runs (`decode_run`, `chunk_steps`) give exactly
    `execute`'s seconds per step: the same float operations, in the same order, element by element."""

    def __init__(self, inner, host: HostTime, asynchronous: bool, multiprocess: bool):
        self.inner = inner
        self.host = host
        self.asynchronous = asynchronous
        self.multiprocess = multiprocess
        for name in ("name", "device", "device_name", "dtype", "num_blocks", "supports_fast_forward"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))
        # The pieces' coefficients summed (in the profile's order): the engine core's and the workers'
        # apart where they overlap (asynchronous with worker processes: `HostTime.critical_seconds`),
        # else all together. Each step's seconds: scale * (fixed + per_request * requests + per_token * tokens).
        self._split = asynchronous and multiprocess
        groups: list[list[Piece]] = [[], []]
        for name, p in host.pieces.items():
            groups[1 if self._split and name in WORKER_PIECES else 0].append(p)
        self._sums = [(sum(p.fixed_s for p in g), sum(p.per_request_s for p in g), sum(p.per_token_s for p in g))
                      for g in groups if g or not self._split]
        if hasattr(inner, "decode_run"):
            self.decode_run = self._decode_run
        if hasattr(inner, "chunk_steps"):
            self.chunk_steps = self._chunk_steps
        if hasattr(inner, "execute_in_lockstep"):  # a DP rank's step (sim/data_parallel.py)
            self.execute_in_lockstep = self._execute_in_lockstep

    def host_seconds(self, num_reqs: int, num_tokens: int) -> float:
        """The step's host seconds that set its pace (`HostTime.critical_seconds`, from the summed
        coefficients), with the float operations of `host_seconds_array`; 0 for a step of no request."""
        if num_reqs <= 0:
            return 0.0
        scale = self.host.scale
        return max(scale * (fixed + per_request * num_reqs + per_token * num_tokens)
                   for fixed, per_request, per_token in self._sums)

    def host_seconds_array(self, num_reqs: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        """`host_seconds` of each step, element by element (the same float operations)."""
        n = np.asarray(num_reqs, dtype=np.float64)
        t = np.asarray(num_tokens, dtype=np.float64)
        scale = self.host.scale
        out = None
        for fixed, per_request, per_token in self._sums:
            seconds = scale * (fixed + per_request * n + per_token * t)
            out = seconds if out is None else np.maximum(out, seconds)
        return np.where(n > 0, out, 0.0)

    def _meet(self, gpu: np.ndarray, host: np.ndarray) -> np.ndarray:
        """`overlap`, element by element."""
        return np.maximum(gpu, host) if self.asynchronous else gpu + host

    def execute(self, batch):
        return self._timed(batch, self.inner.execute(batch))

    def _execute_in_lockstep(self, batch, moe_parts):
        return self._timed(batch, self.inner.execute_in_lockstep(batch, moe_parts))

    def _timed(self, batch, result):
        gpu = result.seconds
        host = self.host_seconds(len(batch.requests), batch.num_tokens)
        breakdown = dict(result.breakdown)
        breakdown["gpu"] = gpu
        breakdown["host"] = host
        return StepResult(overlap(gpu, host, self.asynchronous), breakdown, result.sampled_token_ids)

    def _decode_run(self, context_lens, num_steps: int, active_steps=None):
        gpu, parts = self.inner.decode_run(context_lens, num_steps, active_steps)
        gpu = np.asarray(gpu, dtype=np.float64)
        n = len(context_lens)
        if active_steps is None or min(active_steps) >= num_steps:  # the same requests throughout
            host = np.full(num_steps, self.host_seconds(n, n))
        else:  # step j decodes the requests with active_steps > j
            ordered = np.sort(np.asarray(active_steps))
            running = (n - np.searchsorted(ordered, np.arange(num_steps), side="right")).astype(np.float64)
            host = self.host_seconds_array(running, running)
        parts = dict(parts)
        parts["gpu"] = gpu
        parts["host"] = host
        return self._meet(gpu, host), parts

    def _chunk_steps(self, decode_computed, chunk: int, before: int, num_steps: int):
        gpu, parts = self.inner.chunk_steps(decode_computed, chunk, before, num_steps)
        n = len(decode_computed)
        host = self.host_seconds(n + 1, n + chunk)
        parts = dict(parts)
        parts["gpu"] = list(gpu)
        parts["host"] = [host] * num_steps
        asynchronous = self.asynchronous
        return [overlap(g, host, asynchronous) for g in gpu], parts


# What the tools read of a wrapped cost model beyond the engine's calls, forwarded as it is now (a
# counter read after the run is the inner backend's). Declared one by one rather than by a
# `__getattr__`, which would keep CPython (3.11) from specialising any lookup on the wrapper, called
# on every step (1.3% of a replay's instructions on the default clock). tests/test_engine_clock.py checks that every
# public attribute of each cost model is reachable through the wrapper.
FORWARDED = ("attention_roofline", "block_size", "breakdown", "calibration", "combine_seconds", "cost_model_summary",
             "decodes_from_sums", "dense", "dense_tokens", "derived", "dispatch_seconds", "distribution", "dp",
             "dp_moe_parts", "dtype_bytes", "eff", "elementwise_seconds", "ep", "experts_dtype", "extrapolated",
             "graph_sizes", "hardware", "lm_head_seconds", "lockstep_moe_seconds", "model", "moe_group", "moe_span", "moe_kernel",
             "moe_seconds", "moe_tp",
             "notes", "ops", "parts", "prices_sampler", "profile_name", "request_seconds", "sampler_version", "sampling",
             "sequence_parallel_moe", "set_cuda_graph_sizes", "sources", "step_seconds", "system", "total", "tp",
             "weights_dtype")


def _forward(name: str) -> property:
    return property(lambda self: getattr(self.inner, name), doc=f"The wrapped backend's {name}.")


for _name in FORWARDED:
    setattr(HostTimedBackend, _name, _forward(_name))


def with_host_time(backend, async_scheduling: bool, host_time: bool, host_reference_loop_s: float | None,
                   tp: int, vllm_version: str | None = None):
    """`backend` with the host's seconds in each step (a HostTimedBackend: the profile of `vllm_version`, else
    the nearest measured, None: the newest), or as it is with host time off. Tensor parallelism runs the model
    runner in worker processes (vLLM's "mp" executor at world size > 1)."""
    if not host_time or backend is None or isinstance(backend, HostTimedBackend):
        return backend
    if getattr(backend, "name", "") == "real":  # it times its own steps, the CPU's preparation included
        return backend
    return HostTimedBackend(backend, HostTime.load(host_reference_loop_s=host_reference_loop_s,
                                                   vllm_version=vllm_version),
                            async_scheduling, tp > 1)


def host_time_summary(async_scheduling: bool, host_time: bool, host_reference_loop_s: float | None,
                      vllm_version: str | None = None) -> dict:
    """What summary.json says of the engine's clock: the host profile, the vLLM version asked for (None: the
    newest) and how the profile's was chosen (`choose_profile`)."""
    out: dict = {"async_scheduling": async_scheduling, "host_time": host_time}
    if host_time:
        host = HostTime.load(host_reference_loop_s=host_reference_loop_s, vllm_version=vllm_version)
        out.update({"profile": Path(host.source).name, "profile_cpu": host.cpu, "vllm_version": host.vllm_version,
                    "asked_vllm_version": vllm_version, "version_choice": host.version_choice,
                    "profile_reference_loop_s": host.reference_loop_s,
                    "host_reference_loop_s": host_reference_loop_s, "scale": host.scale,
                    "cpu": "the profile's own" if host_reference_loop_s is None else "the serving host's, by "
                    "its reference loop"})
    return out
