"""The options of one run, as the user gave them (checked as values, not yet resolved), and the
command line's flags, generated from them.

Every option is a field of a config dataclass (ReplayOptions here, SchedulerConfig and CacheConfig
in sim/config.py, ClusterOptions in sim/app/cluster_options.py) declared with `sim.config.option`:
default, flag, help and range in one place. `add_flags` turns a dataclass's fields into argparse
flags and `from_args` builds the dataclass back from the parsed flags, by keyword, as vLLM's
EngineArgs derives its flags from its configs' fields (vllm/engine/arg_utils.py: `get_kwargs`
reads each field's type, default and docstring; `EngineArgs.add_cli_args` adds them by config
group; `create_engine_config` builds the configs by keyword).

A new option of a run: add a field to the dataclass it belongs to with `option(default, flag=...,
help=..., range=...)`; the flag, its check and its place in summary.json follow. The output flags
every command shares (--out, --overwrite, --resume, --quiet) are `add_output_options`.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from sim.app.cluster_options import ClusterOptions
from sim.config import (
    CUDA_GRAPH_TOKENS,
    FUSION_MB,
    SEED,
    SLO,
    TENSOR_PARALLEL,
    CacheConfig,
    Option,
    Range,
    SchedulerConfig,
    check_options,
    option,
    option_of,
    vllm_release,
)
from sim.errors import ServesimError


def check_moe_distribution(flag: str, value) -> None:
    if value in ("auto", "balanced"):  # the usual values: no need to load the MoE cost model to check them
        return
    from backends.costmodel.optables.moe import check_moe_distribution as check

    check(flag, str(value))

def check_sampling_flag(flag: str, value) -> None:
    from backends.sampler import parse_sampling

    parse_sampling(str(value), flag)  # `model` is resolved with the model (sim.app.plan.resolve)


def check_named(flag: str, value) -> None:
    """A name or path that names something: an empty one was read as the current folder ('.: cannot read
    the hardware file: Is a directory', 'config.json: no such file')."""
    if not str(value).strip():
        raise ServesimError(f"{flag} must not be empty (an empty name was read as the current folder)")


BACKENDS = ("costmodel", "real")
# A vLLM release as its tables and its pip versions name it: 0.12.0, 0.10.1.1, 0.12.0rc1, 0.11.0.post1.
VLLM_VERSION = re.compile(r"\d+(\.\d+){1,3}(rc\d+|\.post\d+|\.dev\d+)?")
V1_DEFAULT_RELEASE = (0, 8)  # the first vLLM whose engine is V1 by default (VLLM_USE_V1=1)
DEFAULT_DEPLOYMENT = (1, "bf16", "auto")
# --moe-kernel's values: vLLM's own choice, or a kernel a launch script names (the cost model's
# MOE_KERNELS, backends/costmodel/optables/moe.py, not imported here to keep the CLI's start light)
MOE_KERNEL_CHOICES = ("auto", "marlin", "triton", "flashinfer", "flashinfer-mxfp8")
API_SERVER_CHOICES = ("auto", "on", "off")
DATA_PARALLEL = Range(1, 64, "ranks", "engine ranks of one data-parallel group, each a scheduler and KV cache in this "
                      "process's memory", whole=True)  # (tp, dtype, kv_cache_dtype) of one device in its own dtype


@dataclass(frozen=True)
class ReplayOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # A preset's name, or a config.json (or a folder holding one)
    model: str = option("Llama-3.1-8B", flag="--model", check=check_named, metavar="NAME|CONFIG",
                        help="model preset ({models}), a Hugging Face config.json or a folder holding one (dense "
                             "Llama, Mistral, Qwen2, Qwen3; the mixtures of experts, MLA, sliding-window, Qwen3-VL and "
                             "Llama 4 families of docs/moe.md), or with the tables extra a Hugging Face name "
                             "ORG/NAME whose config.json the package ships (default: {default})")
    hardware: str = option("H100-SXM", flag="--hardware", check=check_named, metavar="NAME|FILE.json",
                           help="hardware preset ({hardware}), a system of the tables extra (sim hardware lists them: "
                                "h100_sxm, b200_sxm, l40s, ...) or a JSON file with its fields "
                                "(docs/models-and-hardware.md; default: {default})")
    tp: int = option(1, flag="--tp", range=TENSOR_PARALLEL, metavar="N",
                     help="tensor parallelism: GPUs per engine, joined by NVLink (default: {default})")
    dtype: str = option("bf16", flag="--dtype", choices=("bf16", "fp8", "fp4"),
                        help="the weights' dtype: fp8 halves their bytes and uses the fp8 peak; fp4 (nvfp4) is priced "
                             "from operator tables only (default: {default})")
    kv_cache_dtype: str = option("auto", flag="--kv-cache-dtype", choices=("auto", "fp8"),
                                 help="the KV cache's dtype: auto (the checkpoint's where its quantization states "
                                      "one, as vLLM resolves auto; else bf16) or fp8, half the bytes per block "
                                      "(default: {default})")
    # vLLM's --data-parallel-size: engine ranks in lockstep behind its DP load balancer (sim/data_parallel.py)
    dp: int = option(1, flag="--dp", range=DATA_PARALLEL, metavar="N",
                     help="data parallelism (vLLM's --data-parallel-size): N engine ranks of --tp GPUs each, each "
                          "with its own scheduler and KV cache, fed by vLLM's DP load balancer and stepping "
                          "together through the MoE layers (default: {default})")
    enable_expert_parallel: bool = option(False, flag="--enable-expert-parallel", boolean=True,
                                          help="a mixture-of-experts model's experts split whole over the --tp GPUs, "
                                               "as vLLM's flag (default: off, each expert split by TP)")
    moe_distribution: str = option("auto", flag="--moe-distribution", check=check_moe_distribution,
                                   metavar="auto|balanced|power-law:ALPHA",
                                   help="how a mixture of experts' tokens spread over its experts, priced from the "
                                        "moe_perf tables that measured it: auto (default: the family's skewed "
                                        "routing, power-law:1.01 for DeepSeek-V3 and Kimi K2, power-law:1.2 for the "
                                        "others, as AIConfigurator prices them), balanced, or power-law:ALPHA (the "
                                        "tables measure 1.01 and 1.2)")
    # The fused-MoE kernel the server was told to run (backends/costmodel/optables/moe.py, NAMED_KERNELS)
    moe_kernel: str = option("auto", flag="--moe-kernel", choices=MOE_KERNEL_CHOICES,
                             help="the fused-MoE kernel the server runs a mixture of experts' experts with: auto "
                                  "(default: vLLM's own choice for the experts' dtype on the GPU), or the one a "
                                  "launch script names (marlin: VLLM_MXFP4_USE_MARLIN=1; flashinfer-mxfp8: "
                                  "VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1), priced from the tables' rows of that "
                                  "kernel, carried from another model's shape where none measure it at this one")
    backend: str = option("costmodel", flag="--backend", choices=BACKENDS, metavar="costmodel|real",
                          help="step-time backend: costmodel (default) or real (runs every step through a real "
                               "model)")
    seed: int = option(0, flag="--seed", range=SEED, help="seed of the synthetic token ids (default: {default})")
    slo: SLO = option(default_factory=SLO, flag="--slo", parse=SLO.parse, joined=True,
                      metavar="ttft=S,tpot=S,e2e=S,tbt=S,delay=S",
                      help="service-level objectives in seconds, for goodput: a request counts when its TTFT, TPOT, "
                           "E2E latency, every gap between its tokens (tbt) and its scheduling delay are within "
                           "those given (the keys of sim capacity's --slo)")
    device: str = option("cpu", flag="--device", choices=("cpu", "cuda"),
                         help="the real backend's device (default: {default})")
    # The real backend's safetensors folder; None: random weights
    weights: str | None = option(None, flag="--weights", check=check_named, metavar="DIR",
                                 help="the real backend's weights: a local safetensors folder with Hugging Face "
                                      "tensor names matching --model (default: random weights, seeded by --seed)")
    # A cost-model profile (sim calibrate: fitted, or --from-ops operator tables); "roofline": the
    # datasheet roofline; None: the committed operator-table profile matching the run, else the roofline.
    profile: str | None = option(None, flag="--profile", check=check_named, metavar="PROFILE.json|roofline",
                                 help="cost-model profile from `sim calibrate` (fitted, e.g. profiles/tiny-cpu.json, "
                                      "or derived from operator tables with --from-ops); roofline: the datasheet "
                                      "roofline (default: the operator-table profile in profiles/ops/ matching the "
                                      "model, hardware, --tp and dtypes, else the roofline)")
    cluster: ClusterOptions = field(default_factory=ClusterOptions)  # one replica by default
    # The vLLM version whose operator tables price the run (AIConfigurator's package, the tables
    # extra): that version, else the nearest the system has; None: the newest (sim/app/opprofiles.py).
    vllm_version: str | None = option(None, flag="--vllm-version", metavar="X.Y.Z",
                                      help="price the run with the operator tables of this vLLM version "
                                           "(AIConfigurator's package, pip install -e '.[tables]'): the version itself, "
                                           "else the nearest the system has (said on the terminal and in summary.json); "
                                           "default: a committed profile, else the newest")

    # The requests' sampling parameters: which of vLLM's sampler paths runs each step (backends/sampler.py)
    sampling: str = option("greedy", flag="--sampling", check=check_sampling_flag,
                           metavar="greedy|model|temperature=T[,top_p=P][,top_k=K]",
                           help="the requests' sampling parameters, which decide the kernels vLLM's sampler runs each "
                                "step (priced from the operator tables): greedy (default: temperature 0, what vllm bench "
                                "serve sent up to vLLM 0.14), model (the server's defaults from the model's "
                                "generation_config.json, what a client sending none gets: genai-perf, AIPerf, vllm bench "
                                "serve from 0.15; Qwen3's top_p 0.95 and top_k 20 make vLLM before 0.17 sort every step's "
                                "logits), or the parameters themselves")

    # vLLM's API server between a client's sends and the engine (sim/arrivals.py, through_api_servers;
    # sim/app/replay.py, with_api_server): "auto" models it for a trace of a client's sends (a vLLM bench result,
    # an AIPerf export)
    api_server: str = option("auto", flag="--api-server", choices=API_SERVER_CHOICES,
                             help="model vLLM's API server between the trace's sends and the engine: each request "
                                  "waits its turn at one of the servers (one per --dp rank, vLLM >= 0.15's default; "
                                  "else one) for 1 ms plus its prompt's tokenisation (2 us a token), as sim validate "
                                  "prices it, so TTFT is also reported from the send (requests.csv client_ttft_s). "
                                  "auto (default): on for a vLLM bench result or an AIPerf export, whose times are its client's "
                                  "sends, and in "
                                  "sim bench (vLLM's client); off for other traces, whose times are the engine's "
                                  "arrivals")

    # The scheduler's fields the command line left unset (VLLM_BATCH_FIELDS): sim.app.plan.resolve takes
    # vLLM's API server's defaults for the GPU for them (vllm_batch_defaults). Not a flag.
    batch_defaults: tuple[str, ...] = ()
    # vLLM's FlashInfer all-reduce fusion (pass_config.enable_fi_allreduce_fusion) up to this size:
    # priced from the system's TensorRT-LLM all-reduce table (backends/costmodel/optables/derive.py)
    max_cudagraph_capture_size: int | None = option(
        None, flag="--max-cudagraph-capture-size", range=CUDA_GRAPH_TOKENS, metavar="N",
        help="vLLM's --max-cudagraph-capture-size: the server captures CUDA graphs for steps up to N tokens "
             "(the grid's largest size at or below N), in place of its default min(2 x --max-num-seqs, 512; 1024 "
             "on B200 and B300 from vLLM 0.28): a step of at most that many tokens is priced padded to the next "
             "captured size with graph all-reduces, a longer one unpadded with eager ones (default: vLLM's)")
    allreduce_fusion_max_mb: float = option(0.0, flag="--allreduce-fusion-max-mb", range=FUSION_MB, metavar="MB",
                                            help="the server runs vLLM's FlashInfer all-reduce fusion "
                                                 "(compilation_config pass_config enable_fi_allreduce_fusion) for "
                                                 "all-reduces up to MB (its FI_ALLREDUCE_FUSION_MAX_SIZE_MB or "
                                                 "VLLM_FLASHINFER_ALLREDUCE_FUSION_THRESHOLDS_MB at this --tp): those "
                                                 "are priced from the system's TensorRT-LLM all-reduce table, the "
                                                 "kernel FlashInfer runs (the tables extra; default: 0, off)")

    def __post_init__(self) -> None:
        """Checks of the values alone; what they name (model, hardware, policy, profile) is looked
        up, once, by sim.app.plan.resolve."""
        check_options(self)
        if "max_num_seqs" not in self.batch_defaults:  # else once vLLM's default for the GPU is known (plan.py)
            self.scheduler.check_max_num_active_seqs()
        if not self.is_default_deployment and self.backend == "real":  # a fitted profile's: sim.app.plan
            raise ServesimError("--tp, --dtype fp8, --kv-cache-dtype fp8 and --enable-expert-parallel are priced by "
                                "the cost model; the real "
                                "backend runs one device in its own dtype")
        if self.device != "cpu" and self.backend != "real":
            raise ServesimError(f"--device {self.device} is the real backend's; it does not apply to --backend "
                                f"{self.backend} (whose hardware is --hardware)")
        if self.weights is not None and self.backend != "real":
            raise ServesimError(f"--weights loads the real backend's model; it does not apply to --backend {self.backend}")
        if self.dp > 1 and (self.backend == "real" or not self.cluster.is_single):
            raise ServesimError(f"--dp {self.dp} runs one data-parallel group with the cost model; it does not combine "
                                "with --backend real, --replicas or disaggregated pools")
        if self.backend == "real" and not self.cluster.is_single:
            raise ServesimError("a cluster replays with the cost model; --backend real runs one engine")
        if self.backend == "real" and self.max_cudagraph_capture_size is not None:
            # (found by a review: it was ignored, with a warning about pricing that does not happen)
            raise ServesimError("--max-cudagraph-capture-size prices the cost model's CUDA graphs; the real backend "
                                "captures its own (up to --max-num-seqs, on a GPU)")
        if self.cluster.router != ClusterOptions.router and self.cluster.is_single:
            raise ServesimError(
                f"--router {self.cluster.router} picks which replica takes each request, and there is one engine: "
                + ("with --dp vLLM's DP load balancer picks the rank (docs/data-parallel.md); leave --router out"
                   if self.dp > 1 else "add --replicas N, or --prefill-replicas and --decode-replicas"))
        check_queue_limits(self)
        if self.vllm_version is not None and not VLLM_VERSION.fullmatch(self.vllm_version):
            raise ServesimError(f"--vllm-version takes a vLLM release such as 0.12.0 or 0.10.1.1, got "
                                f"{self.vllm_version!r}")
        if self.vllm_version is not None and before_vllm(self.vllm_version, V1_DEFAULT_RELEASE):
            raise ServesimError(f"--vllm-version {self.vllm_version}: servesim simulates vLLM's V1 engine, its "
                                "default from 0.8.0 (an older server ran V0's scheduler and KV cache); give 0.8.0 or "
                                "later")
        if self.vllm_version is not None and self.backend != "costmodel":
            raise ServesimError("--vllm-version picks the operator tables the cost model is priced from; it does not "
                                f"apply to --backend {self.backend}")
        if self.profile is not None and self.backend != "costmodel":
            raise ServesimError(f"--profile calibrates the cost model; it does not apply to --backend {self.backend}")

    @property
    def is_default_deployment(self) -> bool:
        """One device in its own dtype: what the real backend runs and a fitted profile measured."""
        return (self.tp, self.dtype, self.kv_cache_dtype) == DEFAULT_DEPLOYMENT and not self.enable_expert_parallel


def check_queue_limits(options: ReplayOptions) -> None:
    """Refuse vLLM's admission limits (sim/admission.py) where servesim cannot count them as vLLM does:
    a disaggregated cluster's requests pass two servers (a prefill and a decode replica's, each with
    its own limits, behind a proxy servesim does not model), and under --dp vLLM (0.15 and later)
    starts one API server per rank, each counting only its own requests' prompt tokens
    (OutputProcessor.get_num_queued_tokens has no shared counter, unlike the requests' count:
    vllm/v1/engine/admission_control.py, SharedAdmissionStats), and which server a request reaches
    is which accepts its connection first, which servesim does not model."""
    sched = options.scheduler
    given = [f"--max-num-queued-{name} {value}" for name, value in
             (("reqs", sched.max_num_queued_reqs), ("tokens", sched.max_num_queued_tokens)) if value is not None]
    if not given:
        return
    if options.cluster.is_disaggregated:
        raise ServesimError(f"{given[0]} is vLLM's API server's limit; a disaggregated cluster's requests pass a "
                            "prefill and a decode server behind a proxy, which servesim does not model with limits: "
                            "use it with one engine, --replicas or --dp")
    if options.dp > 1 and sched.max_num_queued_tokens is not None:
        raise ServesimError(f"--max-num-queued-tokens {sched.max_num_queued_tokens} with --dp {options.dp}: vLLM starts "
                            "one API server per rank, each counting only the prompt tokens of the requests it "
                            "accepted, and which server accepts a request servesim does not model; "
                            "--max-num-queued-reqs is counted over all ranks and applies")


# Generating flags from the fields.

def _parts(cls: type) -> list[tuple[str, type]]:
    """The nested config dataclasses of `cls` (ReplayOptions: scheduler, cache, cluster), by field."""
    return [(f.name, f.default_factory) for f in fields(cls)  # type: ignore[misc]
            if f.default_factory is not MISSING and is_dataclass(f.default_factory)
            and any(option_of(g) and option_of(g).flag for g in fields(f.default_factory))]


def flag_fields(cls: type) -> list[tuple[Any, Option]]:
    """(field, option) of every flag `cls` declares itself (not its nested parts)."""
    return [(f, option_of(f)) for f in fields(cls) if option_of(f) is not None and option_of(f).flag]


def dest_of(f, opt: Option) -> str:
    return opt.dest or opt.flag.lstrip("-").replace("-", "_")


def _default(f) -> Any:
    return f.default if f.default is not MISSING else None


class JoinedValues(argparse.Action):
    """A KEY=VALUE,... flag given more than once: its values joined with ',', so `--slo ttft=1 --slo
    tpot=0.01` is `--slo ttft=1,tpot=0.01`, and a key given in both is refused by the flag's own reading,
    as within one value. (Found by a review: the last one was kept and the others dropped without a word,
    so goodput was counted against another SLO than the one typed.)"""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        if previous not in (None, "", self.default):
            values = f"{previous},{values}" if values else previous  # (an empty one adds nothing)
        setattr(namespace, self.dest, values)


def add_flags(p, cls: type, **help_words: str) -> None:
    """Add the flags `cls`'s fields declare to parser or group `p`; '{default}' in a help is the
    field's default, other '{word}'s are `help_words` (lists of presets)."""
    for f, opt in flag_fields(cls):
        default = _default(f)
        text = opt.help.format(default=default, **help_words)
        names = (opt.flag, *opt.aliases)
        if opt.boolean:
            p.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif opt.negate:
            p.add_argument(*names, action="store_true", help=text)
        else:
            kwargs: dict[str, Any] = {"default": None if opt.parse else default, "help": text}
            if opt.range is not None:
                kwargs["type"] = opt.range.flag_type(opt.flag)
            if opt.metavar is not None:
                kwargs["metavar"] = opt.metavar
            elif opt.choices is not None:
                kwargs["choices"] = opt.choices
            if opt.joined:
                kwargs["action"] = JoinedValues
            p.add_argument(*names, dest=dest_of(f, opt), **kwargs)


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` built by keyword from the flags `add_flags` declared (and its nested parts from theirs);
    `given`: fields set otherwise."""
    kwargs: dict[str, Any] = {}
    for f, opt in flag_fields(cls):
        value = getattr(args, dest_of(f, opt))
        if opt.negate:
            value = not value
        elif opt.parse is not None:
            value = opt.parse(value)
        kwargs[f.name] = value
    for name, part in _parts(cls):
        kwargs[name] = from_args(part, args)
    return cls(**{**kwargs, **given})


def add_replay_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ReplayOptions: the scheduler's, the KV cache's, the run's, the cluster's (in a group)."""
    from backends.hardware import HARDWARE
    from backends.presets import MODELS
    from policies import POLICIES
    from policies.routers import ROUTERS
    from sim.app.cluster_options import POOL_OPTIONS

    add_flags(p, SchedulerConfig, policies=", ".join(POLICIES))
    p.set_defaults(**dict.fromkeys(VLLM_BATCH_FIELDS))  # unset: vLLM's for the GPU (options_from_args)
    p.set_defaults(async_scheduling=None)  # unset: vLLM's for --vllm-version (options_from_args)
    add_flags(p, ReplayOptions, models=", ".join(MODELS), hardware=", ".join(HARDWARE))
    add_flags(p, CacheConfig)
    g = p.add_argument_group("cluster", "replicas behind a router, or prefill and decode pools (docs/clusters.md)")
    add_flags(g, ClusterOptions, routers=", ".join(ROUTERS), pool_options=", ".join(POOL_OPTIONS))


# The scheduler's flags whose default is vLLM's for the GPU (`vllm_batch_defaults`): parsed with
# default None, so that a value the command line did not give is told from one it did. Unset, they
# hold SchedulerConfig's own defaults until the GPU is known (and in a grid's points: sim.app.sweep_cli).
VLLM_BATCH_FIELDS = ("max_num_batched_tokens", "max_num_seqs")
SCHEDULER_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}
ASYNC_SCHEDULING_SINCE = (0, 14)  # the first vLLM to schedule asynchronously by default


def vllm_batch_defaults(memory_bytes: int, name: str) -> dict[str, int]:
    """vLLM's --max-num-batched-tokens and --max-num-seqs for its OpenAI API server (`vllm serve`) on one
    GPU of `memory_bytes` named `name`: 8192 and 1024 on a GPU of 70 GiB or more that is not an A100,
    else 2048 and 256 (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults, the
    UsageContext.OPENAI_API_SERVER column; an A100 is held to the smaller values by vllm-project/vllm#17885)."""
    if memory_bytes >= 70 * 2**30 and "a100" not in name.lower():
        return {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}
    return {"max_num_batched_tokens": 2048, "max_num_seqs": 256}


def before_vllm(version: str | None, release: tuple[int, int]) -> bool:
    """Whether `version` names a vLLM older than `release` (none, or a build's name: the newest)."""
    found = vllm_release(version)
    return found is not None and found < release


def async_scheduling_default(vllm_version: str | None) -> bool:
    """vLLM schedules asynchronously by default from 0.14 (vllm-project/vllm#27614); a run priced as an
    older server (--vllm-version) schedules synchronously unless told otherwise."""
    return not before_vllm(vllm_version, ASYNC_SCHEDULING_SINCE)


def batch_placeholders(unset: tuple[str, ...], budget: int | None, seqs: int | None) -> dict[str, int]:
    """Stand-ins for the batch fields left unset (`unset`) until the GPU is known (sim.app.plan,
    with_batch_defaults): SchedulerConfig's defaults, but never a budget below a --max-num-seqs given nor
    a --max-num-seqs above a budget given, so that SchedulerConfig does not refuse the pair for a value the
    user never gave (--max-num-seqs 4096 alone was refused as "more than --max-num-batched-tokens (2048)",
    when vLLM's budget on an H100 is 8192)."""
    out = {name: SCHEDULER_DEFAULTS[name] for name in unset}
    if "max_num_batched_tokens" in out and "max_num_seqs" not in out and seqs is not None:
        out["max_num_batched_tokens"] = max(out["max_num_batched_tokens"], seqs)
    if "max_num_seqs" in out and "max_num_batched_tokens" not in out and budget is not None:
        out["max_num_seqs"] = min(out["max_num_seqs"], budget)
    return out


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    unset = tuple(name for name in VLLM_BATCH_FIELDS if getattr(args, name, None) is None)
    given = batch_placeholders(unset, getattr(args, "max_num_batched_tokens", None),
                               getattr(args, "max_num_seqs", None))
    if getattr(args, "async_scheduling", True) is None:
        given["async_scheduling"] = async_scheduling_default(getattr(args, "vllm_version", None))
    if given:
        args = argparse.Namespace(**{**vars(args), **given})
    return from_args(ReplayOptions, args, batch_defaults=unset)


def range_of(dest: str) -> Range | None:
    """The declared range of a replay flag, by its argparse name (a sweep's axes: max_num_seqs,
    seed, ...; rate_scale is the trace option's)."""
    from sim.config import RATE_SCALE

    if dest == "rate_scale":
        return RATE_SCALE
    for cls in (SchedulerConfig, CacheConfig, ReplayOptions, ClusterOptions):
        for f, opt in flag_fields(cls):
            if dest_of(f, opt) == dest:
                return opt.range
    return None


# Numbers on the command line.

def add_number(p, flag: str, bounds: Range, **kwargs: Any) -> None:
    """A numeric flag of a command that has no config dataclass, checked against `bounds` (a
    sim.config.Range): the same as `p.add_argument(flag, type=bounds.flag_type(flag), ...)`."""
    p.add_argument(flag, type=bounds.flag_type(flag), **kwargs)


# The output flags every command that writes shares.

def add_output_options(p, what: str = "run", *, required: bool = False, resume: bool = False,
                       default_help: str = "a new folder under runs/", quiet_help: str = "print nothing on success") \
        -> None:
    """--out, --overwrite (and --resume where a command can continue) and --quiet."""
    if required:
        p.add_argument("--out", required=True, metavar="DIR", help=f"folder of the {what}")
    else:
        p.add_argument("--out", default=None, metavar="DIR", help=f"folder of the {what} (default: "
                                                                   f"{default_help})")
    if resume:
        p.add_argument("--resume", action="store_true",
                       help="continue the interrupted run in --out: keep its finished points, run the rest "
                            "(and the failed ones) again")
        p.add_argument("--overwrite", action="store_true", help=f"start the {what} again in --out, replacing what "
                                                                 "it holds")
    else:
        p.add_argument("--overwrite", action="store_true", help=f"write into --out even if it holds a {what}")
    p.add_argument("--quiet", action="store_true", help=quiet_help)
