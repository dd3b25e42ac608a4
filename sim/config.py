"""Frozen configuration, one dataclass per concern, checked when it is built.

Every option a user can set is declared once, here and in sim/app/options.py and
sim/app/cluster_options.py, as a dataclass field made by `option(...)`: its default, its flag, its
help and its `Range`. The command line's flags are generated from those fields
(sim.app.options.add_flags, as vLLM's EngineArgs derives its flags from its configs: vllm/engine/
arg_utils.py, `EngineArgs.add_cli_args` and `get_kwargs`), and the dataclasses check every value
against its range when they are built (`check_options`), from the command line or from Python.

The physical ranges of every number a user gives (options, hardware files, cluster links) are the
`Range` constants below, each with its reason: a value outside is refused with exit code 2, the
message naming the flag or field, the value and the range.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

from sim.errors import ServesimError


def vllm_release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version ("0.12.0" -> (0, 12)); None for none or a build's name."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return None if found is None else (int(found[1]), int(found[2]))


# vLLM's CUDA-graph capture grid: 1, 2, 4, multiples of 8 below 256, then multiples of 16
# (vllm/config/vllm.py, VllmConfig._set_cudagraph_sizes), to the largest a server may be given.
MAX_CUDA_GRAPH_TOKENS = 65536
CUDA_GRAPH_GRID = (1, 2, 4) + tuple(range(8, 256, 8)) + tuple(range(256, MAX_CUDA_GRAPH_TOKENS + 1, 16))
BLACKWELL_GRAPH_RELEASE = (0, 28)  # the first vLLM to capture up to 1024 tokens on Blackwell (vllm-project/vllm#49390)
DECODE_SIZE_RELEASE = (0, 31)  # the first vLLM to capture max_num_seqs itself (its uniform decode size)
BUDGET_SIZE_RELEASE = (0, 21)  # the first vLLM to capture the step's token budget itself where it is under the ceiling


def is_blackwell(hardware_name: str) -> bool:
    """Whether the GPU is a data-centre Blackwell (B200, GB200, B300, GB300: SM 10x), by its name."""
    return any(hardware_name.upper().startswith(p) for p in ("B200", "GB200", "B300", "GB300"))


def cuda_graph_sizes(max_num_seqs: int, hardware_name: str = "", vllm_version: str | None = None,
                     max_num_batched_tokens: int | None = None, max_capture: int | None = None) -> tuple[int, ...]:
    """The step sizes (tokens) vLLM captures CUDA graphs for, ascending, as `_set_cudagraph_sizes`
    (vllm/config/vllm.py) sets them when the server is given none: the grid up to the ceiling
    min(2 x max_num_seqs, 512, the step's token budget), where data-centre Blackwell (B200, GB200, B300,
    GB300) has 1024 for 512 from vLLM 0.28 (vllm-project/vllm#49390); from vLLM 0.21 the budget itself
    where it is under the ceiling; and from vLLM 0.31 max_num_seqs itself, a decode step of every running
    request (each bisected in the wheels: 0.12.0, 0.20.0 to 0.24.0, 0.26.0 to 0.31.0, 0.33.0). A version not named, or a build's
    name, is the newest. A step of more tokens than the largest runs without a graph; a step of fewer is
    padded to the next size up. `max_capture`: the server's --max-cudagraph-capture-size, the ceiling in
    place of 2 x max_num_seqs and 512 (vLLM takes the grid's largest size at or below it)."""
    release = vllm_release(vllm_version)
    blackwell = is_blackwell(hardware_name) and (release is None or release >= BLACKWELL_GRAPH_RELEASE)
    ceiling = min(2 * max_num_seqs, 1024 if blackwell else 512) if max_capture is None else max_capture
    extra = []
    if max_num_batched_tokens is not None:
        ceiling = min(ceiling, max_num_batched_tokens)
        if release is None or release >= BUDGET_SIZE_RELEASE:
            extra.append(max_num_batched_tokens)
    if release is None or release >= DECODE_SIZE_RELEASE:
        extra.append(max_num_seqs)
    return tuple(sorted({x for x in (*CUDA_GRAPH_GRID, *extra) if x <= ceiling}))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ServesimError(message)


def show_number(x: Any) -> str:
    """16,777,216; 0.9; 1e+300 (a huge whole number as a float, not its 300 digits; one of up to 40 digits
    exactly, never rounded to another); other values by repr."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, int):
        return f"{x:,}" if abs(x) < 10**40 else f"{float(x):g}"
    return f"{x:g}"


@dataclass(frozen=True)
class Range:
    """The values a number may take: [low, high] (low excluded with `open_low`), whole numbers only
    with `whole`; `infinite_ok`: math.inf is accepted too (it means "without limit" there). NaN is
    never in a range."""

    low: float
    high: float
    unit: str
    reason: str
    whole: bool = False
    open_low: bool = False
    infinite_ok: bool = False

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.infinite_ok and value == math.inf:
            return True
        if self.whole and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high

    def describe(self) -> str:
        """'a whole number from 1 to 16,777,216 tokens', 'a number above 0 and at most 1'."""
        kind = "a whole number" if self.whole else "a number"
        low, high = show_number(self.low), show_number(self.high)
        text = f"{kind} above {low} and at most {high}" if self.open_low else f"{kind} from {low} to {high}"
        text += f" {self.unit}" if self.unit else ""
        return text + (", or inf" if self.infinite_ok else "")

    def check(self, name: str, value: Any) -> None:
        """Refuse `value` (exit code 2) unless it is in the range; the message names `name` (a
        flag or a field), the value, the range and why."""
        if not self.contains(value):
            raise ServesimError(f"{name} must be {self.describe()}, got {show_number(value)} ({self.reason})")

    def flag_type(self, flag: str) -> Callable[[str], Any]:
        """An argparse type for `flag`: the text as a whole number or a number (else argparse's
        'invalid whole number value' error), checked against the range (else a ServesimError naming
        the flag, the value and the range, which `sim` prints as its one-line error, exit code 2)."""
        def parse(text: str) -> Any:
            value = int(text) if self.whole else float(text)
            self.check(flag, value)
            return value

        parse.__name__ = "whole number" if self.whole else "number"
        parse.bounds = self  # type: ignore[attr-defined]  # the tests find every numeric flag's range by it
        return parse


# The physical ranges. Each bounds what a user may give so that the simulation means something and
# fits in memory; values beyond are typing mistakes or tests of the program, not deployments.
MAX_TOKENS = 2**24  # 16,777,216 tokens
# The block manager keeps a few Python objects per KV block (~60 bytes): 2**25 blocks take ~2 GB of
# host memory. A larger cache (1e11 blocks) would fail with MemoryError long after the command started.
MAX_NUM_BLOCKS = 2**25
MAX_CLUSTER_BLOCKS = 2**27  # every replica's blocks together: ~8 GB of host memory
TOKENS_PER_STEP = Range(1, MAX_TOKENS, "tokens", "no device holds the activations of a step of more tokens",
                        whole=True)
TOKEN_CAP = Range(0, MAX_TOKENS, "tokens", "0 means no cap; a step holds at most 16,777,216 tokens", whole=True)
HOST_REFERENCE_LOOP = Range(1e-3, 1e3, "seconds", "bench/host_time.py's reference loop takes about 0.1-0.3 s on "
                            "server CPUs", open_low=True)
SEQUENCES = Range(1, 2**20, "requests", "each running request holds at least one KV block; 1,048,576 at once is "
                  "more than any GPU's KV cache holds", whole=True)
ACTIVE_SEQUENCES = Range(0, 2**20, "requests", "0 means unset: --max-num-seqs; at most --max-num-seqs, as vLLM requires",
                         whole=True)
MODEL_LEN = Range(2, MAX_TOKENS, "tokens", "a prompt and one output token at least; the longest context of any "
                  "released model is 10M tokens", whole=True)
BLOCK_SIZE = Range(1, 2**16, "tokens", "tokens per KV block, a power of two; vLLM's are 16 to 256", whole=True)
NUM_BLOCKS = Range(1, MAX_NUM_BLOCKS, "blocks", "each KV block takes about 60 bytes of host memory: 33,554,432 "
                   "take 2 GB; a larger --block-size needs fewer", whole=True)
MEMORY_FRACTION = Range(0.0, 1.0, "", "a fraction of the device's memory", open_low=True)
QUEUE_WINDOW = Range(0, 2**20, "requests", "0 means off; the waiting requests looked at in one step, each a prefix-cache "
                     "lookup", whole=True)
USAGE_FRACTION = Range(0.0, 1.0, "", "a fraction of the KV cache's blocks in use")
QUEUED_REQUESTS = Range(0, 10_000_000, "requests", "0 rejects every request, as vLLM's 0 does; a trace holds at most "
                        "10,000,000", whole=True)
QUEUED_TOKENS = Range(0, 2**48, "tokens", "0 rejects every request, as vLLM's 0 does; 10,000,000 prompts of 16,777,216 "
                      "tokens hold fewer", whole=True)
CUDA_GRAPH_TOKENS = Range(1, MAX_CUDA_GRAPH_TOKENS, "tokens", "vLLM captures a CUDA graph for every size up to it: "
                          "65,536 is far past any server's", whole=True)
PREFILL_INTERVAL = Range(1, 2**20, "steps", "1 means every step; a step is at least a few milliseconds", whole=True)
STREAM_INTERVAL = Range(1, MAX_TOKENS, "tokens", "1 means every token as it comes; a request emits at most 16,777,216 tokens",
                        whole=True)
WATERMARK = Range(0.0, 0.99, "", "a fraction of the KV cache's blocks kept free when admitting; vLLM's is below 1")
SEED = Range(0, 2**63 - 1, "", "a random seed is a 64-bit signed integer", whole=True)
FUSION_MB = Range(0.0, 1024.0, "MB", "0 means off; vLLM's FlashInfer all-reduce workspace holds at most a few hundred MB")
TENSOR_PARALLEL = Range(1, 1024, "GPUs", "GPUs of one engine; the largest NVLink domain has 576", whole=True)
REPLICAS = Range(1, 1024, "replicas", "each replica is an engine with its own KV cache in this process's memory",
                 whole=True)
POOL_REPLICAS = Range(0, 1024, "replicas", "0: no disaggregation; each replica is an engine with its own KV cache "
                      "in this process's memory", whole=True)
LINK_BANDWIDTH_GB_S = Range(1e-3, 1e5, "GB/s", "from a 10 Mb/s line (0.00125 GB/s) to 100 x NVLink 5 (1,800 GB/s)")
LINK_LATENCY_S = Range(0.0, 10.0, "s", "setup time of one transfer; a round trip around the Earth takes 0.2 s")
REQUEST_RATE = Range(1e-6, 1e9, "requests/s", "a request every 11.6 days at the slowest; a simulated clock beyond "
                     "1e9 s (31 years) loses its microseconds", open_low=False)
RATE_SCALE = Range(1e-6, 1e6, "", "a factor on the arrival rate; beyond it the trace spans centuries or nanoseconds")
SLO_SECONDS = Range(1e-6, 1e9, "s", "a latency limit: from a microsecond, less than any step takes, to 31 years")
DURATION_S = Range(0.0, 1e9, "s", "a simulated clock beyond 1e9 s (31 years) loses its microseconds")
POSITIVE_DURATION_S = Range(0.0, 1e9, "s", "a simulated clock beyond 1e9 s (31 years) loses its microseconds",
                            open_low=True)
COUNT = Range(1, 10**7, "", "at least one to run; more than 10,000,000 requests or points do not fit in memory", whole=True)
RANGE_RATIO = Range(0.0, 0.999, "", "vllm bench's --random-range-ratio: lengths in [x (1 - R), x (1 + R)], R below 1 "
                    "(vLLM's RandomDataset refuses 1 and more)")
REQUEST_RATE_OR_INF = Range(1e-6, 1e9, "requests/s", "inf: all at once; a request every 11.6 days at the slowest; a "
                            "simulated clock beyond 1e9 s (31 years) loses its microseconds", infinite_ok=True)
REQUEST_TOKENS = Range(1, MAX_TOKENS, "tokens", "the longest context of any released model is 10M tokens", whole=True)
OPTIONAL_TOKENS = Range(0, MAX_TOKENS, "tokens", "the longest context of any released model is 10M tokens", whole=True)
GAMMA_CV = Range(1e-6, 100.0, "", "coefficient of variation of inter-arrival times; at 1e-06 the arrivals are evenly "
                 "spaced to a millionth (a gamma of shape 1 / CV**2), at 100 nearly every arrival is in one burst")
REPEATS = Range(1, 10**4, "runs", "runs of one shape; 10,000 of each shape would take days", whole=True)
WARMUP_RUNS = Range(0, 10**4, "runs", "runs of one shape; 10,000 of each shape would take days", whole=True)
PROMPTS_PER_CLIENT = Range(1, 10**4, "requests", "requests per client of one benchmark; InferenceMAX sends 10",
                           whole=True)
WARMUP_REQUESTS = Range(0, 10**7, "requests", "vllm bench serve's --num-warmups: copies of the test request sent "
                        "before the benchmark; more than 10,000,000 do not fit in memory", whole=True)
BURSTINESS = Range(1e-3, 1e3, "", "vllm bench serve's --burstiness: the gamma shape of the gaps between requests (1: a "
                   "Poisson process; inf: evenly spaced); below 0.001 nearly every request is in one burst",
                   infinite_ok=True)
READY_CHECK_S = Range(0, 10**9, "s", "vllm bench serve's --ready-check-timeout-sec: 0 skips the test request; the "
                      "simulated server answers at once, so any other value sends it", whole=True)
UNIQUE_PROMPTS = Range(0, 2**20, "prompts", "prompts the client cycles through; AIPerf's dataset has 100", whole=True)
POLICY_TIMEOUT_S = Range(0.0, 86400.0, "s", "0 means no bound; a step's schedule call of a day has hung")
JOBS = Range(1, 4096, "processes", "points run at once, a process each", whole=True)
FRACTION = Range(0.0, 1.0, "", "a fraction")
OPEN_FRACTION = Range(0.0, 1.0, "", "a fraction above 0", open_low=True)
# One GPU's datasheet figures (backends/hardware.py's fields), from a CPU core to 100 x today's
# largest GPU (B200: 2.25e15 dense bf16 FLOP/s, 8e12 B/s of HBM, 192e9 bytes, NVLink 5: 900e9 B/s).
FLOPS = Range(1e9, 1e18, "FLOP/s", "from a CPU core (~1e10) to 400 x a B200 (2.25e15 dense bf16)")
MEMORY_BANDWIDTH = Range(1e9, 1e15, "bytes/s", "from one DDR channel (~1e10) to 100 x a B200's HBM (8e12)")
MEMORY_BYTES = Range(2**27, 2**44, "bytes", "from 128 MiB to 16 TiB: 85 x a B200's 192 GB", whole=True)
GPUS_PER_NODE = Range(1, 1024, "GPUs", "GPUs sharing one node's link; the largest NVLink domain has 576", whole=True)
NVLINK_BANDWIDTH = Range(1e8, 1e14, "bytes/s", "from 1 Gb/s Ethernet to 100 x NVLink 5 (900e9 one way)")


@dataclass(frozen=True)
class Option:
    """How a config field is set from the command line (sim.app.options.add_flags).

    `help` may hold '{default}': the field's default. `dest`: the argparse name when it is not the
    field's (e.g. `replicas` for num_replicas); `negate`: a store-true flag that sets the field False
    (--no-prefix-caching); `boolean`: a --flag/--no-flag pair; `parse`: turns the flag's text into the
    field's value (--slo); `choices`: the values allowed."""

    flag: str
    help: str
    range: Range | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    dest: str | None = None
    negate: bool = False
    boolean: bool = False
    parse: Callable[[str], Any] | None = None
    check: Callable[[str, Any], None] | None = None  # a check beyond the range (e.g. a power of two)
    joined: bool = False  # a KEY=VALUE,... flag: given again, its values join (sim.app.options.JoinedValues)


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **kwargs: Any) -> Any:
    """A dataclass field with its command-line `Option` (its keyword arguments)."""
    return field(default=default, default_factory=default_factory, metadata={"option": Option(**kwargs)})


def option_of(f) -> Option | None:
    return f.metadata.get("option")


def check_options(config: Any) -> None:
    """Check every declared option of a config dataclass against its range and choices: None is
    the 'not given' of an optional field (default None) and is not checked."""
    for f in fields(config):
        opt = option_of(f)
        if opt is None:
            continue
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        if opt.range is not None:
            opt.range.check(opt.flag, value)
        if opt.choices is not None:
            _require(value in opt.choices, f"unknown {opt.flag} {value!r}; choose {' or '.join(opt.choices)}")
        if opt.check is not None:
            opt.check(opt.flag, value)


def check_block_size(block_size: Any, flag: str = "--block-size") -> None:
    """KV blocks hold a power of two of tokens (the kernels' tiles and vLLM's sizes are)."""
    _require(isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0,
             f"{flag} must be a power of two, got {block_size}")


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
DEFAULT_BUDGET = 2048  # vLLM's max_num_batched_tokens for online serving on most GPUs (vllm/engine/arg_utils.py)



class ActiveSeqsAboveSeqs(ServesimError):
    """--max-num-active-seqs above --max-num-seqs (`SchedulerConfig.check_max_num_active_seqs`): a sweep
    adds that its --max-num-seqs was the grid's default (sim/app/sweep_cli.py, point_options)."""

@dataclass(frozen=True)
class SchedulerConfig:
    # A name of policies.POLICIES, or a user's FILE.py:Class (checked by load_policy); the flag's help
    # lists the policies (sim.app.options).
    policy: str = option("chunked", flag="--policy", help="scheduling policy: {policies} (default: {default}), or "
                         "your own as path/to/file.py:ClassName or package.module:ClassName (docs/policies.md)")
    # On the command line, unset means vLLM's API server's default for the GPU (sim.app.options,
    # vllm_batch_defaults: 8192 and 1024 on a GPU of 70 GiB or more that is not an A100); these
    # defaults are the rest's (vLLM's for smaller GPUs).
    max_num_batched_tokens: int = option(DEFAULT_BUDGET, flag="--max-num-batched-tokens", range=TOKENS_PER_STEP,
                                         metavar="N", help="token budget of one step (default: vLLM's API server's "
                                         "for the GPU: 8192 on a GPU of 70 GiB or more that is not an A100 "
                                         "(H100, H200, B200), else {default})")
    max_num_seqs: int = option(256, flag="--max-num-seqs", range=SEQUENCES, metavar="N",
                               help="most requests running at once (default: vLLM's API server's for the GPU: 1024 "
                                    "on a GPU of 70 GiB or more that is not an A100, else {default})")
    max_model_len: int | None = option(None, flag="--max-model-len", range=MODEL_LEN, metavar="N",
                                       help="longest prompt + output accepted; longer requests are rejected "
                                            "(default: the model's max_position_embeddings)")
    # vLLM's max_num_active_seqs (SchedulerConfig; Scheduler.max_num_active_reqs in
    # vllm/v1/core/sched/scheduler.py): the admission limit, below max_num_seqs, which still sizes
    # the model runner (the profile run's activations, so the KV cache; CUDA graphs, so --dp padding).
    # 0: unset, max_num_seqs. Checked against max_num_seqs once that is known (ReplayOptions,
    # sim.app.plan.with_batch_defaults). After max_model_len, so that positional arguments keep their places.
    max_num_active_seqs: int = option(
        0, flag="--max-num-active-seqs", range=ACTIVE_SEQUENCES, metavar="N",
        help="most requests admitted into the running batch, at most --max-num-seqs, which still sizes the model "
             "runner (CUDA graphs, activations): vLLM's --max-num-active-seqs (default: unset, --max-num-seqs)")
    # Admit a waiting request only if blocks for its whole current sequence are free, not just its
    # first chunk's (vLLM 0.33's scheduler_reserve_full_isl, default True).
    reserve_full_isl: bool = option(True, flag="--reserve-full-isl", boolean=True,
                                    help="admit a waiting request only if KV blocks for its whole prompt (and any "
                                         "tokens it generated before a preemption) are free, not just its first "
                                         "chunk's: vLLM's scheduler_reserve_full_isl (default: on)")
    # Cap of a prefill's chunk per step, in tokens; 0: no cap (vLLM's long_prefill_token_threshold).
    # vLLM lifts it in a step with only one request waiting or running.
    long_prefill_token_threshold: int = option(
        0, flag="--long-prefill-token-threshold", range=TOKEN_CAP, metavar="N",
        help="chunked: most prompt tokens one request computes in a step, so long prompts share the budget; 0 for "
             "no cap (vLLM's option and default; vLLM lifts it when a single request is waiting or running)")
    prefill_schedule_interval: int = option(
        1, flag="--prefill-schedule-interval", range=PREFILL_INTERVAL, metavar="N",
        help="chunked: while requests decode, carry prefill (admissions and running chunks) only once N steps have "
             "passed since the last step that carried one, so decodes run in longer stretches (with --dp on a "
             "mixture of experts: only on the ranks' shared steps numbered a multiple of N in each wave); a step "
             "that cannot admit every waiting request lifts it until the queue drains (vLLM's option; default: "
             "{default}, every step)")
    long_prefill_token_threshold_adaptive: bool = option(
        False, flag="--long-prefill-token-threshold-adaptive", boolean=True,
        help="chunked: raise --long-prefill-token-threshold to a fair share of the budget, the budget divided by "
             "the requests running and waiting, when that is more (vLLM's option; default: off)")
    # fcfs: by arrival; priority: by the trace's priority (lower first), then arrival (vLLM's policy).
    scheduling_policy: str = option(
        "fcfs", flag="--scheduling-policy", choices=SCHEDULING_POLICIES, metavar="fcfs|priority",
        help="order of the waiting queue: fcfs (arrival) or priority (the trace's priority column, lower first, "
             "then arrival; preemption takes the running request with the largest priority value), as vLLM's "
             "--scheduling-policy (default: {default})")

    # Blocks kept free when admitting a waiting or preempted request while any runs (vLLM's watermark:
    # KVCacheManager.allocate_slots, watermark_blocks = int(watermark * KVCacheConfig.num_blocks)).
    watermark: float = option(
        0.0, flag="--watermark", range=WATERMARK, metavar="F",
        help="admit a waiting (or preempted) request only if, besides its blocks, this fraction of the KV cache "
             "stays free, while any request runs: headroom against preemption, vLLM's --watermark (default: "
             "{default}, off)")
    # vLLM 0.34's cache-aware admission (SchedulerConfig.cache_aware_admission_window and _threshold;
    # Scheduler._reorder_waiting_by_cached_prefix): chunked, fcfs and prefix caching only (sim/app/plan.py).
    cache_aware_admission_window: int = option(
        0, flag="--cache-aware-admission-window", range=QUEUE_WINDOW, metavar="N",
        help="chunked: at each step, among the first N waiting requests (those never run), admit the ones with the "
             "longest cached prefix first, arrival order breaking ties, once the KV cache is at least "
             "--cache-aware-admission-threshold full: vLLM 0.34's option (needs fcfs and prefix caching; "
             "default: {default}, off: strictly in arrival order)")
    cache_aware_admission_threshold: float = option(
        0.5, flag="--cache-aware-admission-threshold", range=USAGE_FRACTION, metavar="F",
        help="fraction of the KV cache's blocks in use below which --cache-aware-admission-window does not reorder "
             "(vLLM 0.34's; default: {default})")

    # vLLM's API server's admission limits (SchedulerConfig.max_num_queued_reqs, max_num_queued_tokens;
    # AsyncLLM.check_admission): a request that would break one is rejected with HTTP 503 (sim/admission.py).
    max_num_queued_reqs: int | None = option(
        None, flag="--max-num-queued-reqs", range=QUEUED_REQUESTS, metavar="N",
        help="vLLM's API server answers a request HTTP 503 (rejected) when N requests are already unfinished "
             "(waiting or running, over every --dp rank): vLLM's --max-num-queued-reqs (default: no limit)")
    max_num_queued_tokens: int | None = option(
        None, flag="--max-num-queued-tokens", range=QUEUED_TOKENS, metavar="N",
        help="vLLM's API server answers a request HTTP 503 (rejected) when the requests without a first token yet "
             "hold N or more prompt tokens (whole prompts: chunks computed and prefix-cache hits not subtracted): "
             "vLLM's --max-num-queued-tokens (default: no limit)")

    # The engine core's clock (docs/async-scheduling.md): vLLM's AsyncScheduler with its batch queue of 2
    # (default since vLLM 0.14), and the CPU's seconds per step (backends/host_time.py).
    async_scheduling: bool = option(
        True, flag="--async-scheduling", boolean=True,
        help="schedule step n+1 while the GPU runs step n, as vLLM's --async-scheduling (its default since "
             "0.14): a request arriving during step n is first scheduled in step n+2, and a step's host (CPU) "
             "seconds overlap its GPU seconds instead of adding to them (default: on; off for a --vllm-version "
             "below 0.14)")
    host_time: bool = option(
        True, flag="--host-time", boolean=True,
        help="add each step's host seconds (vLLM's scheduler, input preparation and output processing, measured: "
             "profiles/host/: the run's --vllm-version's, else the nearest measured version's; without it the newest) "
             "to the step's clock: added to the GPU's when scheduling is synchronous, the longer "
             "of the two when asynchronous (default: on)")
    host_reference_loop_s: float | None = option(
        None, flag="--host-reference-loop-s", range=HOST_REFERENCE_LOOP, metavar="S",
        help="seconds of the reference loop (python3 bench/host_time.py --reference-only) on the serving host's "
             "CPU, to carry the measured host time to it (default: the profile's own CPU, as measured)")
    # vLLM's API server streams a request's tokens in chunks of N (SchedulerConfig.stream_interval; applied by
    # vllm/v1/engine/output_processor.py, RequestState.make_request_output): only what a streaming client sees
    # changes, never the engine's steps (reports/outcomes.py, stream_chunk_times).
    stream_interval: int = option(
        1, flag="--stream-interval", range=STREAM_INTERVAL, metavar="N",
        help="vLLM's API server sends a streaming request's tokens when N have gathered since its last send (the "
             "first token and the last are sent at once): vLLM's --stream-interval. Changes only what the client "
             "sees: its inter-token latency becomes the gaps between these sends (summary.json's client_itl, sim "
             "bench's ITL rows and peak output rate); TTFT, TPOT and E2E do not change (default: {default}, "
             "every token)")

    @property
    def max_num_active_reqs(self) -> int:
        """The admission limit every policy compares its seats with: --max-num-active-seqs, else
        --max-num-seqs (vLLM's `Scheduler.max_num_active_reqs`, vllm/v1/core/sched/scheduler.py,
        `Scheduler.__init__`)."""
        return self.max_num_active_seqs or self.max_num_seqs

    def check_max_num_active_seqs(self, default_of: str | None = None) -> None:
        """Refuse --max-num-active-seqs above --max-num-seqs, as vLLM's SchedulerConfig does
        (vllm/config/scheduler.py, `SchedulerConfig.verify_max_model_len`: "max_num_active_seqs (N)
        cannot be greater than max_num_seqs (M)."). `default_of`: the GPU whose vLLM default
        --max-num-seqs is, when the command line left it unset."""
        active, seqs = self.max_num_active_seqs, self.max_num_seqs
        if active > seqs:
            where = f", vLLM's default on {default_of}" if default_of else ""
            raise ActiveSeqsAboveSeqs(f"--max-num-active-seqs ({active}) cannot be greater than --max-num-seqs "
                                      f"({seqs}{where}), as vLLM refuses it")

    def __post_init__(self) -> None:
        _require(bool(self.policy), "--policy must not be empty")
        check_options(self)
        # As in vLLM: every running request must be able to get its decode token in one step.
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
            f"--max-num-seqs ({self.max_num_seqs}), so that every running decode fits in one step",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, flag="--block-size", range=BLOCK_SIZE, metavar="N",
                             check=lambda flag, value: check_block_size(value, flag),
                             help="tokens per KV block, a power of two (default: {default})")
    # vLLM's num_gpu_blocks_override (--num-gpu-blocks); None: derived as vLLM does
    num_blocks: int | None = option(None, flag="--num-gpu-blocks", aliases=("--num-blocks",), dest="num_blocks",
                                    range=NUM_BLOCKS, metavar="N",
                                    help="KV blocks per GPU, the figure a vLLM log prints (vLLM's "
                                         "--num-gpu-blocks-override; default: derived as vLLM derives it, "
                                         "docs/kv-cache.md)")
    gpu_memory_utilization: float = option(0.9, flag="--gpu-memory-utilization", range=MEMORY_FRACTION, metavar="F",
                                           help="fraction of device memory for weights, activations and KV cache "
                                                "(default: {default})")
    enable_prefix_caching: bool = option(True, flag="--no-prefix-caching", negate=True,
                                         help="turn prefix caching off")
    # vLLM's --disable-hybrid-kv-cache-manager (SchedulerConfig.disable_hybrid_kv_cache_manager; vLLM
    # leaves it off on GPUs unless a KV connector without hybrid support is configured or the model
    # uses chunked local attention, VllmConfig.__post_init__). A model of sliding and full-attention
    # layers is then sized and managed as one of full-attention layers only (backends/kv_capacity.py
    # kv_cache_groups); its sliding layers still compute over their window. Other models: no change.
    disable_hybrid_kv_cache_manager: bool = option(
        False, flag="--disable-hybrid-kv-cache-manager", boolean=True,
        help="a model of sliding-window and full-attention layers (gpt-oss, Gemma 2 and 3) keeps every token's KV "
             "in every layer, as vLLM's --disable-hybrid-kv-cache-manager: one full-attention KV cache group, no "
             "block freed as the window slides (the sliding layers' compute is still the window's); no effect on "
             "other models (default: off, vLLM's on a GPU)")

    def __post_init__(self) -> None:
        check_options(self)


# --slo keys, the same for replay's goodput and capacity's criterion: each limits one latency.
SLO_KEYS = ("tbt", "ttft", "tpot", "e2e", "delay")  # tbt: time between tokens; delay: scheduling delay
SLO_ALIASES = {"itl": "tbt", "scheduling_delay": "delay", "e2el": "e2e"}


def parse_slo(text: str) -> dict[str, float | None]:
    """'tbt=0.1,ttft=2' -> {'tbt': 0.1, 'ttft': 2.0} (seconds); KEY=none lifts a limit. A key given
    twice, an unknown key or a value that is not a positive number is a one-line error."""
    values: dict[str, float | None] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        key = SLO_ALIASES.get(key, key)
        _require(sep == "=" and key in SLO_KEYS,
                 f"--slo: cannot read {part.strip()!r}; expected KEY=SECONDS with KEY one of {', '.join(SLO_KEYS)}")
        _require(key not in values, f"--slo: {key} is given twice")
        if raw.strip().lower() == "none":
            values[key] = None
            continue
        try:
            values[key] = float(raw)
        except ValueError:
            raise ServesimError(f"--slo: {key} value {raw.strip()!r} is not a number") from None
        SLO_SECONDS.check(f"--slo {key}", values[key])
    return values


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in seconds; None means not constrained. A request
    meets them when its TTFT, TPOT, E2E latency, scheduling delay and every gap between its
    tokens (tbt) are within their limits."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    tbt: float | None = None
    delay: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_KEYS:
            value = getattr(self, name)
            if value is not None:
                SLO_SECONDS.check(f"--slo {name}", value)

    @property
    def is_set(self) -> bool:
        return any(getattr(self, name) is not None for name in SLO_KEYS)

    def limits(self) -> dict[str, float]:
        """The limits that are set, in SLO_KEYS order."""
        return {name: getattr(self, name) for name in SLO_KEYS if getattr(self, name) is not None}

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """Parse 'ttft=0.5,tpot=0.05' (seconds); the keys are those of SLO_KEYS."""
        if not text:
            return cls()
        return cls(**parse_slo(text))
