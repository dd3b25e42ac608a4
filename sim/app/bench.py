"""`sim bench`: a closed-loop benchmark, as `vllm bench serve --max-concurrency C` runs one.

N prompts of exactly I tokens (random token ids: no two share a prefix), each asking for exactly O
output tokens (vLLM's bench sends ignore_eos). With an infinite --request-rate every request is
created at once; with a rate R they are created on a Poisson schedule (with --burstiness B, gaps
of a gamma distribution of shape B and mean 1 / R), rescaled so the last is created at N / R after
the benchmark's start, as vllm/benchmarks/serve.py `get_request` does: its gaps drawn one request at
a time from numpy's global generator, seeded with --seed (`main_async`: np.random.seed), so a seed
gives vLLM's own arrival times. A created request waits, in creation order, for one of
C slots and is sent when it has one; a request's slot is freed when it finishes (sim/arrivals.py,
`ClosedLoop`).

What is measured, as vLLM's client measures it (serve.py, `benchmark` and `calculate_metrics`):
TTFT and E2E from the moment a request is sent (not from its creation: the wait for a slot is
the client's queue, reported apart by vLLM), TPOT = (E2E - TTFT) / (O - 1), ITL every gap
between tokens, throughputs over the benchmark's duration from its start to the last finish. The
first wave (C requests sent together at the start, all prefilling at once) is measured and counted,
as vLLM counts it.

Before the benchmark, as vLLM's client (serve.py `benchmark`): with --ready-check-timeout-sec S > 0,
one test request, request 0's prompt and output length (with ignore_eos too: exactly that many
tokens), sent alone (`wait_for_endpoint`, vllm/benchmarks/lib/ready_checker.py; the simulated server
answers its first try); vLLM's client skips it by default since vllm-project/vllm#30975 (its
--ready-check-timeout-sec defaults to 0), and so does servesim's; then --num-warmups copies of it
(default 0),
at most C at a time; the benchmark starts at the instant the last of them finished (`ClosedLoop`'s
warm-up stages; the client sees a finish when the engine emits the last token, and sends at once).
They run on the same engine: what they leave in the KV cache stays, so with prefix caching on
(vLLM's default) request 0, whose prompt carries the same prefix hash ids as theirs, finds its full
blocks cached but the last token's (the block manager's own lookup, as vLLM's). None of them is
counted: the metrics, requests.csv and steps.parquet are the benchmark's (`benchmark_part`: the
steps that started before it are left out), the duration runs from its start, and summary.json's
`warmup` gives how many requests and steps ran before it and `benchmark_start_s`, when it started
on the simulated clock, which counts from the test request's send (t = 0): every time in
requests.csv and steps.parquet is on that clock.

Between the client and the engine stands vLLM's API server (`--api-server`, on unless `off`:
sim/app/replay.py `with_api_server`, the time `sim validate` prices), so TTFT and E2E are the
client's, from the send, as vLLM's table gives them (`client_ttft`, `client_e2e`). Time between a
request's last token and the client's next send (HTTP, detokenisation) is zero here.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.app.plan import RunPlan
from sim.arrivals import ClosedLoop, simulate
from sim.engine import Engine, SimResult, TokenTimes
from sim.errors import ServesimError
from sim.request import Request


@dataclass(frozen=True)
class BenchSpec:
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int
    request_rate: float = math.inf  # requests per second; inf: all created at once
    range_ratio: float = 0.0  # vllm bench's --random-range-ratio: lengths uniform in [x (1 - r), x (1 + r)]
    num_warmups: int = 0  # vllm bench's --num-warmups: copies of the test request sent before the benchmark
    test_request: bool = False  # vLLM's initial test request (vllm bench's --ready-check-timeout-sec S > 0)
    burstiness: float = 1.0  # vllm bench's --burstiness: the gaps' gamma shape (1: a Poisson process; inf: even)

    def __post_init__(self) -> None:
        for name in ("concurrency", "input_len", "output_len", "num_prompts"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ServesimError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value}")
        if not self.request_rate > 0:
            raise ServesimError(f"--request-rate must be positive (inf: all at once), got {self.request_rate}")
        if not 0.0 <= self.range_ratio < 1.0:  # as vLLM's RandomDataset refuses it
            raise ServesimError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio:g}")
        if not (isinstance(self.num_warmups, int) and self.num_warmups >= 0):
            raise ServesimError(f"--num-warmups must be a whole number >= 0, got {self.num_warmups}")
        if not self.burstiness > 0:  # (NaN too)
            raise ServesimError(f"--burstiness must be positive (inf: evenly spaced), got {self.burstiness}")
        if math.floor(self.input_len * (1 - self.range_ratio)) < 1:
            # vLLM's RandomDataset refuses a prompt range reaching 0 tokens (found by a review: it was clamped to 1)
            raise ServesimError(f"--random-range-ratio {self.range_ratio:g} with --input-len {self.input_len}: the "
                                f"shortest prompt would be floor({self.input_len} x (1 - {self.range_ratio:g})) = "
                                f"{math.floor(self.input_len * (1 - self.range_ratio))} tokens, which vllm bench serve "
                                "refuses; a smaller ratio or a longer --input-len")

    def bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((low, high) of the prompt lengths, (low, high) of the output lengths), both inclusive, as
        vllm/benchmarks/datasets.py `RandomDataset.get_sampling_params` bounds them: floor(x (1 - r))
        to ceil(x (1 + r)), an output at least 1 token. (vLLM first takes the tokenizer's special
        tokens off the prompt length; servesim has no tokenizer, and counts the prompt as given.)"""
        r = self.range_ratio
        prompt = (math.floor(self.input_len * (1 - r)), math.ceil(self.input_len * (1 + r)))  # (at least 1: checked)
        output = (max(math.floor(self.output_len * (1 - r)), 1), max(math.ceil(self.output_len * (1 + r)), 1))
        return prompt, output

    def lengths(self, seed: int) -> tuple[list[int], list[int]]:
        """Each request's prompt and output tokens: exactly --input-len and --output-len, or with a range
        ratio uniform integers within `bounds`, drawn as vLLM draws them (numpy's default_rng(seed), all
        prompt lengths, then all output lengths)."""
        n = self.num_prompts
        if self.range_ratio == 0.0:
            return [self.input_len] * n, [self.output_len] * n
        (p_low, p_high), (o_low, o_high) = self.bounds()
        rng = np.random.default_rng(seed)
        prompts = rng.integers(p_low, p_high + 1, size=n)
        outputs = rng.integers(o_low, o_high + 1, size=n)
        return [int(v) for v in prompts], [int(v) for v in outputs]

    def created_s(self, seed: int) -> list[float]:
        """When each request is created (before it waits for a slot): `get_request`'s delays, a gamma
        draw of shape B and scale 1 / (R B) a request from numpy's global generator seeded with the
        seed (np.random.RandomState(seed) draws the same), summed, then scaled so the last is at N / R;
        with B infinite, 1 / R each."""
        n = self.num_prompts
        if math.isinf(self.request_rate):
            return [0.0] * n
        if math.isinf(self.burstiness):
            gaps = np.full(n, 1.0 / self.request_rate)
        else:
            rng = np.random.RandomState(seed)
            theta = 1.0 / (self.request_rate * self.burstiness)
            gaps = np.array([rng.gamma(shape=self.burstiness, scale=theta) for _ in range(n)])
        times = np.cumsum(gaps)
        return (times * (n / self.request_rate / times[-1])).tolist()

    @property
    def num_warmup_requests(self) -> int:
        """Requests sent before the benchmark: the test request (if sent) and --num-warmups copies."""
        return int(self.test_request) + self.num_warmups

    def requests(self, seed: int = 0) -> list[Request]:
        """The benchmark's requests. Where a test request or warm-ups run, request 0's prompt is
        theirs, so its blocks carry the same prefix hash ids (`first_prompt_hash_ids`) and the
        block manager's prefix cache finds what they left, as vLLM's does; every other prompt is
        its own (vLLM's random dataset: request i's tokens are (offset_i + i + k) mod the vocabulary,
        a random offset each, so no two prompts share a block but by a chance of about 1 in the
        vocabulary's size per pair, left out here)."""
        prompts, outputs = self.lengths(seed)
        out = [Request(i, f"bench-{i}", 0.0, prompts[i], outputs[i]) for i in range(self.num_prompts)]
        if self.num_warmup_requests:
            out[0].hash_ids = first_prompt_hash_ids(prompts[0])
        return out

    def warmup_stages(self, seed: int = 0) -> list[list[Request]]:
        """What vLLM's client sends before the benchmark, in order (vllm/benchmarks/serve.py,
        `benchmark`): the test request, request 0's prompt and output length, sent alone
        (`wait_for_endpoint`, vllm/benchmarks/lib/ready_checker.py: the simulated server answers
        the first try), then --num-warmups copies of it, at most --concurrency at a time. Their
        indexes follow the benchmark's (N, N + 1, ...)."""
        prompts, outputs = self.lengths(seed)
        n = self.num_prompts

        def copy(k: int, name: str) -> Request:
            return Request(n + k, name, 0.0, prompts[0], outputs[0], hash_ids=first_prompt_hash_ids(prompts[0]))
        stages = []
        if self.test_request:
            stages.append([copy(0, "test")])
        first = int(self.test_request)
        if self.num_warmups:
            stages.append([copy(first + k, f"warmup-{k}") for k in range(self.num_warmups)])
        return stages

    def as_dict(self) -> dict:
        out = {"concurrency": self.concurrency, "input_len": self.input_len, "output_len": self.output_len,
               "num_prompts": self.num_prompts,
               "request_rate": None if math.isinf(self.request_rate) else self.request_rate}
        if self.range_ratio:  # fixed lengths keep the summary they had
            out["random_range_ratio"] = self.range_ratio
        if self.burstiness != 1.0:  # a Poisson process keeps the summary it had
            out["burstiness"] = self.burstiness
        if self.test_request:  # (vLLM's client sends none by default)
            out["test_request"] = True
        return out


def first_prompt_hash_ids(num_prompt_tokens: int) -> np.ndarray:
    """Prefix hash ids of the first prompt (the test request's, the warm-ups' and request 0's), one
    per 512 tokens (Request.hash_block_tokens' default): the block manager keys their full blocks
    alike, and no other bench request has any."""
    return np.arange(-(-num_prompt_tokens // 512), dtype=np.int64) + (1 << 40)


class BenchResult(SimResult):
    """The benchmark's part of a run that began with a test request or warm-ups: its requests,
    their token times, the steps from its start on and the counters' growth since then; `start_s`
    is when it started (the last warm-up's finish), `warmup` what ran before (summary.json's)."""

    start_s: float = 0.0
    warmup: dict | None = None


def run_bench(spec: BenchSpec, plan: RunPlan, progress=None, fast_forward: bool = True) -> tuple[BenchResult, ClosedLoop]:
    """Run the test request and the warm-ups (`BenchSpec.warmup_stages`), then the benchmark at the
    instant the last of them finished (the client sees a request's last token when the engine
    emits it, and sends its next request then: serve.py `benchmark` takes `benchmark_start_time`
    right after gathering the warm-ups), on one engine whose KV cache and prefix cache carry over.
    The result is the benchmark's alone (`BenchResult`), as vLLM's client counts it."""
    if not plan.options.cluster.is_single or plan.options.dp > 1:
        raise ServesimError("sim bench's closed loop drives one engine; --replicas, --router, --dp and the prefill "
                            "and decode pools are for sim replay, sim sweep and sim capacity")
    check_runnable(spec, plan)
    seed = plan.options.seed
    requests = spec.requests(seed)
    stages = spec.warmup_stages(seed)
    warmups = [r for stage in stages for r in stage]
    # The benchmark's requests first: their token times are the table's head (`benchmark_part`).
    engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), TokenTimes(requests + warmups),
                    plan.max_model_len, fast_forward=fast_forward, progress=progress)
    from sim.app.replay import api_servers

    servers = api_servers() if plan.options.api_server != "off" else None  # (auto: on, the client is vLLM's)
    workload = ClosedLoop(requests, spec.created_s(seed), spec.concurrency, engine, servers, stages)
    result = simulate(engine, workload)
    if spec.test_request and stages[0][0].reject_reason is not None:  # vLLM's client stops: "Initial test run failed"
        raise ServesimError(f"the test request (request 0's prompt and output) was rejected: "
                            f"{stages[0][0].reject_reason}; vllm bench serve stops there")
    return benchmark_part(result, workload, spec), workload


def benchmark_part(result: SimResult, workload: ClosedLoop, spec: BenchSpec) -> BenchResult:
    """`result` less what ran before the benchmark: the warm-ups' steps (every step that started
    before the benchmark did: the engine is idle then, every warm-up having finished and nothing
    else sent) and token times, and the preemptions and prefix-cache counts up to its start."""
    requests = workload.requests
    start = workload.start_s
    steps = result.steps
    num_warmup_steps = int(np.searchsorted(steps.start_s, start, side="left")) if workload.warmup_requests else 0
    steps.drop_first(num_warmup_steps)
    token_times = TokenTimes(requests)
    if result.token_times is not None:
        token_times.times[:] = result.token_times[:len(token_times.times)]
    preemptions, queried, hit = workload.start_counts
    out = BenchResult(requests, token_times, steps, result.end_s, result.num_preemptions - preemptions,
                      result.num_prefix_queried_tokens - queried, result.num_prefix_hit_tokens - hit)
    out.start_s = start
    if workload.warmup_requests:
        out.warmup = {"test_request": spec.test_request, "num_warmups": spec.num_warmups,
                      "requests": len(workload.warmup_requests), "steps": num_warmup_steps,
                      "benchmark_start_s": start}
    return out


def check_runnable(spec: BenchSpec, plan: RunPlan) -> None:
    """Refuse, before anything runs, a benchmark whose requests the engine could reject: the longest
    (prompt and output at the top of their ranges; all of them with fixed lengths) over the model
    length, or needing more KV blocks than the whole cache (the engine's own tests, `Engine.submit`)."""
    (_, prompt), (_, output) = spec.bounds()
    total = prompt + output
    if spec.range_ratio:
        which = (f"the longest request (--input-len {spec.input_len}, --output-len {spec.output_len}, "
                 f"--random-range-ratio {spec.range_ratio:g}: up to {prompt} + {output} tokens)")
        size, what, fix = f"{which} is {total} tokens", "it could be rejected", "shorten the lengths or the range"
    else:
        which = f"each request (--input-len {spec.input_len}, --output-len {spec.output_len})"
        size = f"--input-len {spec.input_len} + --output-len {spec.output_len} = {total} tokens"
        what, fix = "every request would be rejected", "shorten them"
    if total > plan.max_model_len:
        raise ServesimError(f"{size}, more than --max-model-len {plan.max_model_len}: {what}; {fix} or raise "
                            "--max-model-len")
    bm = plan.make_block_manager()
    needed = bm.blocks_for(Request(0, "bench-0", 0.0, prompt, output).max_kv_tokens)
    if needed > bm.num_blocks:
        raise ServesimError(f"{which} needs {needed} KV blocks, and the whole cache has {bm.num_blocks}: {what}; "
                            f"{fix}, or give more blocks (--num-gpu-blocks, --gpu-memory-utilization)")


def write_bench(out: Path, result: SimResult, plan: RunPlan, spec: BenchSpec) -> dict:
    """The run folder of `sim replay` (its trace: the requests as sent), with the bench's settings and
    vLLM's per-second peaks (output tokens, concurrent requests) in summary.json. The benchmark's
    alone: requests.csv and steps.parquet leave out the test request, the warm-ups and their steps,
    the duration runs from the benchmark's start, and summary.json's `warmup` says what ran before
    it (how many requests and steps, and `benchmark_start_s`, the simulated time it started at)."""
    from reports.bench_table import per_second_peaks
    from reports.outcomes import stream_chunk_times
    from sim.app.replay import write_run
    from traces.trace import Trace

    rows = result.requests
    done = [i for i, r in enumerate(rows) if r.finish_s is not None]
    sent = [rows[i] for i in done]

    def send(r: Request) -> float:  # the client's (before the API server, where one is modelled)
        return r.arrival_s if r.client_sent_s is None else r.client_sent_s
    trace = Trace(np.array([r.arrival_s for r in rows]), np.array([r.num_prompt_tokens for r in rows]),
                  np.array([r.max_tokens for r in rows]), source=f"sim bench {describe(spec)}", format="sim-bench")
    # vLLM counts one token per chunk received (calculate_metrics: TTFT plus each ITL), so with --stream-interval
    # its "output tokens" per second are chunks per second
    interval = plan.options.scheduler.stream_interval
    token_times = np.concatenate([stream_chunk_times(result.tokens_of(i), interval) for i in done]) if done else np.zeros(0)
    peak_tokens, peak_requests = per_second_peaks([send(r) for r in sent], [r.finish_s for r in sent], token_times)
    extra = {"bench": spec.as_dict(), "peak_output_tokens_per_s": peak_tokens, "peak_concurrent_requests": peak_requests}
    start_s = 0.0
    if isinstance(result, BenchResult):
        start_s = result.start_s
        if result.warmup is not None:
            extra["warmup"] = result.warmup
    return write_run(out, result, plan, trace, extra=extra, start_s=start_s)


def describe(spec: BenchSpec) -> str:
    rate = "inf" if math.isinf(spec.request_rate) else f"{spec.request_rate:g}"
    ratio = f" --random-range-ratio {spec.range_ratio:g}" if spec.range_ratio else ""
    warmups = f" --num-warmups {spec.num_warmups}" if spec.num_warmups else ""
    test = " --ready-check-timeout-sec 600" if spec.test_request else ""
    burst = f" --burstiness {spec.burstiness:g}" if spec.burstiness != 1.0 else ""
    return (f"--concurrency {spec.concurrency} --input-len {spec.input_len} --output-len {spec.output_len} "
            f"--num-prompts {spec.num_prompts} --request-rate {rate}{burst}{ratio}{warmups}{test}")


TRACE_OPTIONS = ("format", "model_filter", "time_window", "limit", "rate_scale", "target_rate")


def cmd_bench(args: argparse.Namespace) -> int:
    from reports.bench_table import format_bench_table
    from sim.app.cli import describe as describe_plan
    from sim.app.cli import options_from_args, run_stamp, warn
    from sim.app.outputs import command_inputs, open_run_folder
    from sim.app.plan import resolve
    from sim.app.progress import Progress

    for name in TRACE_OPTIONS:
        if getattr(args, name, None) is not None:
            raise ServesimError(f"--{name.replace('_', '-')} shapes a trace; sim bench makes its own requests")
    if getattr(args, "on_too_long", "reject") != "reject":  # its default, "reject", is the engine's own
        raise ServesimError(f"--on-too-long {args.on_too_long} shapes a trace; sim bench makes its own requests "
                            "(of --input-len and --output-len)")
    spec = BenchSpec(args.concurrency, args.input_len, args.output_len, args.num_prompts, args.request_rate,
                     args.random_range_ratio, args.num_warmups, args.ready_check_timeout_sec > 0, args.burstiness)
    options = options_from_args(args)
    # The run folder is claimed (made, locked, refused if it holds a run) before any work.
    with open_run_folder(args.out, f"{run_stamp()}-bench", overwrite=args.overwrite,
                         discard_on_failure=True, inputs=command_inputs(args)) as folder:
        warn(folder.took_over)
        plan = resolve(options)
        for message in plan.warnings():  # a capped KV cache
            warn(message)
        out = folder.folder
        # (the engine counts every request it finishes: the test request and the warm-ups too)
        progress = Progress.for_replay(spec.num_prompts + spec.num_warmup_requests, quiet=args.quiet)
        started = time.perf_counter()
        result, _ = run_bench(spec, plan, progress=progress, fast_forward=not args.no_fast_forward)
        progress.close()
        wall = time.perf_counter() - started
        summary = write_bench(out, result, plan, spec)
    if not args.quiet:
        print(f"sim bench {describe(spec)}: {describe_plan(plan)}")
        print(format_bench_table(summary, spec.concurrency,
                                 None if math.isinf(spec.request_rate) else spec.request_rate))
        print(f"simulated {summary['simulated_s']:.1f} s in {wall:.2f} s of wall time; wrote {folder.final}/",
              file=sys.stderr)
    return 0


def register(sub) -> None:
    from sim.app.cli import add_replay_options
    from sim.app.options import add_output_options
    from sim.config import (
        BURSTINESS,
        COUNT,
        RANGE_RATIO,
        READY_CHECK_S,
        REQUEST_RATE_OR_INF,
        REQUEST_TOKENS,
        SEQUENCES,
        WARMUP_REQUESTS,
    )

    p = sub.add_parser(
        "bench", help="a closed-loop benchmark, as vllm bench serve --max-concurrency runs it",
        description="C clients send N fixed-length prompts of random tokens, each its next when its previous "
                    "one finishes (with --request-rate, sends are also paced by a Poisson process), and the "
                    "run is reported as vllm bench serve reports it. Writes a run folder like sim replay.")
    p.add_argument("--concurrency", type=SEQUENCES.flag_type("--concurrency"), required=True, metavar="C",
                   help="most requests in flight (vllm bench's --max-concurrency)")
    p.add_argument("--input-len", type=REQUEST_TOKENS.flag_type("--input-len"), required=True, metavar="I",
                   help="prompt tokens per request")
    p.add_argument("--output-len", type=REQUEST_TOKENS.flag_type("--output-len"), required=True, metavar="O",
                   help="output tokens per request")
    p.add_argument("--num-prompts", type=COUNT.flag_type("--num-prompts"), required=True, metavar="N", help="requests sent in all")
    p.add_argument("--request-rate", type=REQUEST_RATE_OR_INF.flag_type("--request-rate"), default=math.inf, metavar="R",
                   help="requests created per second, on a Poisson schedule (default: inf, all at once)")
    p.add_argument("--random-range-ratio", type=RANGE_RATIO.flag_type("--random-range-ratio"), default=0.0,
                   metavar="R", help="prompt and output lengths uniform integers in [x (1 - R), x (1 + R)], drawn "
                                     "from --seed, as vllm bench serve's --random-range-ratio (default: 0, exactly "
                                     "--input-len and --output-len)")
    p.add_argument("--num-warmups", type=WARMUP_REQUESTS.flag_type("--num-warmups"), default=0, metavar="N",
                   help="copies of the test request sent before the benchmark, at most --concurrency at a time, "
                        "and not counted, as vllm bench serve's --num-warmups (default: 0)")
    p.add_argument("--ready-check-timeout-sec", type=READY_CHECK_S.flag_type("--ready-check-timeout-sec"), default=0,
                   metavar="S", help="as vllm bench serve's: above 0 sends the test request (request 0's prompt and "
                                     "output, sent alone before the benchmark and not counted, which leaves that prompt "
                                     "in the prefix cache; the simulated server is up at once, so it is sent once); 0 "
                                     "skips it (default: 0, as vLLM's since vllm-project/vllm#30975)")
    p.add_argument("--burstiness", type=BURSTINESS.flag_type("--burstiness"), default=1.0, metavar="B",
                   help="as vllm bench serve's, with --request-rate: the gaps between requests' creations are gamma "
                        "distributed of shape B (1: a Poisson process; below 1 burstier, above 1 more even; inf: "
                        "evenly spaced) (default: 1)")
    add_replay_options(p)
    add_output_options(p)
    p.add_argument("--no-fast-forward", action="store_true",
                   help="simulate every decode step one by one (same results, slower; for checking)")
    p.set_defaults(func=cmd_bench)
