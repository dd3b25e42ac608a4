"""A first validation loop: AIConfigurator's measured deployments against the operator-table model.

Each row of ../shared/gpu-data/aiconfigurator/silicon_llama3.1.csv is a closed-loop benchmark:
C clients, each sending its next request (fixed ISL prompt, fixed OSL output) when the previous
one finishes. This script simulates exactly that with servesim's engine and the chunked (vLLM V1)
policy, with vLLM's serving defaults on H100/H200 (max_num_batched_tokens 8192, max_num_seqs 1024:
vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults), and prints measured against predicted
mean TTFT and TPOT per row and per group. No parameter is fitted to these rows.

Until `sim bench` exists (issue 14) the closed loop lives here, and the KV cache size is a
stated approximation (see `approx_num_blocks`), not vLLM's own profile-run figure.

    PYTHONPATH=$PWD python scripts/silicon_loop.py [--rows vllm] [--prompts-per-client 10] [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from backends.opbackend import OpTableBackend
from backends.opderive import derive, per_gpu_heads
from backends.opmodel import OperatorModel, StepOverhead
from backends.optables import load_tables, systems_in
from backends.presets import get_hardware, get_model, num_parameters
from policies import load_policy
from sim.arrivals import TraceArrivals, simulate
from sim.block_manager import BlockManager
from sim.config import SchedulerConfig
from sim.engine import Engine, TokenTimes
from sim.request import Request

DATA = Path(__file__).resolve().parents[1] / ".." / ".." / "shared" / "gpu-data" / "aiconfigurator"
MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "Llama-3.1-8B", "nvidia/Llama-3.1-8B-Instruct-FP8": "Llama-3.1-8B",
          "meta-llama/Llama-3.1-70B": "Llama-3.1-70B"}
HARDWARE = {"h100_sxm": "H100-SXM", "h200_sxm": "H200"}
NVLINK_BYTES_PER_S = 450e9  # H100/H200 SXM: NVLink 4, 18 links x 25 GB/s per direction
# The API server handles one request at a time before the engine sees it (vLLM's OpenAI server is
# one asyncio process): a fixed part (HTTP, validation, handing the request to the engine core: a
# stated 1 ms estimate) and the prompt's tokenisation (~2 us per token: ~500k tokens/s on one
# core, as measured in https://andyluo7.github.io/llm/amd/mi300x/vllm/lmcache/performance/2026/05/14/
# cpu-gpu-codesign-agentic-inference-mi300x/). Requests queue for it in the order clients send them.
API_FIXED_S = 1e-3
API_PER_PROMPT_TOKEN_S = 2e-6


class ClosedLoop(TraceArrivals):
    """C clients send at 0 and then each when its previous request ends; a request reaches the
    engine after the API server (a FIFO single server) has processed it."""

    reacts_to_finishes = True

    def __init__(self, requests, concurrency, api_seconds, engine):
        """`api_seconds(num_prompt_tokens)`: the API server's time for one request."""
        self.sent_s = {}
        self._api_free = 0.0
        self._api_seconds = api_seconds
        for r in requests:
            r.arrival_s = math.inf
        for r in requests[:concurrency]:
            r.arrival_s = self._through_api(r, 0.0)
        super().__init__(requests, engine)
        self._released = min(concurrency, len(requests))

    def _through_api(self, r, sent: float) -> float:
        self.sent_s[r.index] = sent
        self._api_free = max(self._api_free, sent) + self._api_seconds(r.num_prompt_tokens)
        return self._api_free

    def on_done(self, request, now):
        if self._released < len(self.requests):
            nxt = self.requests[self._released]
            nxt.arrival_s = self._through_api(nxt, now if now is not None else nxt.arrival_s)
            self._released += 1


def approx_num_blocks(model: dict, hardware: dict, tp: int, dtype: str, block_size: int = 16,
                      utilization: float = 0.9, reserve_bytes: float = 4 * 2**30) -> int:
    """KV blocks per GPU: memory x utilization - weights / tp - a stated 4 GiB for activations,
    CUDA graphs and non-torch memory (issue 14 replaces this with vLLM's own accounting)."""
    embed = model["vocab_size"] * model["hidden_size"] * 2
    dense = num_parameters(model) - embed
    weights = (dense * (1 if dtype == "fp8" else 2) + embed * 2) / tp
    _, kv_heads = per_gpu_heads(model, tp)
    per_token = 2 * model["num_hidden_layers"] * kv_heads * model["head_dim"] * 2
    available = hardware["memory_bytes"] * utilization - weights - reserve_bytes
    return int(available // (block_size * per_token))


def run_benchmark(op_model: OperatorModel, num_blocks: int, isl: int, osl: int, concurrency: int,
             num_prompts: int, range_ratio: float, seed: int = 0) -> dict:
    """One benchmark as vLLM's benchmark_serving.py runs it with --random-range-ratio r: prompt and
    output lengths uniform integers in [int(r x len), len] (sample_random_requests)."""
    scheduler = SchedulerConfig("chunked", max_num_batched_tokens=8192, max_num_seqs=1024)
    rng = np.random.default_rng(seed)
    isls = rng.integers(int(isl * range_ratio), isl + 1, size=num_prompts).tolist()
    osls = rng.integers(max(int(osl * range_ratio), 1), osl + 1, size=num_prompts).tolist()
    requests = [Request(i, f"r{i}", 0.0, a, b) for i, (a, b) in enumerate(zip(isls, osls))]
    engine = Engine(load_policy("chunked")(scheduler), OpTableBackend(op_model), BlockManager(num_blocks, 16, True),
                    TokenTimes(requests), max_model_len=isl + osl)
    workload = ClosedLoop(requests, concurrency, lambda n: API_FIXED_S + API_PER_PROMPT_TOKEN_S * n, engine)
    result = simulate(engine, workload)
    done = [r for r in result.requests if r.finish_s is not None]
    ttft = np.array([r.first_token_s - r.arrival_s for r in done])
    client = np.array([r.first_token_s - workload.sent_s[r.index] for r in done])
    tpot = np.array([(r.finish_s - r.first_token_s) / (r.max_tokens - 1) for r in done if r.max_tokens > 1])
    return {"ttft_engine_ms": 1e3 * ttft.mean(), "ttft_client_ms": 1e3 * client.mean(), "tpot_ms": 1e3 * tpot.mean(),
            "num_preemptions": result.num_preemptions, "num_steps": len(result.steps)}


def rows_to_run(frame: pd.DataFrame, which: str, systems: list[str]) -> tuple[pd.DataFrame, list[tuple]]:
    skipped = []
    keep = []
    for _, row in frame.iterrows():
        reason = None
        if row["mode"] != "agg":
            reason = "disaggregated serving"
        elif row["pp_size"] != 1:
            reason = "pipeline parallelism"
        elif row["precision"] == "fp4":
            reason = "fp4"
        elif row["system"] not in systems:
            reason = f"no operator tables for {row['system']}"
        elif which != "all" and row["backend"] != which:
            reason = f"not {which}"
        if reason:
            skipped.append((row["id"], reason))
        else:
            keep.append(row)
    return pd.DataFrame(keep), skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DATA / "silicon_llama3.1.csv"))
    ap.add_argument("--ops", default=str(DATA))
    ap.add_argument("--rows", default="vllm", help="vllm, sglang, trtllm or all")
    ap.add_argument("--prompts-per-client", type=int, default=10)
    ap.add_argument("--range-ratio", type=float, default=0.8,
                    help="lengths uniform in [r x len, len]; 0.8 is InferenceMAX's client setting")
    ap.add_argument("--max-rows", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    frame = pd.read_csv(args.csv)
    frame["concurrency"] = frame["silicon_data_source"].str.extract(r"silicon_concurrency=(\d+)")[0].astype(int)
    rows, skipped = rows_to_run(frame, args.rows, systems_in(args.ops))
    if args.max_rows:
        rows = rows.head(args.max_rows)
    print(f"{len(rows)} rows to simulate, {len(skipped)} skipped")
    tables, models, out = {}, {}, []
    overhead = StepOverhead(0.0, "vLLM schedules asynchronously: CPU work overlaps the GPU")
    for _, row in rows.iterrows():
        system, tp = row["system"], int(row["tp_size"])
        dtype = "fp8" if row["precision"] == "fp8" else "bf16"
        name = MODELS[row["model_path"]]
        key = (system, name, tp, dtype)
        if key not in models:
            if system not in tables:
                tables[system] = load_tables(args.ops, system)
            model = get_model(name)
            derived = derive(tables[system], model, tp, dtype, nvlink_bytes_per_s=NVLINK_BYTES_PER_S)
            models[key] = (OperatorModel(derived, model, tp, dtype, "bf16", overhead),
                           approx_num_blocks(model, get_hardware(HARDWARE[system]), tp, dtype))
        op_model, num_blocks = models[key]
        c, isl, osl = int(row["concurrency"]), int(row["isl"]), int(row["osl"])
        start = time.time()
        sim = run_benchmark(op_model, num_blocks, isl, osl, c, args.prompts_per_client * c, args.range_ratio)
        ttft = sim["ttft_client_ms"]
        out.append({"id": row["id"], "system": system, "backend": row["backend"], "model": name, "tp": tp,
                    "dtype": dtype, "isl": isl, "osl": osl, "concurrency": c,
                    "ttft_measured_ms": row["silicon_ttft_ms"], "ttft_predicted_ms": ttft,
                    "ttft_engine_ms": sim["ttft_engine_ms"], "tpot_measured_ms": row["silicon_tpot_ms"],
                    "tpot_predicted_ms": sim["tpot_ms"], "num_blocks": num_blocks,
                    "preemptions": sim["num_preemptions"], "wall_s": time.time() - start})
        r = out[-1]
        print(f"{system} {row['backend']:6} {name:13} tp{tp} {dtype} {isl:5}/{osl:<5} c{c:<4} "
              f"TTFT {r['ttft_measured_ms']:9.1f} {ttft:9.1f} ({ttft / r['ttft_measured_ms'] - 1:+6.1%})  "
              f"TPOT {r['tpot_measured_ms']:7.2f} {sim['tpot_ms']:7.2f} "
              f"({sim['tpot_ms'] / r['tpot_measured_ms'] - 1:+6.1%})  pre {sim['num_preemptions']} "
              f"[{r['wall_s']:.1f}s]", flush=True)
    result = pd.DataFrame(out)
    if args.out:
        result.to_csv(args.out, index=False)
    result["ttft_ape"] = (result["ttft_predicted_ms"] / result["ttft_measured_ms"] - 1).abs() * 100
    result["tpot_ape"] = (result["tpot_predicted_ms"] / result["tpot_measured_ms"] - 1).abs() * 100
    print(result.groupby(["system", "backend", "model", "dtype"])[["ttft_ape", "tpot_ape"]].agg(["count", "mean"]))
    print("by tp:", result.groupby(["system", "model", "tp"])[["ttft_ape", "tpot_ape"]].mean().round(1))


if __name__ == "__main__":
    main()
