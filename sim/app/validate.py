"""`sim validate MEASURED.csv --ops DIR [--models DIR] --out DIR`: measured deployments against servesim.

MEASURED.csv has the columns of AIConfigurator's silicon file (../shared/gpu-data/aiconfigurator/
silicon_llama3.1.csv): one row per benchmark of a real deployment. For every row servesim can
express (aggregated serving, pp_size 1, bf16, fp8 or fp4 weights (fp4: nvfp4, where the system's
tables measure its GEMMs), a system with operator tables in DIR,
a model it can read) it builds the operator-table profile of (system, model, TP, precision, vLLM
version) once, simulates the row's closed-loop benchmark and compares mean TTFT and TPOT. A row it
cannot express is skipped with its reason, never guessed.

Tables per row: a vLLM row is priced with its own vLLM version's tables, each table kind at that
version or the nearest the system has (validate.csv's `tables` says which, per row); other
frameworks' rows, and rows with no version, with the newest. The engine core's host time per step
follows the same rule over the measured host profiles (profiles/host/: 0.33 and 0.34; a row of vLLM
before 0.33 gets 0.33's, the nearest), said at the end of the row's `tables`. DIR is a folder of flat table files or
of the package's layout; without --ops, the tables extra's package (every system it covers: a row's
hardware is the named preset for H100 SXM and H200, else the package's system description).
Models: --models DIR, else a preset by name, else the package's model_configs/ (ORG--NAME_config.json).

The benchmark, as the rows were measured (InferenceMAX's client, github.com/InferenceMAX,
`benchmark_serving.py --dataset-name random --random-range-ratio 0.8 --num-prompts 10 x C
--max-concurrency C --request-rate inf --ignore-eos`, and its vLLM server flags
`--max-num-seqs C --max-num-batched-tokens 8192 --no-enable-prefix-caching`; the budget is the
row's launch recipe's where it sets another, `Protocol.budget_for`): 10 x C requests,
all created at once, C in flight; prompt and output lengths uniform integers in
[int(0.8 x ISL), ISL] and [int(0.8 x OSL), OSL] (its `sample_random_requests`); the row's
`batch_size` is C unless its `silicon_data_source` says `silicon_concurrency=` (trusted, as the
file's SOURCES.md says). TTFT is client-side, as the benchmark measured it: a request passes the
API server (one at a time, the profile's `client_overhead`) before the engine sees it, and its TTFT
counts from its send. TPOT is (E2E - TTFT) / (output - 1), the mean over requests. Before the
benchmark the client sends one test request (the first prompt and its output length, alone, not
counted; benchmark_serving.py `benchmark`, as vllm/benchmarks/serve.py's) and starts the benchmark
when it finishes (`Protocol.warmup_stages`); with prefix caching off it leaves nothing the
benchmark finds, so it moves the clock and nothing else (a DP group's clients, `dp` > 1, send none).

What a row does not state but its source's launch scripts do (`LAUNCH_RECIPES`): the KV cache
dtype. InferenceMAX's H200 scripts set `kv-cache-dtype: fp8` (vLLM, benchmarks/70b_fp8_h200_slurm.sh)
and `kv_cache_config: dtype: fp8` (TensorRT-LLM, benchmarks/70b_fp8_h200_trt_slurm.sh); its H100
vLLM script (benchmarks/70b_fp8_h100_docker.sh) sets none, so vLLM's `auto` (bf16). The KV dtype
decides how many requests fit, so it decides which rows queue. A recipe is one model's script
(the Llama-3.1-70B scripts say nothing of other models); InferenceX's MoE scripts also give the
token budget (MiniMax-M2.5 on B300: --max-num-batched-tokens "$((ISL * 2))"). A row of any other
source or model gets vLLM's defaults, and validate.csv says which each row got and why.

Two physical checks, per row (validate.csv), against the most tokens per second the operator
tables' GEMMs alone allow at the server's token budget (`OperatorModel.max_gemm_tokens_per_s`;
every step pays at least that for its tokens):

- the token rate the measurement implies, C x (mean prompt + mean output - 1) / (TTFT + (mean
  output - 1) x TPOT) for C clients in a closed loop. A row above it ran faster than the kernels it
  was measured with (prefix-cache hits, shorter prompts than stated, or another protocol); it is
  simulated and counted all the same, and flagged (`faster_than_tables`);
- the first wave: vLLM's benchmark sends C prompts together at the start and counts them. The
  i-th of them waits for i prompts' GEMMs, so counting them bounds the mean TTFT from below
  (`first_wave_ttft_bound_ms`). A row measured under that bound did not count its first wave,
  and `--warmup-waves auto` (the default) leaves it out of that row's means too (`warmup_waves`,
  `warmup_from`).

Scheduling: asynchronous where the server did (`Protocol.async_for`: vLLM 0.14 on, InferenceMAX's
`--async-scheduling`), synchronous for vLLM before 0.14.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from backends.costmodel.optables.backend import OpTableBackend
from backends.costmodel.optables.profile import ClientOverhead, build_profile
from backends.costmodel.optables.tables import load_tables, systems_in
from backends.model_config import package_model_config, served_kv_cache_dtype
from backends.sampler import GREEDY, Sampling, config_dir_of, generation_config_sampling
from sim.app.opprofiles import kv_name
from sim.app.options import ASYNC_SCHEDULING_SINCE, ReplayOptions, before_vllm
from sim.app.outputs import atomic_write_text
from sim.app.plan import SPARSE_BLOCK_SIZE, prices_sampler, resolve
from sim.arrivals import ApiServers, ClosedLoop, simulate
from sim.config import COUNT, MODEL_LEN, REQUEST_TOKENS, SEQUENCES, TENSOR_PARALLEL, CacheConfig, Range, SchedulerConfig
from sim.engine import Engine, TokenTimes
from sim.errors import ServesimError
from sim.request import Request

REQUIRED = ("id", "backend", "backend_version", "model_path", "system", "precision", "mode", "isl", "osl",
            "batch_size", "tp_size", "pp_size", "silicon_ttft_ms", "silicon_tpot_ms")
SYSTEM_HARDWARE = {"h100_sxm": "H100-SXM", "h200_sxm": "H200"}  # operator-table systems -> hardware presets
GROUP = ("system", "model", "backend", "backend_version", "precision")
# validate.csv's columns taken as they are from predict_row, after the measured and predicted means.
PREDICTED_COLUMNS = ("predicted_engine_ttft_ms", "max_num_batched_tokens", "num_gpu_blocks", "num_preemptions",
                     "async_scheduling", "warmup_waves", "warmup_from", "implied_tokens_per_s", "tables_max_tokens_per_s",
                     "faster_than_tables", "tables", "notes", "sampling", "sampling_from")


# InferenceMAX's published results (the dashboard's export: `source_file=<date>.csv; model=...`),
# its ISL/OSL grid (1k/1k, 1k/8k, 8k/1k) and concurrency 4-64.
INFERENCEMAX = r"^source_file=\d{4}-\d{2}-\d{2}\.csv;"
INFERENCEMAX_SCRIPTS = "github.com/InferenceMAX/InferenceMAX, benchmarks/"
# InferenceX (InferenceMAX renamed): the dashboard's exports as above, and its database's dumps
# (`db-dump/<date>; config_id=...; workflow_run_id=...`) of the same runs.
INFERENCEX = r"^(source_file=\d{4}-\d{2}-\d{2}\.csv;|db-dump/)"
# AIConfigurator's gap analysis (its team's deployments: `source_file=.../aic-auto-gap-analysis/data/...`)
AIC_GAP_ANALYSIS = r"aic-auto-gap-analysis/"
INFERENCEX_SCRIPTS = "github.com/SemiAnalysisAI/InferenceX, benchmarks/single_node/"
DEFAULT_BUDGET = 8192  # vLLM's --max-num-batched-tokens for its API server on GPUs of 70 GiB and more


@dataclass(frozen=True)
class LaunchRecipe:
    """What one source's server launch scripts set that its rows do not state."""

    source: str  # a regular expression on the row's silicon_data_source
    backend: str
    system: str
    model: str  # a regular expression on the row's model_path: a script serves one model
    kv_cache_dtype: str  # "auto" (the model's bf16) or "fp8"
    cites: str
    # vLLM's FlashInfer all-reduce fusion where the script turns it on: (TP, the largest fused
    # all-reduce in MB) pairs, its VLLM_FLASHINFER_ALLREDUCE_FUSION_THRESHOLDS_MB (derive_allreduce)
    allreduce_fusion_mb: tuple[tuple[int, float], ...] = ()
    precision: str = ""  # a regular expression on the row's precision (one script per checkpoint)
    version: str = ""  # a regular expression on the row's backend_version (a script's version of that time)
    budget_per_isl: int = 0  # --max-num-batched-tokens "$((ISL * k))": k; 0: the script sets none or 8192
    moe_kernel: str = "auto"  # the fused-MoE kernel the script tells vLLM to run (sim replay's --moe-kernel)
    max_cudagraph_capture_size: int | None = None  # the script's max-cudagraph-capture-size (None: vLLM's default)


LLAMA_70B = r"Llama-3\.1-70B"
LAUNCH_RECIPES = (
    LaunchRecipe(INFERENCEMAX, "vllm", "h200_sxm", LLAMA_70B, "fp8",
                 INFERENCEMAX_SCRIPTS + "70b_fp8_h200_slurm.sh: config.yaml sets kv-cache-dtype: fp8"),
    LaunchRecipe(INFERENCEMAX, "trtllm", "h200_sxm", LLAMA_70B, "fp8",
                 INFERENCEMAX_SCRIPTS + "70b_fp8_h200_trt_slurm.sh: kv_cache_config sets dtype: fp8"),
    LaunchRecipe(INFERENCEMAX, "vllm", "h100_sxm", LLAMA_70B, "auto",
                 INFERENCEMAX_SCRIPTS + "70b_fp8_h100_docker.sh: no --kv-cache-dtype (vLLM's auto)"),
    LaunchRecipe(INFERENCEMAX, "vllm", "b200_sxm", LLAMA_70B, "fp8",
                 INFERENCEMAX_SCRIPTS + "70b_fp8_b200_docker.sh and 70b_fp4_b200_docker.sh: config.yaml sets "
                 "kv-cache-dtype: fp8 (70b_b200_docker.sh before them: --kv-cache-dtype fp8), and "
                 "enable_fi_allreduce_fusion with VLLM_FLASHINFER_ALLREDUCE_FUSION_THRESHOLDS_MB "
                 "{\"2\":32,\"4\":32,\"8\":8}",
                 allreduce_fusion_mb=((2, 32.0), (4, 32.0), (8, 8.0))),
    LaunchRecipe(INFERENCEMAX, "trtllm", "b200_sxm", LLAMA_70B, "fp8",
                 INFERENCEMAX_SCRIPTS + "70b_fp8_b200_trt_slurm.sh and 70b_fp4_b200_trt_slurm.sh: kv_cache_config "
                 "sets dtype: fp8"),
    # InferenceX's mixture-of-experts scripts, where every stored version of the script agrees (read
    # 2026-12-06). Where versions disagree (MiniMax-M2.5 on H200, Kimi-K2.5 fp4: later ones add
    # --kv-cache-dtype fp8 and --max-num-batched-tokens "$((ISL * 2))"), no recipe: vLLM's defaults.
    LaunchRecipe(INFERENCEX, "vllm", "b300_sxm", r"MiniMax-M2", "fp8",
                 INFERENCEX_SCRIPTS + "minimaxm2.5_fp8_b300.sh and minimaxm2.5_fp4_b300.sh: --kv-cache-dtype fp8 "
                 "--max-num-batched-tokens \"$((ISL * 2 ))\"", budget_per_isl=2),
    # MiniMax-M2.5 on B200: the early script versions set neither; the B300 script "reuses the existing
    # MiniMax-M2.5 FP8 B200 vLLM recipe as-is", with both, and its rows ran vllm/vllm-openai:v0.19.0, as
    # the B200 rows of 0.19.0 and the nightly of the same days did. The 0.17.0 rows: vLLM's defaults.
    LaunchRecipe(INFERENCEX, "vllm", "b200_sxm", r"MiniMax-M2", "fp8",
                 INFERENCEX_SCRIPTS + "minimaxm2.5_fp8_b200.sh and minimaxm2.5_fp4_b200.sh as "
                 "minimaxm2.5_fp8_b300.sh copied them (vLLM 0.19.0 and its nightlies): --kv-cache-dtype fp8 "
                 "--max-num-batched-tokens \"$((ISL * 2 ))\"", budget_per_isl=2, version=r"^(0\.19\.|nightly-)"),
    LaunchRecipe(INFERENCEX, "vllm", "h100_sxm", r"MiniMax-M2", "auto",
                 INFERENCEX_SCRIPTS + "minimaxm2.5_fp8_h100.sh: no --kv-cache-dtype (vLLM's auto), no "
                 "--max-num-batched-tokens"),
    LaunchRecipe(INFERENCEX, "vllm", "b200_sxm", r"gpt-oss", "fp8",
                 INFERENCEX_SCRIPTS + "gptoss_fp4_b200.sh: config.yaml sets kv-cache-dtype: fp8, "
                 "max-num-batched-tokens: 8192, max-cudagraph-capture-size: 2048; VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1 "
                 "(the experts run FlashInfer's MXFP4 x MXFP8 kernel)", moe_kernel="flashinfer-mxfp8",
                 max_cudagraph_capture_size=2048),
    *(LaunchRecipe(INFERENCEX, "vllm", f"{gpu}_sxm", r"gpt-oss", "auto",
                   INFERENCEX_SCRIPTS + f"gptoss_fp4_{gpu}.sh: config.yaml sets no kv-cache-dtype (vLLM's auto), "
                   "max-num-batched-tokens: 8192, max-cudagraph-capture-size: 2048; VLLM_MXFP4_USE_MARLIN=1 (the "
                   "experts run Marlin)", moe_kernel="marlin", max_cudagraph_capture_size=2048)
      for gpu in ("h100", "h200")),
    *(LaunchRecipe(INFERENCEX, "vllm", f"{gpu}_sxm", r"Kimi-K2", "auto",
                   INFERENCEX_SCRIPTS + f"kimik2.5_int4_{gpu}.sh: no --kv-cache-dtype (vLLM's auto), no "
                   "--max-num-batched-tokens", precision=r"^int4$") for gpu in ("b200", "h200")),
)
KV_DEFAULT = "not stated by the row or its source: vLLM's default, auto"

# What a source's launch script runs that the tables do not measure at the row's shapes, said in the
# row's notes (validate.csv), never priced by guess: (source, backend, system, model regex, precision
# regex, caveat).
KERNEL_CAVEATS = (
    *((INFERENCEX, "vllm", f"{gpu}_sxm", r"gpt-oss", r"",
       f"caveat: the launch script (SemiAnalysisAI/InferenceX, benchmarks/gptoss_fp4_{gpu}.sh) sets "
       "VLLM_MXFP4_USE_MARLIN=1, so vLLM ran the experts with Marlin, which the tables measure at another "
       "model's shape only: priced with its efficiency there, carried to gpt-oss's shape (docs/moe.md)")
      for gpu in ("h100", "h200")),
    (INFERENCEX, "vllm", "b200_sxm", r"gpt-oss", r"",
     "caveat: the launch script (SemiAnalysisAI/InferenceX, benchmarks/single_node/gptoss_fp4_b200.sh, every "
     "version) sets VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1, so vLLM ran FlashInfer's MXFP4 x MXFP8 experts, which "
     "the tables measure at other models' shapes only: priced with its work there, carried to gpt-oss's shape "
     "(docs/moe.md)"),
    (INFERENCEMAX, "vllm", "b200_sxm", LLAMA_70B, r"^fp4$",
     "caveat: the tables measure nvfp4 GEMMs with one kernel only, vLLM 0.24's "
     "FlashInferCuteDslNvFp4LinearKernel, newer than this row's server; the kernel it ran is not measured, "
     "and these rows' decode steps price about 12% short even at TP 1, where there is no all-reduce "
     "(docs/calibration-and-validation.md)"),
)


# The gap analysis's client and front end, which servesim does not model: AIConfigurator's eval tool
# waits for Dynamo's /health answer (src/aiconfigurator/eval/service.py) and starts the server by the
# script its generator writes, `python3 -m dynamo.frontend` and a Dynamo worker per engine
# (generator/config/backend_templates/<backend>/run.sh.j2), then runs genai-perf
# (eval/benchmarks/genai_perf_runner.py).
FRONT_END_CAVEAT = (
    "caveat: measured by AIConfigurator's eval tool, genai-perf through NVIDIA Dynamo's frontend and worker "
    "(ai-dynamo/aiconfigurator, src/aiconfigurator/eval/), not vLLM's API server, which servesim puts in front: "
    "the front end's time on a request's way in is not modelled; in the shared files this source's vLLM 0.12, "
    "TensorRT-LLM and SGLang groups of Qwen3 and Llama-3.1-8B are simulated 36-61% short of their measured TTFT "
    "(median; docs/calibration-and-validation.md, By source); and its client sends every prompt and output at the "
    "same length (genai-perf, stddev 0) after 2 x C warm-up requests, whose closed-loop waves servesim cannot time: "
    "it runs InferenceMAX's client (lengths in [0.8 x ISL, ISL], every request counted)")


def kernel_caveats(row) -> list[str]:
    """The `KERNEL_CAVEATS` that apply to a measured row, whether its server was a nightly build, and
    whether it was measured through a front end servesim does not model (`FRONT_END_CAVEAT`)."""
    source = str(row.get("silicon_data_source", ""))
    caveats = [caveat for pattern, backend, system, model, precision, caveat in KERNEL_CAVEATS
               if re.search(pattern, source) and row.get("backend") == backend and row.get("system") == system
               and re.search(model, str(row.get("model_path", ""))) and re.search(precision, str(row.get("precision", "")))]
    if re.search(AIC_GAP_ANALYSIS, source):
        caveats.append(FRONT_END_CAVEAT)
    version = str(row.get("backend_version", "")).strip()
    if version and not is_release(version) and row.get("backend") == "vllm":
        caveats.append(f"backend_version {version}: a build, not a release: priced with the newest tables")
    return caveats


@dataclass(frozen=True)
class Protocol:
    """How the measured benchmarks were run (see the module docstring)."""

    range_ratio: float = 0.8
    prompts_per_client: int = 10
    max_num_batched_tokens: int | None = None  # every row's; None: its launch recipe's, else DEFAULT_BUDGET
    seed: int = 0
    kv_cache_dtype: str = "recipe"  # per row from LAUNCH_RECIPES, else auto; or auto / fp8 for every row
    async_scheduling: bool | None = None  # per row (`async_for`), or True / False for every row
    warmup_waves: int | str = "auto"  # the first K x C requests sent are not counted; auto: per row (`warmup_for`)
    unique_prompts: int = 0  # 0: every prompt its own (vLLM's random dataset); N: N prompts sent in turn
    moe_cost_model: str = "tables"  # MoE, MLA, sliding-window rows: "tables" (MoETableCostModel) or "roofline"
    moe_distribution: str = "auto"  # the moe_perf rows' token distribution (--moe-distribution, as sim replay's)
    moe_kernel: str = "recipe"  # per row from LAUNCH_RECIPES, else vLLM's own (auto); or one kernel for every row
    test_request: bool = True  # vLLM's client's test request before the benchmark (`warmup_stages`)
    sampling: str = "auto"  # per row (`sampling_for`); or greedy / model for every row

    def __post_init__(self) -> None:
        if self.moe_cost_model not in ("tables", "roofline"):
            raise ServesimError(f"unknown --moe-cost-model {self.moe_cost_model!r}; choose tables or roofline")
        from backends.costmodel.optables.moe import MOE_KERNELS, check_moe_distribution

        check_moe_distribution("--moe-distribution", self.moe_distribution)
        if self.moe_kernel not in ("recipe", *MOE_KERNELS):
            raise ServesimError(f"unknown --moe-kernel {self.moe_kernel!r}; choose recipe, {', '.join(MOE_KERNELS)}")
        if self.sampling not in ("auto", "greedy", "model"):
            raise ServesimError(f"unknown --sampling {self.sampling!r}; choose auto, greedy or model")
        if self.kv_cache_dtype not in ("recipe", "auto", "fp8"):
            raise ServesimError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose recipe, auto or fp8")
        if not 0.0 < self.range_ratio <= 1.0:
            raise ServesimError(f"--range-ratio must be in (0, 1], got {self.range_ratio}")
        if self.prompts_per_client < 1:
            raise ServesimError(f"--prompts-per-client must be at least 1, got {self.prompts_per_client}")
        if self.unique_prompts < 0:
            raise ServesimError(f"--unique-prompts must be 0 (every prompt its own) or more, got {self.unique_prompts}")
        if self.warmup_waves != "auto" and not (isinstance(self.warmup_waves, int)
                                                and 0 <= self.warmup_waves < self.prompts_per_client):
            raise ServesimError(f"--warmup-waves must be auto or in [0, --prompts-per-client), got {self.warmup_waves}")

    def async_for(self, row) -> bool:
        """Whether the row's server scheduled asynchronously: vLLM before 0.14 did not by default
        (async scheduling became the default with vllm-project/vllm#27614); InferenceMAX passes
        --async-scheduling; vLLM 0.14 on, SGLang and TensorRT-LLM (their overlap schedulers) do."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return not (row["backend"] == "vllm" and before_vllm(str(row.get("backend_version", "")), ASYNC_SCHEDULING_SINCE))

    def sampling_for(self, row) -> tuple[Sampling, str]:
        """(the requests' sampling parameters, why). `auto`: the rows of AIConfigurator's gap analysis
        (`AIC_GAP_ANALYSIS`) were measured with genai-perf (the AIConfigurator team's published tool:
        src/aiconfigurator/eval/benchmarks/genai_perf_runner.py), which sends the lengths and no sampling
        parameters, so a vLLM server sampled with its defaults from the model's generation_config.json
        (vLLM's `--generation-config auto`; backends/sampler.py); InferenceMAX's benchmark_serving.py sends
        `"temperature": 0.0` (utils/bench_serving/backend_request_func.py), as vLLM's own client did by
        default up to 0.14: greedy. Another source's client is not known: greedy, said so. SGLang and
        TensorRT-LLM rows, priced as vLLM deployments, keep greedy's sampler."""
        source, name = str(row.get("silicon_data_source", "")), str(row.get("model_path", ""))
        if self.sampling == "greedy":
            return GREEDY, "--sampling greedy"
        if self.sampling == "auto" and not (row["backend"] == "vllm" and re.search(AIC_GAP_ANALYSIS, source)):
            client = ("InferenceMAX's client sends temperature 0" if re.search(INFERENCEX, source)
                      else "not a vLLM row" if row["backend"] != "vllm" else "the source's client is not known: greedy assumed")
            return GREEDY, client
        found = generation_config_sampling(name, config_dir_of(str(row.get("model_source", ""))))
        why = ("--sampling model" if self.sampling == "model" else
               "genai-perf (AIConfigurator's gap analysis) sends no sampling parameters: the server's defaults")
        if found is None:
            return GREEDY, f"{why}, but no generation config is known for {name}: greedy"
        return found, why

    def warmup_for(self, row, first_wave_bound_ms: float) -> tuple[int, str]:
        """(waves not counted, why). `auto`: none, as vLLM's benchmark counts every request, unless
        the row's measured mean TTFT is below `first_wave_bound_ms`, the least mean TTFT that
        counting a first wave of C prompts sent together allows (`first_wave_ttft_bound_ms`): then
        the measurement left it out (a warm-up, or a longer run), and so does the simulation."""
        if self.warmup_waves != "auto":
            return int(self.warmup_waves), f"--warmup-waves {self.warmup_waves}"
        measured = float(row["silicon_ttft_ms"])
        if measured < first_wave_bound_ms:
            below = f"measured TTFT {measured:.0f} ms is below the {first_wave_bound_ms:.0f} ms that a counted first wave allows"
            if self.prompts_per_client == 1:  # the first wave is every request: leaving it out would leave none
                return 0, f"{below}, but with --prompts-per-client 1 the first wave is every request: counted"
            return 1, f"{below}: not counted"
        return 0, "counted, as vLLM's benchmark counts every request"

    def requests(self, isls: list[int], osls: list[int]) -> list[Request]:
        """The benchmark's requests in send order. With `unique_prompts` N > 0 the client cycles
        through a dataset of N prompts (AIPerf's and genai-perf's `--num-dataset-entries`, 100 by
        default), request i sending prompt i mod N (its length too) with its own output length,
        and the server caches prefixes (vLLM V1's default), so a prompt sent again hits the blocks
        still cached. Each prompt's blocks are keyed by its own hash ids (one per 16 tokens)."""
        if not self.unique_prompts:
            return [Request(i, f"validate-{i}", 0.0, a, b) for i, (a, b) in enumerate(zip(isls, osls))]
        out = []
        for i, b in enumerate(osls):
            u = i % self.unique_prompts
            a = isls[u]
            hash_ids = np.arange(-(-a // 16), dtype=np.int64) + (u << 32) + 1
            out.append(Request(i, f"validate-{i}", 0.0, a, b, hash_ids=hash_ids, hash_block_tokens=16))
        return out

    def warmup_stages(self, requests: list[Request]) -> list[list[Request]]:
        """What the client sends before the benchmark: InferenceMAX's benchmark_serving.py (vLLM's
        client, as vllm/benchmarks/serve.py `benchmark` does) sends one test request, the first
        prompt with its output length, waits for it to finish, and starts the benchmark (its scripts
        pass no --num-warmups, whose default is 0). Its servers ran with --no-enable-prefix-caching,
        so the test request leaves nothing the benchmark finds. With `unique_prompts` the client is
        AIPerf's or genai-perf's, which send no test request: none."""
        if not self.test_request or self.unique_prompts or not requests:
            return []
        first = requests[0]
        return [[Request(len(requests), "test", 0.0, first.num_prompt_tokens, first.max_tokens)]]

    def allreduce_fusion_bytes(self, row) -> float:
        """The largest all-reduce the row's server ran through FlashInfer's fusion (its launch
        recipe's, at the row's TP); 0: none (vLLM's default: the fusion pass is off)."""
        recipe = self._recipe(row)
        return 0.0 if recipe is None else dict(recipe.allreduce_fusion_mb).get(int(row["tp_size"]), 0.0) * 2**20

    def _recipe(self, row) -> LaunchRecipe | None:
        source, model = str(row.get("silicon_data_source", "")), str(row.get("model_path", ""))
        precision = str(row.get("precision", ""))
        return next((recipe for recipe in LAUNCH_RECIPES if recipe.backend == row["backend"]
                     and recipe.system == row["system"] and re.search(recipe.source, source)
                     and re.search(recipe.model, model) and re.search(recipe.precision, precision)
                     and re.search(recipe.version, str(row.get("backend_version", "")))), None)

    def budget_for(self, row) -> int:
        """The row's server's --max-num-batched-tokens: --max-num-batched-tokens for every row, else
        its launch recipe's ("$((ISL * k))"), else vLLM's default; at least the concurrency (every
        running request decodes one token a step)."""
        budget = self.max_num_batched_tokens
        if budget is None:
            recipe = self._recipe(row)
            budget = recipe.budget_per_isl * int(row["isl"]) if recipe and recipe.budget_per_isl else DEFAULT_BUDGET
        return max(int(budget), int(row["concurrency"]))

    def cuda_graphs_for(self, row) -> int | None:
        """The row's server's --max-cudagraph-capture-size: its launch recipe's, else vLLM's default (None)."""
        recipe = self._recipe(row)
        return None if recipe is None else recipe.max_cudagraph_capture_size

    def moe_kernel_for(self, row) -> str:
        """The fused-MoE kernel the row's server ran: --moe-kernel's for every row, else its launch
        recipe's, else vLLM's default (auto)."""
        if self.moe_kernel != "recipe":
            return self.moe_kernel
        recipe = self._recipe(row)
        return "auto" if recipe is None else recipe.moe_kernel

    def kv_cache_for(self, row) -> tuple[str, str]:
        """(the row's KV cache dtype, auto or fp8; why)."""
        if self.kv_cache_dtype != "recipe":
            return self.kv_cache_dtype, f"--kv-cache-dtype {self.kv_cache_dtype}"
        recipe = self._recipe(row)
        return ("auto", KV_DEFAULT) if recipe is None else (recipe.kv_cache_dtype, recipe.cites)

    def lengths(self, isl: int, osl: int, num_prompts: int) -> tuple[list[int], list[int]]:
        rng = np.random.default_rng(self.seed)
        isls = rng.integers(max(int(isl * self.range_ratio), 1), isl + 1, size=num_prompts)
        osls = rng.integers(max(int(osl * self.range_ratio), 1), osl + 1, size=num_prompts)
        return isls.tolist(), osls.tolist()


class ThroughApiServer(ClosedLoop):
    """vLLM's benchmark client in front of vLLM's API server: a request is sent when it has a slot,
    and reaches the engine once the API server (one request at a time, in send order) has taken
    `client.seconds(prompt tokens)` over it. `sent_s` keeps the sends, where client TTFT starts.

    With `async_scheduling` the engine core schedules step k + 1 while the GPU runs step k
    (vllm/v1/core/sched/async_scheduler.py, AsyncScheduler; vllm/v1/engine/core.py,
    step_with_batch_queue): a request that arrives during step k is first seen when step k + 2 is
    scheduled, at the start of step k + 1, so it waits one step more than with synchronous
    scheduling. An idle engine has nothing in flight and sees an arrival at once."""

    def __init__(self, requests, created_s, concurrency, engine, client: ClientOverhead,
                 async_scheduling: bool = True, warmups: list[list[Request]] | None = None):
        super().__init__(requests, created_s, concurrency, engine,
                         ApiServers(lambda r: client.seconds(r.num_prompt_tokens)), warmups)
        self.client = client
        self.async_scheduling = async_scheduling
        self.sent_s: dict[int, float] = {}
        self._last_schedule_s = 0.0  # when the engine last asked for arrivals (scheduled a step)

    def deliver(self, now: float) -> None:
        pipelined = self.async_scheduling and bool(self.engine.state.running)
        horizon = self._last_schedule_s if pipelined else now
        self._last_schedule_s = now
        self._now = now
        self._send_created(now)
        while self._sent and self._sent[0].arrival_s <= horizon:
            self.engine.submit(self._sent.pop(0))

    def _send(self, at: float, after_outputs: bool = False) -> None:
        super()._send(at, after_outputs)
        self.sent_s[self._sent[-1].index] = at


TEXT_COLUMNS = ("id", "backend", "backend_version", "system", "model_path", "precision", "mode",
                "silicon_data_source")  # read as written, never as numbers
BACKENDS = ("vllm", "trtllm", "sglang")  # the frameworks of AIConfigurator's rows (the others as vLLM deployments)
# A row's measured TTFT and TPOT, in ms: a microsecond to 11 days (a token faster than a microsecond, or
# a first token later than that, is no deployment's measurement).
MEASURED_MS = Range(1e-3, 1e9, "ms", "a microsecond to 11 days: no deployment measures outside them")


def read_measured(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    try:
        # (an id and a version are text: read as numbers, "0.20" was vLLM 0.2 and ids 001 and 1 the same;
        # found by a review with odd files)
        frame = pd.read_csv(path, keep_default_na=False, na_values={c: [""] for c in ("isl", "osl", "batch_size")},
                            dtype={c: str for c in TEXT_COLUMNS})
    except (OSError, ValueError) as e:
        raise ServesimError(f"{path}: cannot read the measured deployments: {e}") from None
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise ServesimError(f"{path}: lacks column(s) {', '.join(missing)}")
    for column in ("backend_version", "backend"):  # one reading for every use (" 0.12.0" was two versions)
        if column in frame.columns:
            frame[column] = frame[column].astype(str).str.strip()
    source = frame.get("silicon_data_source", pd.Series([""] * len(frame))).astype(str)
    stated = source.str.extract(STATED_CONCURRENCY)[0]  # the key alone (not max_silicon_concurrency=)
    number = pd.to_numeric(stated, errors="coerce")
    number = number.where((number > 0) & (number == number.round()))  # else NaN: check_row names the text
    frame["concurrency"] = np.where(stated.notna(), number, frame["batch_size"])
    frame["stated_concurrency"] = stated
    return frame


def model_source(model_path: str, models_dir: str | Path | None) -> str | None:
    """A config.json folder under --models for `model_path`, else the preset its name names
    (org and -Instruct / -FP8 suffixes dropped), else the package's model_configs/ file, else None."""
    from backends.presets import MODELS

    if models_dir is not None and (Path(models_dir) / model_path / "config.json").is_file():
        return str(Path(models_dir) / model_path)
    packaged = package_model_config(model_path)
    if packaged is not None and is_moe_config(packaged):  # a MoE checkpoint's own quantization (block fp8, MXFP4)
        return str(packaged)
    name = re.sub(r"(-instruct|-fp8)+$", "", model_path.split("/")[-1], flags=re.IGNORECASE)
    preset = next((p for p in MODELS if p.lower() == name.lower()), None)
    if preset is not None:
        return preset
    return None if packaged is None else str(packaged)


def served_checkpoint(row, model, models: dict) -> tuple:
    """The checkpoint a MoE row served, where its precision says another than its model_path's config:
    (the model, its config's path), or (model, None) where the config is the one served. A 4-bit
    float row (precision fp4, AIConfigurator's `moe_quant_mode` nvfp4) of a model whose own experts
    are not 4-bit floats served NVIDIA's NVFP4 checkpoint of it, nvidia/NAME-NVFP4 (the tables package
    ships its config); without that config the row is refused, never priced with the other weights.
    An int4 row needs the config's int4 experts (Kimi K2.5's)."""
    from backends.model_config import resolve_model

    precision = str(row["precision"])
    if precision == "fp4" and model.expert_dtype not in ("mxfp4", "nvfp4"):
        name = str(row["model_path"]).split("/")[-1]
        config = package_model_config(f"nvidia/{name}-NVFP4")
        if config is None:
            raise ServesimError(f"precision fp4: the row served a 4-bit float checkpoint of {row['model_path']} "
                                f"(its experts are {model.expert_dtype or model.weight_dtype or 'bf16'}), and the "
                                f"tables package has no config of NVIDIA's NVFP4 one, nvidia/{name}-NVFP4")
        served = models.get(str(config))
        if served is None:
            served = models[str(config)] = resolve_model(str(config))
        if served.expert_dtype != "nvfp4":
            raise ServesimError(f"precision fp4: {config} does not hold nvfp4 experts")
        return served, str(config)
    if precision == "int4" and model.expert_dtype != "int4":
        raise ServesimError(f"precision int4: {row['model_path']}'s config has no int4 experts")
    return model, None


def is_moe_config(path: Path) -> bool:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    raw = raw.get("text_config", raw)
    return any(raw.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def hardware_for(system: str) -> str | None:
    """The --hardware of a row's system: the named preset where there is one, else the package's
    system (with the tables extra), else None."""
    if system in SYSTEM_HARDWARE:
        return SYSTEM_HARDWARE[system]
    from backends.costmodel.optables.systems import list_systems

    return system if system in list_systems() else None


def tables_version_for(row) -> str | None:
    """The vLLM version whose tables price the row: its own for a vLLM row that states one, else
    None (the newest)."""
    version = str(row.get("backend_version", "")).strip()
    release = re.match(r"\d+(\.\d+)+", version)  # (its release numbers: 0.19.0 of 0.19.0+cu130)
    return release.group() if row["backend"] == "vllm" and release else None


# A release as the rows write it: 0.12.0, 0.10.1.1, 1.0.0rc3, 0.5.6.post2, 1.1.0rc2.post2, 0.19.0+cu130 (PEP
# 440's, a local label too; blank: not stated), or the name of a build (nightly-5b8c30d62b754b57,
# nightly-dev, gpt-oss-dev: AIConfigurator's package has such rows), which names no tables: a vLLM
# row's are then the newest, said in its notes. A value that starts as a number must be a release.
ROW_VERSION = re.compile(r"\d+(\.\d+)+([-_.]?(a|b|rc)\d*)?([-_.]?post\d*)?([-_.]?dev\d*)?(\+[0-9A-Za-z.]+)?"
                         r"|[A-Za-z][0-9A-Za-z._+-]*")


def is_release(version: str) -> bool:
    """A version that names a release (not a build's name: `ROW_VERSION`)."""
    return version[:1].isdigit()


# The parallel layout's columns: blank or 0 where the row does not state them (a dense model's rows in
# AIConfigurator's package write moe_tp_size 0 and moe_ep_size 0).
LAYOUT_COLUMNS = ("attention_dp_size", "moe_tp_size", "moe_ep_size")


def layout_number(row, column: str) -> int | None:
    """A layout column's value (`LAYOUT_COLUMNS`), None where not stated (blank or 0)."""
    text = str(row.get(column, "")).strip()
    if text in ("", "nan"):
        return None
    number = int(float(text))
    return number or None


def _row_number(row, column: str, where: str, whole: bool = True, optional: bool = False,
                most: Range | None = None, named: str | None = None) -> None:
    """A row's `column` is a positive number (whole where `whole`; blank allowed where `optional`; within
    `most`'s low and high, with its reason), else the file is refused naming the row, the column (`named`:
    the file's column it came from) and the value."""
    value = row.get(column, "")
    column = named or column
    text = str(value).strip()
    if optional and text in ("", "nan"):
        return
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0 and (not whole or number.is_integer())):
        kind = "a positive whole number" if whole else "a positive number"
        shown = "" if isinstance(value, float) and math.isnan(value) else value  # (a blank cell read as NaN)
        raise ServesimError(f"{where}: {column} must be {kind}, got {shown!r}")
    if most is not None and number > most.high:
        shown = f"{number:,.0f}" if number < 1e15 else f"{number:g}"
        raise ServesimError(f"{where}: {column} is {shown}, more than {most.high:,.0f} {most.unit} ({most.reason})")
    if most is not None and number < most.low:
        raise ServesimError(f"{where}: {column} is {number:g} {most.unit}, less than {most.low:g} {most.unit} "
                            f"({most.reason})")


STATED_CONCURRENCY = r"(?:^|[;\s])silicon_concurrency=([^;\s]*)"  # in silicon_data_source, as the package writes it


def check_row(row, where: str) -> None:
    """The fields `sim validate` reads from a row it expresses, each checked (`where`: the file and
    the row): a malformed row is refused in one line, never read as something else."""
    stated = row.get("stated_concurrency")
    if isinstance(stated, str) and not (isinstance(row["concurrency"], (int, float)) and row["concurrency"] > 0):
        raise ServesimError(f"{where}: silicon_data_source's silicon_concurrency must be a positive whole number, "
                            f"got {stated!r}")
    # Bounded as sim bench's flags are: a row past them was skipped naming a flag the user never gave
    # (--max-model-len, --max-num-batched-tokens), or, below those, ran for hours.
    for column, most in (("isl", REQUEST_TOKENS), ("osl", REQUEST_TOKENS), ("tp_size", TENSOR_PARALLEL),
                         ("concurrency", SEQUENCES)):
        # (the concurrency is the file's batch_size where its source states none: named as the file names it)
        named = "batch_size" if column == "concurrency" and not isinstance(stated, str) else None
        _row_number(row, column, where, most=most, named=named)
    if float(row["isl"]) + float(row["osl"]) > MODEL_LEN.high:
        raise ServesimError(f"{where}: isl + osl is {float(row['isl']) + float(row['osl']):,.0f} tokens, more than "
                            f"{MODEL_LEN.high:,.0f} ({MODEL_LEN.reason})")
    for column in ("silicon_ttft_ms", "silicon_tpot_ms"):
        _row_number(row, column, where, whole=False, most=MEASURED_MS)
    if float(row["osl"]) < 2:  # a TPOT (the mean time between a request's output tokens) needs two of them
        raise ServesimError(f"{where}: osl must be at least 2 for the row's TPOT (the time between output tokens), "
                            f"got {row['osl']!r}")
    for column in LAYOUT_COLUMNS:
        if str(row.get(column, "")).strip() not in ("0", "0.0"):  # (0: not stated)
            _row_number(row, column, where, optional=True)
    version = str(row.get("backend_version", "")).strip()
    if version and not ROW_VERSION.fullmatch(version):
        raise ServesimError(f"{where}: backend_version must be a release such as 0.12.0 or a build's name, "
                            f"got {version!r}")


def skip_reason(row, systems: list[str], models_dir, where: str = "the row") -> str | None:
    """Why `row` cannot be expressed, or None (`where`: the file and the row, for a malformed pp_size)."""
    if str(row["backend"]) not in BACKENDS:
        return (f"backend {str(row['backend'])!r}: servesim reads the rows of {', '.join(BACKENDS)} (written so: "
                "the rows of TensorRT-LLM and SGLang as vLLM deployments)")
    if str(row["mode"]) == "disagg":
        return f"mode {row['mode']}: disaggregated serving (prefill and decode workers) is not simulated"
    if str(row["mode"]) != "agg":
        return f"mode {str(row['mode'])!r}: only aggregated serving (mode agg) is simulated"
    _row_number(row, "pp_size", where)
    if int(float(row["pp_size"])) != 1:
        return f"pipeline parallelism (pp_size {row['pp_size']}) is not simulated"
    if str(row["precision"]) not in ("", "fp8", "bf16", "fp4", "int4"):
        return (f"precision {row['precision']}: servesim's cost model prices bf16, fp8 and fp4 (nvfp4) weights, and "
                "int4 experts, only")
    if row["system"] not in systems:
        return f"no operator tables for system {row['system']} (tables for {', '.join(systems) or 'none'})"
    if hardware_for(row["system"]) is None:
        return f"no hardware for system {row['system']}: a preset or, with the tables extra, the package's system"
    if model_source(str(row["model_path"]), models_dir) is None:
        return f"no config for {row['model_path']}: give --models DIR holding {row['model_path']}/config.json"
    return None


def predict_row(row, profile, protocol: Protocol) -> dict:
    """Simulate one measured benchmark with an operator-table profile."""
    ops = profile.op_model()
    budget = protocol.budget_for(row)
    out = simulate_row(row, OpTableBackend(ops, device=profile.source["system"]), profile.tp, profile.dtype,
                       profile.kv_cache_dtype, profile.client_overhead, ops.max_gemm_tokens_per_s(budget),
                       row_tables_note(profile), protocol)
    caveats = kernel_caveats(row)
    if caveats:
        out["notes"] = "; ".join(caveats)
    return out


def simulate_row(row, backend, tp: int, dtype: str, kv_cache_dtype: str, client: ClientOverhead,
                 tokens_per_s: float, tables: str, protocol: Protocol, num_blocks: int | None = None,
                 dp: int = 1, enable_expert_parallel: bool = False, block_size: int = 16) -> dict:
    """Simulate one measured benchmark: one engine, or with `dp` > 1 a DP group of `dp` engine
    ranks of `tp` GPUs in lockstep behind vLLM's DP load balancer (sim/data_parallel.py, as
    `sim replay --dp` runs them), each rank launched with the row's --max-num-seqs C and
    `num_blocks` KV blocks, the benchmark's C clients in front of the API server."""
    c, isl, osl = int(row["concurrency"]), int(row["isl"]), int(row["osl"])
    n = protocol.prompts_per_client * c
    budget = protocol.budget_for(row)
    asynchronous = protocol.async_for(row)
    options = ReplayOptions(
        scheduler=SchedulerConfig("chunked", budget, c, isl + osl, async_scheduling=asynchronous),
        cache=CacheConfig(block_size, num_blocks=num_blocks, enable_prefix_caching=protocol.unique_prompts > 0),
        model=row["model_source"], hardware=hardware_for(row["system"]), tp=tp, dtype=dtype,
        kv_cache_dtype="fp8" if kv_cache_dtype == "fp8" else "auto", seed=protocol.seed,
        dp=dp, enable_expert_parallel=enable_expert_parallel,
        max_cudagraph_capture_size=protocol.cuda_graphs_for(row))
    sampling, sampling_from = protocol.sampling_for(row)
    target = getattr(backend, "ops", backend)
    if not sampling.greedy and not prices_sampler(target):  # (--moe-cost-model roofline: no sampler)
        sampling, sampling_from = GREEDY, f"{sampling_from}; the roofline prices no sampler: greedy"
    plan = resolve(options, backend=backend, host_vllm_version=tables_version_for(row),  # the row's vLLM's host time
                   sampling=sampling)
    host = getattr(plan.backend, "host", None)
    if host is not None:  # which vLLM's host time profile, said beside the tables' versions
        tables = f"{tables}; host time vLLM {host.vllm_version}" + (
            "" if host.version_choice in ("as asked", "the newest") else " (the nearest)")
    isls, osls = protocol.lengths(isl, osl, n)
    requests = protocol.requests(isls, osls)
    warmup, warmup_why = protocol.warmup_for(
        row, first_wave_ttft_bound_ms(c, float(np.mean(isls)), tokens_per_s, protocol.prompts_per_client))
    if dp > 1:
        from sim.app.replay import default_api_servers, make_dp_group
        from sim.data_parallel import ClosedLoopClients

        # vLLM's API servers: one per rank from 0.15, one before (another engine's: one)
        servers = default_api_servers(dp, str(row.get("backend_version", ""))) if row["backend"] == "vllm" else 1
        clients = ClosedLoopClients(requests, c, lambda r: client.seconds(r.num_prompt_tokens), servers)
        result = make_dp_group(plan, requests, clients=clients).run()
        sent_s = clients.sent_s
    else:
        stages = protocol.warmup_stages(requests)  # the test request, run before the benchmark starts
        engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(),
                        TokenTimes(requests + [r for stage in stages for r in stage]), isl + osl)
        # The engine schedules as vLLM's AsyncScheduler does (sim/engine.py), so the client delivers at once.
        workload = ThroughApiServer(requests, [0.0] * n, c, engine, client, False, stages)
        result = simulate(engine, workload)
        result.num_preemptions -= workload.start_counts[0]  # the benchmark's own
        sent_s = workload.sent_s
    rejected = [r for r in result.requests if r.reject_reason is not None]
    if rejected:
        raise ServesimError(f"{len(rejected)} of {n} requests rejected: {rejected[0].reject_reason}")
    ttft, ttft_engine, tpot = client_means(result.requests, sent_s, warmup * c)
    # The token rate the measurement implies (closed loop: C clients, each cycle TTFT + (O - 1) TPOT,
    # each request's prompt and its O - 1 decode tokens through the GEMMs).
    mean_osl = float(np.mean(osls))
    cycle_s = 1e-3 * (float(row["silicon_ttft_ms"]) + (mean_osl - 1.0) * float(row["silicon_tpot_ms"]))
    implied = c * (float(np.mean(isls)) + mean_osl - 1.0) / cycle_s if cycle_s > 0 else float("inf")
    return {"predicted_ttft_ms": 1e3 * ttft, "predicted_tpot_ms": 1e3 * tpot,
            "predicted_engine_ttft_ms": 1e3 * ttft_engine, "max_num_batched_tokens": budget,
            "num_gpu_blocks": plan.num_blocks,
            "num_preemptions": result.num_preemptions, "async_scheduling": asynchronous,
            "warmup_waves": warmup, "warmup_from": warmup_why, "implied_tokens_per_s": implied,
            "tables_max_tokens_per_s": tokens_per_s, "faster_than_tables": bool(implied > tokens_per_s),
            "tables": tables, "sampling": sampling.describe(), "sampling_from": sampling_from}


# An InferenceX row's id ends with its launch config's layout: `..._c64_tp4_ep4_1357` (TP 4, EP 4).
INFERENCEX_LAYOUT_ID = re.compile(r"_tp(?P<tp>\d+)_ep(?P<ep>\d+)_\d+$")


def id_layout(row) -> tuple[int, int] | None:
    """(TP, EP) an InferenceX vLLM row's id names, where its columns state data parallelism that
    layout does not have; None otherwise (the columns are taken).

    InferenceX's dashboard export of 2026-04-06 writes, for the vLLM runs it served with expert
    parallelism, attention_dp_size = TP and moe_ep_size = TP x EP (Kimi-K2.5 and MiniMax-M2.5 on
    B200, MiniMax-M2.5 on H100: `tp4_ep4` as TP 4 x DP 4 on 16 GPUs, EP 16). The launch scripts run
    no data parallelism (benchmarks/single_node/minimaxm2.5_fp8_h100.sh and minimaxm2.5_fp8_b200.sh:
    `vllm serve --tensor-parallel-size=$TP` and `--enable-expert-parallel` when EP_SIZE > 1; no
    --data-parallel-size), and each of those 40 rows repeats, within a few percent and most of them
    exactly, the measurement of the same configuration (system, model, precision, lengths,
    concurrency, TP and EP) in the 2026-03-25 export, which states DP 1. So such a row is the id's
    layout: TP x 1, expert parallel when EP > 1 (vLLM's EP group is then the TP group)."""
    if str(row.get("backend", "")) != "vllm" or not re.match(INFERENCEX, str(row.get("silicon_data_source", ""))):
        return None
    m = INFERENCEX_LAYOUT_ID.search(str(row.get("id", "")))
    dp = layout_number(row, "attention_dp_size")
    if m is None or dp is None or dp <= 1:
        return None
    tp, ep = int(m.group("tp")), int(m.group("ep"))
    if tp != int(row["tp_size"]) or ep not in (1, tp):
        return None  # not the export's convention: the columns stand
    return tp, ep


def moe_layout(row, model) -> tuple[int, int, bool]:
    """(attention TP, DP ranks, expert parallel) of a MoE row: `tp_size` within a DP rank,
    `attention_dp_size` ranks (where blank: moe_tp_size x moe_ep_size / tp_size GPUs over the ranks),
    expert parallel when `moe_ep_size` > 1; refused where vLLM's layout (ModelConfig.moe_parallel)
    would not give the row's MoE TP and EP. An InferenceX vLLM row whose columns state a data
    parallelism its id's launch config does not have is the id's layout (`id_layout`)."""
    named = id_layout(row)
    if named is not None:
        return named[0], 1, named[1] > 1
    tp = int(row["tp_size"])

    def number(column: str, default: int) -> int:
        value = layout_number(row, column)
        return default if value is None else value

    moe_tp, moe_ep = number("moe_tp_size", tp), number("moe_ep_size", 1)
    dp = number("attention_dp_size", max(moe_tp * moe_ep // tp, 1))
    ep = moe_ep > 1
    if model.moe_parallel(tp, dp, ep) != (moe_tp, moe_ep):
        raise ServesimError(f"moe_tp_size {moe_tp} x moe_ep_size {moe_ep} is not vLLM's layout of TP {tp} x DP {dp}"
                            f"{' with' if ep else ' without'} expert parallelism")
    return tp, dp, ep


def predict_moe_row(row, model, protocol: Protocol, data_dir: Path, version: str | None, kv_cache: str,
                    cache: dict) -> dict:
    """Simulate a MoE (MLA, sliding-window) row with the operator tables of its system
    (backends/costmodel/optables/moe.py). DP > 1: the DP ranks in lockstep behind vLLM's DP load
    balancer, fed by the benchmark's C clients (`simulate_row`); each lockstep step's MoE layers
    priced from every rank's tokens (dispatch, kernel and combine: `dp_moe_parts`)."""
    from backends.costmodel.optables.moe import max_tokens_per_s, moe_table_model
    from backends.costmodel.roofline import MoERooflineCostModel
    from backends.hardware import resolve_hardware
    from backends.kv_capacity import kv_capacity

    tp, dp, ep = moe_layout(row, model)
    hardware = resolve_hardware(hardware_for(row["system"]))
    dtype = "fp8" if str(row["precision"]) == "fp8" and not model.weight_dtype else "bf16"
    kernel = protocol.moe_kernel_for(row)
    key = (row["system"], row["model_source"], tp, dp, ep, dtype, kv_cache, version, protocol.moe_distribution, kernel)
    if key not in cache:
        if protocol.moe_cost_model == "roofline":
            cache[key] = MoERooflineCostModel(model, hardware, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache,
                                              enable_expert_parallel=ep, dp=dp)
        else:
            cache[key] = moe_table_model(model, hardware, row["system"], data_dir, tp, dtype, kv_cache, ep, dp=dp,
                                         vllm_version=version, distribution=protocol.moe_distribution,
                                         moe_kernel=kernel)
    backend = cache[key]
    c = int(row["concurrency"])
    budget = protocol.budget_for(row)
    block_size = SPARSE_BLOCK_SIZE if model.index_topk else 16  # the only size vLLM serves sparse attention with
    kv = kv_capacity(model, hardware, block_size=block_size, gpu_memory_utilization=0.9, max_num_batched_tokens=budget,
                     max_num_seqs=c, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache,
                     max_model_len=int(row["isl"]) + int(row["osl"]), dp=dp, enable_expert_parallel=ep,
                     async_scheduling=protocol.async_for(row))
    ops = backend.cost_model_summary()["operators"] if hasattr(backend, "cost_model_summary") else \
        {"moe": "the MoE roofline (--moe-cost-model roofline)"}
    note = "; ".join(f"{k}: {v}" for k, v in ops.items() if k in ("moe", "linear", "attention", "allreduce",
                                                                      "dispatch", "combine"))
    out = simulate_row(row, backend, tp, dtype, kv_cache, ClientOverhead(), max_tokens_per_s(backend, budget), note,
                       protocol, num_blocks=kv.num_gpu_blocks, dp=dp, enable_expert_parallel=ep, block_size=block_size)
    out["notes"] = (f"TP {tp} x DP {dp}{' EP' if ep else ''} (MoE TP {backend.moe_tp}, EP {backend.ep}): "
                    + ("one engine" if dp == 1 else
                       f"{dp} DP ranks in lockstep behind vLLM's DP load balancer (sim/data_parallel.py, as sim replay "
                       f"--dp), the {c} clients spread by it; each step's MoE layers priced from every rank's tokens "
                       f"(dispatch, kernel, combine), idle ranks' dummy batches included"))
    if id_layout(row) is not None:
        out["notes"] += (f"; layout from the row's id ({row['id']}): its columns' attention_dp_size "
                         f"{row['attention_dp_size']} and moe_ep_size {row['moe_ep_size']} are the 2026-04-06 export's "
                         f"for a TP {tp} run{' with expert parallelism' if ep else ''} (sim/app/validate.py, id_layout)")
    out["notes"] = "; ".join([out["notes"], *kernel_caveats(row)])
    return out


def row_tables_note(profile) -> str:
    """Which version's tables priced the row: each kind's, with "the nearest" where not the one asked."""
    src = profile.source
    asked = src.get("asked_version")
    versions = src.get("table_versions") or {"all": src.get("framework_version")}
    kinds = [k for k in versions if k != "custom_allreduce" or profile.tp > 1]
    text = ", ".join(f"{k} {versions[k]}" + (" (the nearest)" if asked and versions[k] != asked else "") for k in kinds)
    return f"{src.get('system')} vLLM {text}; asked {asked or 'the newest'}"


def first_wave_ttft_bound_ms(concurrency: int, mean_isl: float, tokens_per_s: float, prompts_per_client: int) -> float:
    """The least mean TTFT (ms) over C x K requests whose first C prompts are sent together: the
    i-th of them cannot have its first token before i prompts have passed the GEMMs at their best
    rate, so the first wave's TTFTs sum to at least C (C + 1) / 2 x prompt / rate, and every other
    request's is at least 0."""
    return 1e3 * (concurrency + 1) / 2.0 * mean_isl / tokens_per_s / prompts_per_client


def client_means(requests: list[Request], sent_s: dict[int, float], first_counted: int = 0):
    """(mean client TTFT, mean engine TTFT, mean TPOT) in seconds over the finished requests sent
    from the `first_counted`-th on (requests are sent in index order)."""
    counted = [r for r in requests if r.finish_s is not None and r.index >= first_counted]
    ttft = float(np.mean([r.first_token_s - sent_s[r.index] for r in counted]))
    ttft_engine = float(np.mean([r.first_token_s - r.arrival_s for r in counted]))
    tpot = float(np.mean([(r.finish_s - r.first_token_s) / (r.max_tokens - 1) for r in counted if r.max_tokens > 1]))
    return ttft, ttft_engine, tpot


def mape(measured, predicted) -> float:
    measured, predicted = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    return float(np.mean(np.abs(predicted / measured - 1.0)) * 100.0)


def summarize(rows: pd.DataFrame, skipped: list[dict]) -> dict:
    """validate.json: per group and over all rows, MAPE in percent."""
    groups = []
    if len(rows):
        for key, g in rows.groupby(list(GROUP), sort=True):
            groups.append({**dict(zip(GROUP, key)), "rows": len(g),
                           "ttft_mape": mape(g["measured_ttft_ms"], g["predicted_ttft_ms"]),
                           "tpot_mape": mape(g["measured_tpot_ms"], g["predicted_tpot_ms"])})
    overall = {"rows": len(rows),
               "ttft_mape": mape(rows["measured_ttft_ms"], rows["predicted_ttft_ms"]) if len(rows) else None,
               "tpot_mape": mape(rows["measured_tpot_ms"], rows["predicted_tpot_ms"]) if len(rows) else None}
    return {"groups": groups, "all": overall, "skipped": skipped}


def layout_dir(ops_dir) -> Path:
    """The package-layout data folder the MoE tables are read from: --ops where it is one, else the package's."""
    from backends.costmodel.optables.systems import find_data_dir

    found = find_data_dir(ops_dir)
    return found if found is not None else default_ops_dir()


def default_ops_dir() -> Path:
    """The package's tables (the tables extra), for `sim validate` without --ops."""
    from backends.costmodel.optables.systems import INSTALL_HINT, package_systems_dir

    folder = package_systems_dir()
    if folder is None:
        raise ServesimError(f"give --ops DIR (operator tables), or install the field's published tables: {INSTALL_HINT}")
    return folder / "data"


class RowRunner:
    """What `validate` does to one row (`run`), with what it keeps between rows: each system's tables
    and each deployment's profile or MoE model, built once for the rows that share them."""

    def __init__(self, measured_csv, ops_dir, models_dir, protocol: Protocol, systems: list[str]):
        self.measured_csv, self.ops_dir, self.models_dir = measured_csv, ops_dir, models_dir
        self.protocol, self.systems = protocol, systems
        self.tables: dict = {}
        self.profiles: dict = {}
        self.models: dict = {}
        self.moe_models: dict = {}

    def run(self, i: int, row) -> tuple[str, dict]:
        """("ok", the row of validate.csv) or ("skip", {"id", "reason"}); a row that is not numbers
        of a deployment raises ServesimError (exit 2)."""
        where = f"{self.measured_csv}: row {i + 1} ({row['id']})"
        reason = skip_reason(row, self.systems, self.models_dir, where)
        if reason is None:
            check_row(row, where)
            row = row.copy()
            for column in ("isl", "osl", "tp_size", "concurrency"):  # checked whole: "4.0" is 4
                row[column] = int(float(row[column]))
            requests = self.protocol.prompts_per_client * row["concurrency"]
            if requests > COUNT.high:
                raise ServesimError(f"{where}: concurrency {row['concurrency']:,} x --prompts-per-client "
                                    f"{self.protocol.prompts_per_client} is {requests:,} requests, more than "
                                    f"{COUNT.high:,} ({COUNT.reason})")
            row["model_source"] = model_source(str(row["model_path"]), self.models_dir)
            dtype = str(row["precision"]) if row["precision"] in ("fp8", "fp4") else "bf16"
            kv_cache, kv_why = self.protocol.kv_cache_for(row)
            kv = kv_name(kv_cache)
            version = tables_version_for(row)
            fusion = self.protocol.allreduce_fusion_bytes(row)
            key = (row["system"], row["model_source"], int(row["tp_size"]), dtype, kv, version, fusion)
            try:
                from backends.model_config import resolve_model

                model = self.models.get(row["model_source"])
                if model is None:
                    model = self.models[row["model_source"]] = resolve_model(row["model_source"])
                served = model.served_dtype(dtype)  # a dense fp8 checkpoint's fp8, as vLLM serves it
                if served != dtype:
                    dtype, key = served, (*key[:3], served, *key[4:])
                checkpoint = None
                if model.is_extended:
                    model, checkpoint = served_checkpoint(row, model, self.models)
                    if checkpoint is not None:
                        row["model_source"] = checkpoint
                served = served_kv_cache_dtype(model, kv_cache, row["system"])  # as vLLM resolves auto
                if served != kv_cache:
                    kv_why = (f"the checkpoint's ({model.name}'s quantization config), as vLLM resolves auto"
                              if model.kv_cache_dtype else
                              f"vLLM's auto for {model.name} on {row['system']}: fp8 (GLM-5 on Blackwell)")
                    kv_cache, kv = served, kv_name(served)
                    key = (*key[:4], kv, *key[5:])
                if model.is_extended:
                    prediction = predict_moe_row(row, model, self.protocol, layout_dir(self.ops_dir), version,
                                                 "fp8" if kv == "fp8" else "auto", self.moe_models)
                    if checkpoint is not None:
                        prediction["notes"] = "; ".join([f"precision {row['precision']}: NVIDIA's NVFP4 checkpoint "
                                                         f"{model.name} (the tables package's config)",
                                                         prediction.get("notes", "")])
                elif str(row["precision"]) == "int4":
                    raise ServesimError(f"precision int4: {row['model_path']}'s config has no int4 weights")
                elif (layout_number(row, "attention_dp_size") or 1) > 1:  # a dense model's DP: replicas, not expressed
                    raise ServesimError(f"attention_dp_size {layout_number(row, 'attention_dp_size')} on a dense model: data-parallel "
                                        "ranks of a dense model (independent replicas behind one load balancer) are "
                                        "not expressed here; its single-rank rows are")
                elif key not in self.profiles:
                    from backends.hardware import resolve_hardware

                    if (row["system"], version) not in self.tables:
                        self.tables[row["system"], version] = load_tables(self.ops_dir, row["system"], version=version)
                    hardware = resolve_hardware(hardware_for(row["system"]))
                    self.profiles[key] = build_profile(
                        self.tables[row["system"], version], model.name, model, hardware.name, key[2], dtype, kv,
                        nvlink_bytes_per_s=hardware.nvlink_bandwidth, pcie_bytes_per_s=hardware.pcie_bandwidth,
                        allreduce_fusion_max_bytes=fusion, gpus_per_node=hardware.gpus_per_node,
                        inter_node_bytes_per_s=hardware.inter_node_bandwidth)
                if not model.is_extended:
                    prediction = predict_row(row, self.profiles[key], self.protocol)
            except ServesimError as e:
                reason = str(e)
        if reason is not None:
            return "skip", {"id": str(row["id"]), "reason": reason}
        measured_ttft, measured_tpot = float(row["silicon_ttft_ms"]), float(row["silicon_tpot_ms"])
        return "ok", {"id": row["id"], **{g: row[g] if g != "model" else row["model_path"] for g in GROUP},
                      "tp": int(row["tp_size"]), "isl": int(row["isl"]), "osl": int(row["osl"]),
                      "concurrency": int(row["concurrency"]), "measured_ttft_ms": measured_ttft,
                      "predicted_ttft_ms": prediction["predicted_ttft_ms"],
                      "ttft_error_pct": 100 * (prediction["predicted_ttft_ms"] / measured_ttft - 1),
                      "measured_tpot_ms": measured_tpot, "predicted_tpot_ms": prediction["predicted_tpot_ms"],
                      "tpot_error_pct": 100 * (prediction["predicted_tpot_ms"] / measured_tpot - 1),
                      "kv_cache_dtype": kv_cache, "kv_cache_dtype_from": kv_why,
                      **{k: prediction.get(k, "") for k in PREDICTED_COLUMNS}}


SERIAL_BELOW = 16  # rows: fewer run in this process, where starting workers would take longer than they save


def _run_rows(measured_csv, ops_dir, models_dir, protocol: Protocol, systems: list[str],
              rows: list[tuple[int, dict]]) -> list[tuple[int, str, object]]:
    """A worker's share of the rows: (row index, "ok" or "skip", its result), or (row index,
    "error", the message) for a row refused, which the parent raises in row order."""
    runner = RowRunner(measured_csv, ops_dir, models_dir, protocol, systems)
    out: list[tuple[int, str, object]] = []
    for i, values in rows:
        try:
            kind, result = runner.run(i, pd.Series(values))
        except ServesimError as e:
            out.append((i, "error", str(e)))
            break  # the parent stops at the first refused row, as a run of one process does
        out.append((i, kind, result))
    return out


def _shares(frame: pd.DataFrame, jobs: int) -> list[list[tuple[int, dict]]]:
    """The rows in shares for `jobs` workers: the rows of one deployment (system, model, TP, precision,
    version) together where they can be, so that each worker builds its profiles once, and no share
    larger than the rows over four shares a worker, so that the workers end together."""
    keys = ["system", "model_path", "tp_size", "precision", "backend_version"]
    most = max(1, -(-len(frame) // (4 * jobs)))
    shares: list[list[tuple[int, dict]]] = []
    for _, group in frame.groupby([frame[k].astype(str) for k in keys], sort=False):
        rows = [(int(i), row.to_dict()) for i, row in group.iterrows()]
        shares += [rows[k:k + most] for k in range(0, len(rows), most)]
    return sorted(shares, key=len, reverse=True)  # the longest first


def validate(measured_csv, ops_dir, out_dir, models_dir=None, protocol: Protocol = Protocol(),
             progress=None, jobs: int = 1) -> dict:
    """Run every expressible row; write validate.csv, validate.json and report.html to out_dir.
    With `jobs` above 1 (and SERIAL_BELOW rows or more) the rows run in that many worker processes,
    with the same results, in the same order."""
    frame = read_measured(measured_csv)
    if not len(frame):
        raise ServesimError(f"{measured_csv}: holds no rows, only a header")
    ops_dir = default_ops_dir() if ops_dir is None else ops_dir
    systems = systems_in(ops_dir)
    if not systems:
        raise ServesimError(f"{ops_dir}: holds no operator tables (a system's *_perf files, or the tables package's "
                            "layout with systems/data or data: docs/tables.md)")
    out: list[dict] = []
    skipped: list[dict] = []
    if jobs <= 1 or len(frame) < SERIAL_BELOW:
        runner = RowRunner(measured_csv, ops_dir, models_dir, protocol, systems)
        for i, row in frame.iterrows():
            kind, result = runner.run(int(i), row)
            (out if kind == "ok" else skipped).append(result)
            if progress is not None:
                progress(len(out), len(skipped), len(frame))
    else:
        results = _run_in_workers(frame, jobs, (measured_csv, ops_dir, models_dir, protocol, systems),
                                  progress)
        for i in sorted(results):
            kind, result = results[i]
            if kind == "error":
                raise ServesimError(str(result))
            (out if kind == "ok" else skipped).append(result)
    rows = pd.DataFrame(out, columns=["id", *GROUP, "tp", "isl", "osl", "concurrency", "measured_ttft_ms",
                                      "predicted_ttft_ms", "ttft_error_pct", "measured_tpot_ms", "predicted_tpot_ms",
                                      "tpot_error_pct", *PREDICTED_COLUMNS, "kv_cache_dtype", "kv_cache_dtype_from"])
    summary = summarize(rows, skipped)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "validate.csv", rows.to_csv(index=False))
    atomic_write_text(out_dir / "validate.json", json.dumps(summary, indent=2) + "\n")
    from reports.validate_report import validate_report_html

    atomic_write_text(out_dir / "report.html", validate_report_html(rows, summary, protocol, Path(measured_csv).name))
    return summary


def _run_in_workers(frame: pd.DataFrame, jobs: int, inputs: tuple, progress) -> dict[int, tuple[str, object]]:
    """Every row's (kind, result) by row index, from `jobs` worker processes (sim/app/workers.py: they die
    with this process); rows after a refused one in its worker's share are not run (the parent raises)."""
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool

    from sim.app.workers import pool, stop

    shares = _shares(frame, jobs)
    results: dict[int, tuple[str, object]] = {}
    done = skipped = 0
    executor = pool(min(jobs, len(shares)))
    try:
        futures = [executor.submit(_run_rows, *inputs, share) for share in shares]
        for future in as_completed(futures):
            for i, kind, result in future.result():
                results[i] = (kind, result)
                done += kind == "ok"
                skipped += kind == "skip"
            if progress is not None:
                progress(done, skipped, len(frame))
    except BrokenProcessPool:
        stop(executor)
        raise ServesimError(f"sim validate --jobs {jobs}: a worker process died while it ran rows (killed, or out of "
                            "memory); run again, or with --jobs 1 to run the rows in this process") from None
    except BaseException:
        stop(executor)
        raise
    executor.shutdown()
    return results
