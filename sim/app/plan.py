"""Options resolved, once, into what a run runs on.

`resolve(options)` looks up the model (a preset or a Hugging Face config.json) and the hardware
(a preset or a JSON file), loads the policy class and the profile, builds the backend, and settles
the KV cache plan: the backend's own cache where it has one (the real backend), else the blocks
vLLM would allocate (backends/kv_capacity.py; `--num-gpu-blocks` replaces the figure as vLLM's
num_gpu_blocks_override does). The cost model is the profile given (`--profile roofline`: the
datasheet roofline), else the committed operator-table profile matching the run (sim/app/opprofiles.py),
else the roofline. Everything downstream (the replay, sweeps, capacity search, compare,
bench) receives the `RunPlan`, never the raw options.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

from backends.costmodel.optables.profile import is_op_profile, op_profile_from_json
from backends.hardware import Hardware, resolve_hardware
from backends.host_time import host_time_summary, with_host_time
from backends.kv_capacity import KVCapacity, kv_cache_groups, kv_capacity, max_in_flight_tokens
from backends.model_config import ModelConfig, resolve_model, served_kv_cache_dtype
from backends.sampler import GREEDY, Sampling, resolve_sampling
from policies import Policy, load_policy
from policies.routers import load_router
from sim.app.cluster_options import ClusterOptions, naming_pool
from sim.app.opprofiles import (
    ROOFLINE,
    cache_dir,
    check_matches,
    matching_profile,
    read_profile_json,
    system_has_tables,
    system_of,
    system_profile,
    tables_summary,
)
from sim.app.options import SCHEDULER_DEFAULTS, VLLM_BATCH_FIELDS, ReplayOptions, vllm_batch_defaults
from sim.backend import Backend
from sim.block_manager import BlockManager
from sim.config import MAX_CLUSTER_BLOCKS, cuda_graph_sizes, is_blackwell
from sim.errors import ServesimError
from sim.sliding_block_manager import SlidingWindowBlockManager
from sim.tokens import TokenSpec


@dataclass(frozen=True)
class RunPlan:
    options: ReplayOptions
    model: ModelConfig
    hardware: Hardware
    policy: type[Policy]
    max_model_len: int
    num_blocks: int  # KV blocks of the cache
    kv: KVCapacity | None  # how num_blocks was derived; None: the real backend sized its own cache
    backend: Backend | None  # None for a plan checked without building its backend
    token_spec: TokenSpec
    router: type | None = None  # the cluster's router class (policies/routers.py)
    pools: tuple["RunPlan", ...] = ()  # disaggregated: the prefill pool's plan and the decode pool's
    tables: dict | None = None  # a profile derived from the package's tables: their system and versions
    sampling: Sampling = GREEDY  # the requests' sampling parameters (--sampling, resolved for the model)
    cuda_graph_sizes: tuple[int, ...] = ()  # the steps the server captures CUDA graphs for (sim.config.cuda_graph_sizes)

    @property
    def scheduler(self):
        return self.options.scheduler

    @property
    def priced_by_roofline(self) -> bool:
        """Whether the cost model fell back on the datasheet roofline: no profile given or matching, no
        system's tables, not a mixture of experts' table model (which names its own per operator)."""
        backend = self.backend
        return (self.options.backend == "costmodel" and backend is not None and self.options.profile is None
                and not self.tables and not hasattr(backend, "cost_model_summary") and not hasattr(backend, "ops"))

    @property
    def cache(self):
        return self.options.cache

    def make_policy(self) -> Policy:
        return self.policy(self.options.scheduler)

    def make_block_manager(self) -> BlockManager:
        """The KV cache's block manager. A model with sliding-window layers (alone, or beside
        full-attention ones in several KV cache groups) gets vLLM's sliding-window manager
        (sim/sliding_block_manager.py), its layout handed over as plain data (the core imports no
        backend): each group's kind and window, and SlidingWindowSpec's admission tokens (window - 1 +
        vLLM's tokens in flight, at most max_model_len). With --disable-hybrid-kv-cache-manager a model
        of sliding and full-attention layers has one full-attention group (kv_cache_groups): the plain
        block manager, vLLM's FullAttentionManager under its UnitaryKVCacheCoordinator."""
        cache, scheduler = self.options.cache, self.options.scheduler
        groups = kv_cache_groups(self.model, cache.disable_hybrid_kv_cache_manager)
        if any(g.kind == "sliding_attention" for g in groups):
            window = max(g.sliding_window or 0 for g in groups)
            # A step's tokens: at most the budget, or (a policy admitting whole prompts beyond it) a whole prompt.
            step_tokens = scheduler.max_num_batched_tokens
            if getattr(self.policy, "whole_prompts", False):
                step_tokens = max(step_tokens, self.max_model_len)
            in_flight = max_in_flight_tokens(step_tokens, scheduler.async_scheduling)
            admission = min(window - 1 + in_flight, self.max_model_len)
            return SlidingWindowBlockManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                             tuple((g.kind, g.sliding_window) for g in groups), admission)
        return BlockManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching)

    def make_router(self, pool: int = 0):
        """A router for one pool of the cluster (pool 0: the colocated or prefill replicas, 1:
        the decode replicas), seeded from --seed and the pool."""
        return self.router(self.options.seed + pool)

    def kv_link(self):
        """A disaggregated cluster's KV link (sim/app/cluster_options.py), by the GPUs of its pools
        and their hardware's node. Pools on two kinds of GPU sit in two nodes: their network, the
        slower of the two where both state one."""
        cluster = self.options.cluster
        prefill, decode = self.pools
        num_gpus = cluster.num_prefill_replicas * prefill.options.tp + cluster.num_decode_replicas * decode.options.tp
        if prefill.hardware == decode.hardware:
            return cluster.kv_link(num_gpus, prefill.hardware)
        slower = min((prefill.hardware, decode.hardware), key=lambda h: h.inter_node_bandwidth or math.inf)
        return cluster.kv_link(num_gpus, slower, across=True)

    def as_dict(self) -> dict:
        """The options as the run used them (summary.json, sweep rows). A lone engine's leave the
        cluster out, so its files are those of servesim before clusters."""
        d = asdict(self.options)
        del d["batch_defaults"]  # resolved into the scheduler's values (resolve)
        if self.options.backend == "costmodel" and self.model.is_extended:
            # A mixture of experts' checkpoint quantization is served whatever --dtype, as the terminal
            # says (a dense checkpoint's is resolved into `dtype` itself: `resolve`, served_dtype)
            weights, experts = self.model.linear_dtypes(self.options.dtype)
            d["dtype"] = weights
            if experts != weights:
                d["experts_dtype"] = experts
        if not self.options.enable_expert_parallel:  # dense runs' files as before the flag
            del d["enable_expert_parallel"]
        if self.options.dp == 1:  # runs without data parallelism keep the summary they had
            del d["dp"]
        if d["api_server"] == "auto":
            del d["api_server"]  # runs that left it keep the summary they had (run_options says where it applied)
        if d["vllm_version"] is None:
            del d["vllm_version"]  # runs without it keep the summary they had
        if d["sampling"] == "greedy" and self.sampling.greedy:
            del d["sampling"]  # greedy runs keep the summary they had
        else:  # the parameters as resolved (`model`: the generation config's), and the sampler's path
            d["sampling"] = {"given": d["sampling"], **self.sampling.to_json(),
                             "path": self.sampling.path(self.model.vocab_size)}
        if not d["allreduce_fusion_max_mb"]:
            del d["allreduce_fusion_max_mb"]  # runs without it keep the summary they had
        if d["max_cudagraph_capture_size"] is None:
            del d["max_cudagraph_capture_size"]  # runs of vLLM's default capture sizes keep the summary they had
        if self.tables is not None:
            d["operator_tables"] = self.tables
        if not self.model.num_experts:
            del d["moe_distribution"]  # dense runs keep the summary they had
        if d["moe_kernel"] == "auto":
            del d["moe_kernel"]  # runs of vLLM's default kernel keep the summary they had
        if hasattr(self.backend, "cost_model_summary"):
            d["cost_model"] = self.backend.cost_model_summary()  # per operator: the table or the roofline
        elif self.priced_by_roofline:  # said, where it was only implied by a profile of null
            d["cost_model"] = "roofline: the datasheet's peaks and bandwidth (no operator-table profile matches)"
            if self.options.tp > 1:  # how its all-reduces are priced, as the tables' runs say theirs
                from backends.costmodel.tensor_parallel import allreduce_latency_s

                link, bandwidth = self.hardware.group_link(self.options.tp)
                latency = allreduce_latency_s(self.hardware.link, self.options.tp)
                d["cost_model"] += (f"; all-reduce: a ring over {link} at {bandwidth / 1e9:g} GB/s a direction plus "
                                    f"{latency * 1e6:g} us (no measured all-reduce table)")
        sched = self.options.scheduler
        # (the real backend times its own steps, the CPU's preparation included: no host-time model is added,
        # and summary.json says so; found by a review, it said host_time true with a vLLM profile)
        applied = sched.host_time and self.options.backend != "real"
        d["engine_clock"] = host_time_summary(sched.async_scheduling, applied, sched.host_reference_loop_s,
                                              self.options.vllm_version)
        if sched.host_time and not applied:
            d["engine_clock"]["host_time_note"] = ("the real backend's steps are measured, its CPU's preparation "
                                                   "included: no host-time model is added")
        d["scheduler"]["max_model_len"] = self.max_model_len
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if d["scheduler"][name] is None:
                del d["scheduler"][name]  # runs without vLLM's admission limits keep the summary they had
        if d["scheduler"]["stream_interval"] == 1:
            del d["scheduler"]["stream_interval"]  # runs streaming every token keep the summary they had
        d["cache"]["num_blocks"] = self.num_blocks
        if not d["cache"]["disable_hybrid_kv_cache_manager"]:
            del d["cache"]["disable_hybrid_kv_cache_manager"]  # runs without it keep the summary they had
        cluster = d.pop("cluster")
        if not self.options.cluster.is_single:
            d["cluster"] = cluster
            for role, pool in zip(("prefill", "decode"), self.pools):
                resolved = pool.as_dict()
                cluster[role] = {key: resolved[key] for key in ("scheduler", "cache", "hardware", "tp", "dtype",
                                                                "kv_cache_dtype", "profile")}
        return d

    def total_blocks(self) -> int:
        """KV blocks of every replica together (each a block manager in this process's memory)."""
        cluster = self.options.cluster
        if self.options.dp > 1:
            return self.options.dp * self.num_blocks
        if cluster.is_disaggregated:
            prefill, decode = self.pools
            return cluster.num_prefill_replicas * prefill.num_blocks + cluster.num_decode_replicas * decode.num_blocks
        return cluster.num_replicas * self.num_blocks

    def check_host_memory(self) -> None:
        """A cluster's block managers together fit in host memory (sim.config.MAX_CLUSTER_BLOCKS)."""
        if self.options.cluster.is_single and self.options.dp == 1:
            return
        total = self.total_blocks()
        if total > MAX_CLUSTER_BLOCKS:
            raise ServesimError(f"the cluster's replicas hold {total:,} KV blocks together; servesim simulates at most "
                                f"{MAX_CLUSTER_BLOCKS:,} (each block takes about 60 bytes of host memory): fewer "
                                "replicas, a larger --block-size or a smaller --num-gpu-blocks")

    def warnings(self) -> list[str]:
        """What the command prints before it runs: a capped KV cache, the pools' too; a fused
        all-reduce asked for where there is no all-reduce."""
        plans = (self, *self.pools)
        found = [w for p in plans if p.kv is not None for w in [p.kv.warning()] if w]
        if self.options.allreduce_fusion_max_mb and self.options.tp == 1:
            found.append(FUSION_AT_TP1)
        if self.model.index_topk and self.options.kv_cache_dtype == "fp8" and is_blackwell(self.hardware.name):
            found.append(SPARSE_FP8_ON_BLACKWELL)
        if self.options.moe_distribution != "auto" and not self.model.num_experts:
            # (kept, not refused: a sweep over dense and MoE models may keep one value; summary.json leaves it out)
            found.append(f"--moe-distribution {self.options.moe_distribution}: {self.model.name} has no experts to "
                         "spread tokens over; the flag changes nothing in this run")
        for p in plans:  # a cache given by --num-gpu-blocks larger than the memory left for it
            kv = p.kv
            if kv is not None and kv.source == "--num-gpu-blocks" and \
                    kv.num_gpu_blocks * kv.block_bytes > kv.terms["available"]:
                found.append(f"--num-gpu-blocks {kv.num_gpu_blocks}: {kv.num_gpu_blocks * kv.block_bytes / 2**30:.2f} "
                             f"GiB of KV cache per GPU, more than the {max(kv.terms['available'], 0) / 2**30:.2f} GiB "
                             f"left on {p.hardware.name} after the weights and activations (summary.json kv_cache); "
                             "vLLM would fail to allocate it, here it runs as given")
        capture = self.options.max_cudagraph_capture_size
        if capture is not None and capture < self.options.scheduler.max_num_seqs:
            # (steps past the graphs are priced by their kernels' GPU time, unpadded; the CPU time of launching
            # each kernel, which an eager decode step of a small model waits on, is not priced)
            found.append(f"--max-cudagraph-capture-size {capture}: decode steps of more requests run without CUDA "
                         "graphs and are priced by their kernels' GPU time alone, unpadded, without the CPU time of "
                         "launching each kernel; vLLM's eager steps of a small model wait on those launches, so "
                         "they are slower than priced here")
        for p in plans:  # an operator the measured tables were meant to price, left to the roofline
            if hasattr(p.backend, "cost_model_summary"):
                for op, source in p.backend.cost_model_summary().get("operators", {}).items():
                    if isinstance(source, str) and source.startswith(ROOFLINE_FALLBACK):
                        found.append(f"the {op} is priced by the datasheet roofline, not measured tables: "
                                     f"{source.removeprefix(ROOFLINE_FALLBACK)} (summary.json cost_model)")
        return found

    def kv_cache(self) -> dict:
        """The KV blocks used and how they were derived (summary.json)."""
        if self.kv is None:
            return {"num_gpu_blocks": self.num_blocks, "source": "the real backend's own allocation"}
        return self.kv.as_dict()  # a capped cache says so (KVCapacity.capped_from)


SPARSE_FP8_ON_BLACKWELL = ("an fp8 KV cache of DeepSeek sparse attention is priced as FlashMLA's fp8_ds_mla rows, 656 "
                           "bytes a token and layer; on Blackwell vLLM runs FlashInfer's sparse backend first, whose "
                           "plain fp8 rows take 576 bytes: about 10% more KV blocks than counted here")
ROOFLINE_FALLBACK = "roofline: "  # a cost model's source for an operator its tables lack (then the reason)
FUSION_AT_TP1 = ("--allreduce-fusion-max-mb changes nothing at --tp 1: one GPU has no all-reduce to fuse "
                 "(its RMSNorms are priced as without the flag)")


# Options of vLLM's scheduler that only `chunked` follows: (field, its value when off, what it does to chunked).
CHUNKED_ONLY = (("cache_aware_admission_window", 0, "reorders the waiting queue of"),
                ("prefill_schedule_interval", 1, "holds the prefills of"),
                ("long_prefill_token_threshold", 0, "caps the prefill chunks of"),
                ("long_prefill_token_threshold_adaptive", False, "raises the prefill cap of"))


def check_chunked_options(options: ReplayOptions, policy: type[Policy]) -> None:
    """Refuse a chunked-only option given to another policy (a cap no other policy reads was recorded in
    summary.json and priced nothing), the adaptive cap without a cap to raise, and each where vLLM ignores it or servesim
    does not model it: --cache-aware-admission-window reorders an FCFS queue by what the prefix cache
    holds (vLLM 0.34 ignores it under priority or without prefix caching: `Scheduler.__init__`,
    `cache_aware_window`). --prefill-schedule-interval applies with --dp too: a mixture of experts'
    ranks share their DP group's cadence, a dense model's each run their own (sim/data_parallel.py)."""
    from policies.chunked import ChunkedPolicy

    sched = options.scheduler
    for name, off, does in CHUNKED_ONLY:
        value = getattr(sched, name)
        if value != off and not issubclass(policy, ChunkedPolicy):
            flag = f"--{name.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
            raise ServesimError(f"{flag} {does} the chunked policy (vLLM's scheduler), not of {sched.policy}")
    if sched.long_prefill_token_threshold_adaptive and not sched.long_prefill_token_threshold:
        raise ServesimError("--long-prefill-token-threshold-adaptive raises the cap --long-prefill-token-threshold N "
                            "sets, and there is none (0: no cap), so it would change nothing; give both, or neither")
    window = sched.cache_aware_admission_window
    if window and sched.scheduling_policy != "fcfs":
        raise ServesimError(f"--cache-aware-admission-window {window} needs --scheduling-policy fcfs: vLLM ignores it "
                            f"under {sched.scheduling_policy}")
    if window and not options.cache.enable_prefix_caching:
        raise ServesimError(f"--cache-aware-admission-window {window} orders requests by their cached prefix: it needs "
                            "prefix caching (drop --no-prefix-caching)")


SPARSE_BLOCK_SIZE = 64  # the only block size vLLM's DeepSeek-sparse-attention indexer cache takes


def resolve(options: ReplayOptions, backend: Backend | None = None, build_backend: bool = True,
            host_vllm_version: str | None = None, sampling: Sampling | None = None) -> RunPlan:
    """The plan of a run. `backend`: use this one instead of building it; `build_backend=False`:
    check everything but build no backend (sweeps check every point before running any);
    `host_vllm_version`: the vLLM version whose host time profile (and sampler) the steps carry where it is
    not --vllm-version's (sim validate's rows: each its own; None: --vllm-version's, else the newest);
    `sampling`: the requests' sampling parameters instead of --sampling's (sim validate's rows)."""
    given, given_backend = options, backend
    model = resolve_model(options.model)
    hardware = resolve_hardware(options.hardware)
    if options.batch_defaults:
        options = with_batch_defaults(options, hardware)
    if options.backend == "costmodel":
        served = model.served_dtype(options.dtype)  # a dense fp8 checkpoint's fp8, as vLLM serves it
        if served != options.dtype:
            options = replace(options, dtype=served)
        kv_cache_dtype = served_kv_cache_dtype(model, options.kv_cache_dtype, hardware.name)  # as vLLM resolves auto
        if kv_cache_dtype != options.kv_cache_dtype:
            options = replace(options, kv_cache_dtype=kv_cache_dtype)
    model.check_tp(options.tp)
    if model.index_topk and options.cache.block_size != SPARSE_BLOCK_SIZE:
        raise ServesimError(f"--block-size {options.cache.block_size}: vLLM serves {model.name}'s DeepSeek sparse "
                            f"attention with {SPARSE_BLOCK_SIZE}-token blocks only (its indexer's cache: "
                            "DeepseekV32IndexerBackend.get_supported_kernel_block_sizes, "
                            f"vllm/v1/attention/backends/mla/indexer.py); pass --block-size {SPARSE_BLOCK_SIZE}")
    hardware.check_tp(options.tp)
    if options.dp > 1:  # vLLM's divisibility rules for the experts over tp x dp GPUs
        model.check_parallel(options.tp, options.dp, options.enable_expert_parallel, options.dtype)
        if model.num_experts and hardware.link is None:  # (it was an internal error: a ring over no link)
            raise ServesimError(f"--dp {options.dp} on a mixture of experts ({model.name}) gathers and scatters "
                                "every MoE layer's tokens among the ranks' GPUs, which needs a link between them; "
                                f"hardware {hardware.name} has neither nvlink_bandwidth nor pcie_bandwidth")
    limit = model.max_position_embeddings
    max_model_len = options.scheduler.max_model_len
    if max_model_len is not None and max_model_len > limit:
        raise ServesimError(f"--max-model-len {max_model_len} is more than {model.name}'s "
                            f"max_position_embeddings ({limit})")
    policy = load_policy(options.scheduler.policy)
    check_chunked_options(options, policy)
    calibration, op_profile, tables = None, None, None
    if options.vllm_version is not None and options.profile is not None:
        raise ServesimError(f"--vllm-version picks the tables a profile is derived from; it does not apply with "
                            f"--profile {options.profile}")
    if options.backend == "costmodel" and options.profile != ROOFLINE:
        if options.profile is not None:
            data = read_profile_json(options.profile)
            if is_op_profile(data):
                op_profile = op_profile_from_json(data, options.profile)
                check_matches(op_profile, options.profile, model, hardware, options.tp, options.dtype,
                              options.kv_cache_dtype)
            else:
                from backends.profile import load_profile

                if not options.is_default_deployment:
                    raise ServesimError("--tp, --dtype fp8 and --kv-cache-dtype fp8 need the roofline or an "
                                        "operator-table profile; a fitted profile was measured on one device in its "
                                        "own dtype")
                calibration = load_profile(options.profile, model).calibration  # refuses another model's
        elif model.is_extended and backend is None and build_backend and system_of(hardware) is not None \
                and system_has_tables(system_of(hardware)):
            # MoE, MLA and sliding windows: each operator from the system's measured tables, else the roofline.
            from backends.costmodel.optables.moe import moe_table_model
            from backends.costmodel.optables.systems import require_package

            backend = moe_table_model(model, hardware, system_of(hardware), require_package() / "data", options.tp,
                                      options.dtype, options.kv_cache_dtype, options.enable_expert_parallel,
                                      dp=options.dp, distribution=options.moe_distribution,
                                      vllm_version=options.vllm_version, cache=cache_dir(),
                                      moe_kernel=options.moe_kernel)
        else:
            fusion = options.allreduce_fusion_max_mb
            found = None if options.vllm_version or fusion else matching_profile(
                model, hardware, options.tp, options.dtype, options.kv_cache_dtype)
            if found is None and backend is None and build_backend and hardware.system is not None \
                    and not system_has_tables(hardware.system) and (options.vllm_version is not None or fusion):
                flag = "--vllm-version" if options.vllm_version is not None else "--allreduce-fusion-max-mb"
                raise ServesimError(f"{flag} prices the run from the hardware's system's vLLM operator tables, and "
                                    f"{hardware.system} has none (sim hardware: the roofline only); leave {flag} out "
                                    "to run it on the roofline")
            if found is None and backend is None and build_backend and (
                    options.vllm_version is not None or fusion or hardware.system is not None
                    and system_has_tables(hardware.system)):
                # A system of the package (or a vLLM version asked for): its tables, derived once and cached.
                found = system_profile(model, hardware, options.tp, options.dtype, options.kv_cache_dtype,
                                       options.vllm_version, fusion)
                tables = tables_summary(found[0], hardware)
                if fusion and options.tp == 1:
                    tables["allreduce"] = FUSION_AT_TP1
            if found is not None:  # the committed (or derived) operator-table profile of this deployment
                op_profile, path = found
                options = replace(options, profile=str(path))
    if options.allreduce_fusion_max_mb and op_profile is None and build_backend:
        raise ServesimError(f"--allreduce-fusion-max-mb prices the fused all-reduces from the operator tables of the "
                            f"hardware's system (a dense model, no --profile, the tables extra); this run of "
                            f"{model.name} on {hardware.name} is priced another way")
    if options.moe_kernel != "auto" and build_backend and not hasattr(backend, "moe_kernel"):
        raise ServesimError(f"--moe-kernel {options.moe_kernel} prices a mixture of experts' fused-MoE layer from the "
                            f"moe_perf tables of the hardware's system (the tables extra); this run of {model.name} "
                            f"on {hardware.name} has no such layer priced from them")
    if options.moe_distribution != "auto" and model.num_experts and build_backend and not hasattr(backend, "moe_kernel"):
        # (A dense model has no experts to route: the flag changes nothing and summary.json leaves it out, so a
        # sweep over dense and MoE models may keep one value.) A MoE priced another way would record a
        # distribution that priced nothing.
        raise ServesimError(f"--moe-distribution {options.moe_distribution} prices a mixture of experts' fused-MoE "
                            "layer from the moe_perf tables of the hardware's system (the tables extra); this run of "
                            f"{model.name} on {hardware.name} is priced another way, which spreads no tokens over "
                            "experts")
    if options.dtype == "fp4" and op_profile is None and backend is None:
        raise ServesimError(f"--dtype fp4 on {hardware.name}: fp4 (nvfp4) weights are priced from operator tables "
                            "that measure nvfp4 GEMMs, and no profile or system of the tables extra prices this run "
                            "so; run it on a system whose vLLM tables have them (--hardware b200_sxm or b300_sxm, "
                            "sim hardware lists the systems)")
    if backend is None and build_backend:
        if op_profile is not None:
            from backends.costmodel.optables.backend import OpTableBackend

            backend = OpTableBackend(op_profile.op_model(), device=hardware.name, profile_name=options.profile)
        else:
            backend = make_backend(options, model, hardware, calibration)
    if sampling is None:
        sampling = resolve_sampling(options.sampling, model.name, options.model)
    set_sampler(backend, sampling, host_vllm_version or options.vllm_version, model, hardware)
    cache, scheduler = options.cache, options.scheduler
    graphs = cuda_graph_sizes(scheduler.max_num_seqs, hardware.name, host_vllm_version or options.vllm_version,
                              scheduler.max_num_batched_tokens, options.max_cudagraph_capture_size)
    set_cuda_graphs(backend, graphs)
    backend = with_host_time(backend, scheduler.async_scheduling, scheduler.host_time,
                             scheduler.host_reference_loop_s, options.tp,
                             host_vllm_version or options.vllm_version)  # the engine core's CPU (docs/async-scheduling.md)
    kv = None
    if backend is not None and backend.num_blocks is not None:
        num_blocks = backend.num_blocks  # the real backend's cache: hand out exactly its block ids
    else:
        kv = kv_capacity(model, hardware, block_size=cache.block_size,
                         gpu_memory_utilization=cache.gpu_memory_utilization,
                         max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs,
                         tp=options.tp, dtype=options.dtype, kv_cache_dtype=options.kv_cache_dtype,
                         max_model_len=max_model_len or limit, num_gpu_blocks_override=cache.num_blocks,
                         dp=options.dp, enable_expert_parallel=options.enable_expert_parallel,
                         async_scheduling=scheduler.async_scheduling,
                         disable_hybrid_kv_cache_manager=cache.disable_hybrid_kv_cache_manager)
        num_blocks = kv.num_gpu_blocks  # capped to MAX_NUM_BLOCKS, and said so (kv.capped_from)
    cluster = options.cluster
    router = load_router(cluster.router)
    pools = ()
    if cluster.is_disaggregated:
        # Each pool resolves from the options as given: its own hardware, TP or dtype picks its own default profile.
        # (The backend built above is the top level's: a pool builds its own unless the caller gave one.)
        pools = tuple(_resolve_pool(cluster, given, role, given_backend, build_backend) for role in ("prefill", "decode"))
    plan = RunPlan(options, model, hardware, policy, max_model_len or limit, num_blocks, kv, backend,
                   TokenSpec(options.seed, model.vocab_size), router, pools, tables, sampling, graphs)
    plan.check_host_memory()
    return plan


def prices_sampler(target) -> bool:
    """Whether the cost model `target` prices vLLM's sampler kernels by the sampling parameters (backends/sampler.py):
    the operator-table models, the MoE one where its tables give the small kernels' floor and bandwidth."""
    return hasattr(target, "sampler_version") and getattr(target, "prices_sampler", True)


def set_sampler(backend, sampling: Sampling, vllm_version: str | None, model: ModelConfig, hardware: Hardware) -> None:
    """Price `backend`'s sampler for `sampling` as vLLM `vllm_version` (None: the newest) runs it: the
    operator-table cost models (dense and MoE) price its kernels (backends/sampler.py). Another backend
    prices no sampler of its own (the roofline) or runs its own (the real backend, a fitted profile), so a
    sampling other than greedy is refused there rather than recorded and not priced."""
    if backend is None:
        return
    target = getattr(backend, "ops", backend)  # the operator-table backend's OperatorModel
    if prices_sampler(target):
        target.sampling, target.sampler_version = sampling, vllm_version
    elif not sampling.greedy:
        if getattr(backend, "name", "") == "real":
            raise ServesimError(f"--sampling {sampling.describe()} prices vLLM's sampler kernels in the cost model; the "
                                "real backend measures its own steps: leave --sampling at greedy")
        raise ServesimError(f"--sampling {sampling.describe()} prices vLLM's sampler kernels from the operator tables; "
                            f"this run of {model.name} on {hardware.name} is priced another way "
                            f"({type(backend).__name__}), which prices no sampler: leave "
                            "--sampling at greedy, or price from the tables (a system of the tables extra, or a profile "
                            "of profiles/ops/)")


def set_cuda_graphs(backend, sizes: tuple[int, ...]) -> None:
    """Give the operator-table models (dense and MoE) the deployment's CUDA-graph sizes (`cuda_graph_sizes`:
    what its --max-num-seqs, GPU and vLLM version make vLLM capture): the steps they pad, and those whose
    all-reduces run in a graph."""
    target = getattr(backend, "ops", backend)
    if backend is not None and hasattr(target, "set_cuda_graph_sizes"):
        target.set_cuda_graph_sizes(sizes)


def _resolve_pool(cluster: ClusterOptions, given: ReplayOptions, role: str, given_backend, build_backend: bool) -> RunPlan:
    """One pool's plan. A refusal names the pool's flag where the pool was given settings of its own (an
    unknown hardware=, a tp= that does not split the model): the refused value may be one of them."""
    options = cluster.pool(given, role)  # names the flag itself
    text, flag = cluster.pool_options(role)
    with naming_pool(flag) if text else nullcontext():
        return resolve(options, given_backend, build_backend)


def with_batch_defaults(options: ReplayOptions, hardware: Hardware) -> ReplayOptions:
    """`options` with the scheduler's fields the command line left unset (`batch_defaults`) at vLLM's API
    server's defaults for `hardware` (`vllm_batch_defaults`); the real backend runs on --device and keeps
    SchedulerConfig's. A budget below --max-num-seqs, or --max-num-active-seqs above it, is refused, as
    vLLM's SchedulerConfig refuses them, naming the default that made it."""
    costmodel = options.backend == "costmodel"
    values = vllm_batch_defaults(hardware.memory_bytes, hardware.name) if costmodel else dict(SCHEDULER_DEFAULTS)
    values = {k: v for k, v in values.items() if k in options.batch_defaults and k in VLLM_BATCH_FIELDS}
    budget = values.get("max_num_batched_tokens", options.scheduler.max_num_batched_tokens)
    seqs = values.get("max_num_seqs", options.scheduler.max_num_seqs)
    if budget < seqs:
        whose = f"vLLM's default {{}} on {hardware.name}" if costmodel else "the real backend's default {}"
        if "max_num_seqs" in values:
            what = f"--max-num-batched-tokens {budget} is less than {whose.format('--max-num-seqs')} ({seqs})"
        else:
            what = f"--max-num-seqs {seqs} is more than {whose.format('--max-num-batched-tokens')} ({budget})"
        raise ServesimError(f"{what}: a step's budget must hold every running decode, and vLLM refuses the pair too; "
                            "give both flags")
    scheduler = replace(options.scheduler, **values)
    scheduler.check_max_num_active_seqs(hardware.name if costmodel and "max_num_seqs" in values else None)
    return replace(options, batch_defaults=(), scheduler=scheduler)


def make_backend(options: ReplayOptions, model: ModelConfig, hardware: Hardware, calibration=None) -> Backend:
    if options.backend == "real":
        from backends.real import RealBackend

        return RealBackend(model, device=options.device, block_size=options.cache.block_size,
                           num_blocks=options.cache.num_blocks, seed=options.seed, weights=options.weights,
                           gpu_memory_utilization=options.cache.gpu_memory_utilization,
                           max_num_batched_tokens=options.scheduler.max_num_batched_tokens,
                           max_num_seqs=options.scheduler.max_num_seqs)
    from backends.costmodel import make_cost_model

    return make_cost_model(model, hardware, calibration, tp=options.tp, dtype=options.dtype,
                           kv_cache_dtype=options.kv_cache_dtype, enable_expert_parallel=options.enable_expert_parallel,
                           dp=options.dp)
