"""Options resolved, once, into what a run runs on.

`resolve(options)` looks up the model and the hardware, loads the policy class and the profile,
builds the backend, and settles the KV cache plan (the backend's own cache size where it has one,
else `--num-blocks`, else what fits the hardware's memory). Everything downstream (the replay,
sweeps, capacity search, compare) receives the `RunPlan`, never the raw options.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from backends.presets import derive_num_blocks, get_hardware, get_model
from policies import Policy, load_policy
from sim.app.options import ReplayOptions
from sim.backend import Backend
from sim.block_manager import BlockManager
from sim.errors import ServesimError
from sim.tokens import TokenSpec


@dataclass(frozen=True)
class RunPlan:
    options: ReplayOptions
    model: dict  # the model's config fields (backends/presets.py)
    hardware: dict  # the hardware's datasheet figures
    policy: type[Policy]
    max_model_len: int
    num_blocks: int  # KV blocks of the cache
    backend: Backend | None  # None for a plan checked without building its backend
    token_spec: TokenSpec

    @property
    def scheduler(self):
        return self.options.scheduler

    @property
    def cache(self):
        return self.options.cache

    def make_policy(self) -> Policy:
        return self.policy(self.options.scheduler)

    def make_block_manager(self) -> BlockManager:
        cache = self.options.cache
        return BlockManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching)

    def as_dict(self) -> dict:
        """The options as the run used them (summary.json, sweep rows)."""
        d = asdict(self.options)
        d["scheduler"]["max_model_len"] = self.max_model_len
        d["cache"]["num_blocks"] = self.num_blocks
        return d


def resolve(options: ReplayOptions, backend: Backend | None = None, build_backend: bool = True) -> RunPlan:
    """The plan of a run. `backend`: use this one instead of building it; `build_backend=False`:
    check everything but build no backend (sweeps check every point before running any)."""
    model = get_model(options.model)
    hardware = get_hardware(options.hardware)
    limit = model["max_position_embeddings"]
    max_model_len = options.scheduler.max_model_len
    if max_model_len is not None and max_model_len > limit:
        raise ServesimError(f"--max-model-len {max_model_len} is more than {options.model}'s "
                            f"max_position_embeddings ({limit})")
    policy = load_policy(options.scheduler.policy)
    calibration = None
    if options.profile is not None:
        from backends.profile import load_profile

        calibration = load_profile(options.profile, options.model).calibration  # refuses another model's
    if backend is None and build_backend:
        backend = make_backend(options, calibration)
    cache = options.cache
    if backend is not None and backend.num_blocks is not None:
        num_blocks = backend.num_blocks  # the real backend's cache: hand out exactly its block ids
    elif cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        num_blocks = derive_num_blocks(model, hardware, cache.block_size, cache.gpu_memory_utilization,
                                       options.scheduler.max_num_batched_tokens, options.scheduler.max_num_seqs)
    return RunPlan(options, model, hardware, policy, max_model_len or limit, num_blocks, backend,
                   TokenSpec(options.seed, model["vocab_size"]))


def make_backend(options: ReplayOptions, calibration=None) -> Backend:
    if options.backend == "real":
        from backends.real import RealBackend

        return RealBackend(options.model, device=options.device, block_size=options.cache.block_size,
                           num_blocks=options.cache.num_blocks, seed=options.seed, weights=options.weights,
                           gpu_memory_utilization=options.cache.gpu_memory_utilization,
                           max_num_batched_tokens=options.scheduler.max_num_batched_tokens,
                           max_num_seqs=options.scheduler.max_num_seqs)
    from backends.costmodel import make_cost_model

    return make_cost_model(options.model, options.hardware, calibration)
