"""Host time per step: what vLLM's engine core does on the CPU each step, measured by running vLLM's own code.

    VLLM_TARGET_DEVICE=cpu .venv-parity/bin/python bench/host_time.py [--out FILE] [--reps N]
    python3 bench/host_time.py --reference-only     # on a serving host: its reference loop, to carry a profile there

Needs vLLM (the `parity` extra); writes profiles/host/vllm-<version>-<cpu>.json (docs/async-scheduling.md: Host time per step).

Each step of a steady batch of R running requests (decoding, prompts of 512 tokens) is driven through:

- `schedule`: vLLM's `Scheduler.schedule()` (vllm/v1/core/sched/scheduler.py), as built by the parity suite
  (tests/parity/vllm_driver.py: make_scheduler), prefix caching on, stats logged as `vllm serve` logs them;
- `prepare_inputs`: the worker's CPU work before the forward pass, on vLLM's own `InputBatch`
  (vllm/v1/worker/gpu_input_batch.py) in CPU memory: `GPUModelRunner._update_states` (new requests'
  `CachedRequestState` + `InputBatch.add_request`, each running request's computed tokens and new blocks via
  `block_table.append_row`, `condense`, `refresh_metadata`) and `GPUModelRunner._prepare_inputs`'s numpy/torch
  work (request indices, `_get_cumsum_and_arange`, positions, the token gather by `torch.index_select`,
  `query_start_loc`, the optimistic `seq_lens`, the discard mask), statement for statement as in
  vllm/v1/worker/gpu_model_runner.py. The host-to-device copies and the slot-mapping kernel run on the GPU side
  and are not timed; they are part of the step's GPU time;
- `sample_bookkeeping`: `GPUModelRunner._bookkeeping_sync`'s CPU part (the sampled ids `.tolist()`, each
  request's new token written into `token_ids_cpu`, its `output_token_ids` extended) and the
  `ModelRunnerOutput` built for the engine core;
- `update_from_output`: vLLM's `Scheduler.update_from_output` (appending each token, stop checks, finishing,
  freeing and caching blocks, the `EngineCoreOutputs`).

The step alternates: one step that admits a new request of P prompt tokens (max_tokens 1, so it also finishes
and frees its blocks) beside the R decodes, then one step of the R decodes alone. Each piece's seconds are fitted
as a + b * requests + c * tokens (tokens: scheduled this step; non-negative coefficients, least squares on the
relative error) over the grid R in 1..512 (14 sizes), P in {0, 256, 1024, 4096}. A piece's seconds are this
thread's CPU seconds (`time.thread_time`: other processes on a shared machine do not count), the median of
--reps steps per point.

Not timed here (no GPU): the attention metadata builders and CUDA-graph dispatch (the worker's per-step work
that needs CUDA; left out rather than guessed), and the engine core's
output thread (msgspec encoding of `EngineCoreOutputs`, another thread) and the front end's `OutputProcessor`
(another process): they run beside the step, not in it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from replay_speed import reference_loop  # bench/ is this script's folder

ROOT = Path(__file__).resolve().parents[1]
PIECES = ("schedule", "prepare_inputs", "sample_bookkeeping", "update_from_output")
DECODE_PROMPT = 512


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def reference_seconds(repeats: int = 5) -> float:
    """The fastest of `repeats` runs of the reference loop (bench/replay_speed.py): a quiet core's figure."""
    return min(reference_loop() for _ in range(repeats))


class Worker:
    """The worker's CPU side of a step (GPUModelRunner._update_states, _prepare_inputs, _bookkeeping_sync),
    on vLLM's own InputBatch in CPU memory."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_tokens: int, block_size: int):
        import numpy as np
        import torch
        try:
            from vllm.v1.worker.gpu_input_batch import InputBatch
        except ImportError:  # vLLM 0.34 replaced V1's GPU model runner with vllm/v1/worker/gpu/
            import vllm
            raise SystemExit(f"bench/host_time.py: vLLM {vllm.__version__} has no V1 GPU model runner "
                             "(vllm/v1/worker/gpu_input_batch.py, gpu_model_runner.py), whose CPU work this "
                             "measures; run it with vLLM 0.33 (docs/async-scheduling.md)") from None

        self.np, self.torch = np, torch
        self.batch = InputBatch(max_num_reqs=max_num_reqs, max_model_len=max_model_len,
                                max_num_batched_tokens=max_tokens, device=torch.device("cpu"), vocab_size=1 << 20,
                                block_sizes=[block_size], max_num_blocks_per_req=[max_model_len // block_size])
        self.requests: dict = {}
        self.arange_np = np.arange(max(max_num_reqs, max_tokens) + 1, dtype=np.int64)
        self.query_pos = np.zeros(max_tokens, dtype=np.int64)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int32)
        self.query_start_loc = np.zeros(max_num_reqs + 1, dtype=np.int32)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.discard = np.zeros(max_num_reqs, dtype=bool)

    def update_states(self, out) -> None:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        batch = self.batch
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
        scheduled = out.num_scheduled_tokens.keys()
        resumed = out.scheduled_cached_reqs.resumed_req_ids
        for rid in batch.req_id_to_index.keys() - (scheduled - resumed):
            batch.remove_request(rid)
        to_add = []
        for new in out.scheduled_new_reqs:
            state = CachedRequestState(req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                                       prompt_embeds=new.prompt_embeds, mm_features=new.mm_features,
                                       sampling_params=new.sampling_params, pooling_params=None, generator=None,
                                       block_ids=new.block_ids, num_computed_tokens=new.num_computed_tokens,
                                       output_token_ids=[], lora_request=new.lora_request)
            self.requests[new.req_id] = state
            to_add.append(state)
        data = out.scheduled_cached_reqs
        for i, rid in enumerate(data.req_ids):
            state = self.requests[rid]
            state.num_computed_tokens = data.num_computed_tokens[i]
            new_block_ids = data.new_block_ids[i]
            if new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids.extend(new_ids)
            index = batch.req_id_to_index.get(rid)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = data.num_computed_tokens[i]
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, index)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def prepare_inputs(self, out):
        np, torch, batch = self.np, self.torch, self.batch
        num_reqs = batch.num_reqs
        num_scheduled = np.array([out.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32)
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        offsets = np.repeat(cu - num_scheduled, num_scheduled)
        np.subtract(self.arange_np[:total], offsets, out=self.query_pos[:total])
        positions = batch.num_computed_tokens_cpu[req_indices] + self.query_pos[:total]
        token_indices = positions + req_indices * batch.token_ids_cpu.shape[1]
        torch.index_select(batch.token_ids_cpu_tensor.flatten(), 0, torch.from_numpy(token_indices),
                           out=self.input_ids[:total])
        self.query_start_loc[0] = 0
        self.query_start_loc[1:num_reqs + 1] = cu
        self.query_start_loc[num_reqs + 1:].fill(total)
        torch.add(batch.num_computed_tokens_cpu_tensor[:num_reqs], torch.from_numpy(num_scheduled),
                  out=self.seq_lens[:num_reqs])
        num_tokens = np.array([self.requests[r].num_tokens for r in batch.req_ids], dtype=np.int32)
        self.discard[:num_reqs] = self.seq_lens[:num_reqs].numpy() < num_tokens
        return num_scheduled

    def bookkeeping(self, sampled_ids: list[int]):
        """`sampled_ids`: the model's sampled token per request, in batch order."""
        from vllm.v1.outputs import ModelRunnerOutput

        batch, torch = self.batch, self.torch
        valid = torch.tensor(sampled_ids, dtype=torch.int32).view(-1, 1).tolist()
        for i in self.np.nonzero(self.discard[:batch.num_reqs])[0]:
            valid[int(i)].clear()
        req_ids = batch.req_ids
        for i, ids in enumerate(valid):
            if not ids:
                continue
            start = batch.num_tokens_no_spec[i]
            batch.token_ids_cpu[i, start:start + 1] = ids
            batch.num_tokens_no_spec[i] = start + 1
            self.requests[req_ids[i]].output_token_ids.extend(ids)
        return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index=dict(batch.req_id_to_index),
                                 sampled_token_ids=valid)


def measure(num_running: int, prompts: list[int], reps: int) -> list[dict]:
    """Rows (piece, requests, tokens, seconds: the median of `reps` steps) for R running requests."""
    import numpy as np
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from tests.parity.vllm_driver import EngineSetup, _block_hasher_ready, make_scheduler

    _block_hasher_ready()
    block_size = 16
    max_new = max(prompts)
    max_tokens = num_running * DECODE_PROMPT + max_new + 64
    steps = 3 + 2 * reps * len(prompts)
    blocks = num_running * (-(-(DECODE_PROMPT + steps + 16) // block_size)) + 2 * (max_new // block_size) + 64
    setup = EngineSetup(block_size=block_size, num_gpu_blocks=blocks, max_num_batched_tokens=max_tokens,
                        max_num_seqs=num_running + 1, max_model_len=8192)
    scheduler = make_scheduler(setup)
    worker = Worker(num_running + 1, setup.max_model_len, max_tokens, block_size)
    hasher = get_request_block_hasher(block_size, sha256)
    rng = np.random.default_rng(num_running)
    serial = itertools.count()

    def add(prompt: int, max_out: int) -> None:
        ids = rng.integers(1, 1 << 19, prompt).tolist()  # distinct prompts: no prefix hits
        params = SamplingParams(max_tokens=max_out, ignore_eos=True)
        scheduler.add_request(Request(f"{next(serial):08d}", ids, params, None, arrival_time=time.time(),
                                      block_hasher=hasher))

    clock = time.thread_time  # this thread's CPU seconds: other processes on a shared machine do not count

    def step() -> tuple[int, int, dict[str, float]]:
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        worker.update_states(out)
        worker.prepare_inputs(out)
        t2 = clock()
        sampled = rng.integers(1, 1 << 19, worker.batch.num_reqs).tolist()  # the GPU's sampled tokens
        t3 = clock()
        output = worker.bookkeeping(sampled)
        t4 = clock()
        scheduler.update_from_output(out, output)
        t5 = clock()
        return (len(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                {"schedule": t1 - t0, "prepare_inputs": t2 - t1, "sample_bookkeeping": t4 - t3,
                 "update_from_output": t5 - t4})

    for _ in range(num_running):
        add(DECODE_PROMPT, 1 << 20)
    for _ in range(3):  # admit them all, then two decode steps to settle
        step()
    rows = []
    decode_times: dict[str, list[float]] = {p: [] for p in PIECES}
    for prompt in prompts:
        if prompt == 0:
            continue
        times: dict[str, list[float]] = {p: [] for p in PIECES}
        for _ in range(reps):
            add(prompt, 1)
            reqs, tokens, t = step()
            assert (reqs, tokens) == (num_running + 1, num_running + prompt), (reqs, tokens)
            for p in PIECES:
                times[p].append(t[p])
            reqs_d, tokens_d, t = step()
            assert (reqs_d, tokens_d) == (num_running, num_running), (reqs_d, tokens_d)
            for p in PIECES:
                decode_times[p].append(t[p])
        for p in PIECES:
            rows.append({"piece": p, "requests": num_running + 1, "tokens": num_running + prompt,
                         "seconds": statistics.median(times[p])})
    for p in PIECES:
        rows.append({"piece": p, "requests": num_running, "tokens": num_running,
                     "seconds": statistics.median(decode_times[p])})
    return rows


def fit(rows: list[dict]) -> tuple[float, float, float]:
    """Non-negative (a, b, c) of a + b * requests + c * tokens, least squares on the relative error: every
    subset of the three terms is fitted, the best with non-negative coefficients kept."""
    import numpy as np

    x = np.array([[1.0, r["requests"], r["tokens"]] for r in rows])
    y = np.array([r["seconds"] for r in rows])
    w = 1.0 / y
    best, best_err = (0.0, 0.0, 0.0), float("inf")
    for mask in itertools.product((True, False), repeat=3):
        cols = [k for k in range(3) if mask[k]]
        if not cols:
            continue
        coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        err = float(np.sum(((x @ full) * w - 1.0) ** 2))
        if err < best_err:
            best, best_err = (float(full[0]), float(full[1]), float(full[2])), err
    return best


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="profile file (default profiles/host/vllm-<version>-<cpu>.json)")
    parser.add_argument("--reps", type=int, default=25, help="steps timed per grid point (median)")
    parser.add_argument("--requests", default="1,2,4,8,16,32,48,64,96,128,192,256,384,512")
    parser.add_argument("--prompts", default="0,256,1024,4096")
    parser.add_argument("--reference-only", action="store_true",
                        help="print this CPU's reference loop seconds (to carry a profile to it) and stop")
    args = parser.parse_args(argv)
    ref = reference_seconds()
    if args.reference_only:
        print(json.dumps({"cpu": cpu_model(), "reference_loop_s": round(ref, 4)}))
        return 0
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, str(ROOT))
    import vllm

    prompts = [int(p) for p in args.prompts.split(",")]
    rows: list[dict] = []
    for r in (int(x) for x in args.requests.split(",")):
        new = measure(r, prompts, args.reps)
        rows += new
        print(f"R={r}: " + ", ".join(f"{row['piece']}@{row['tokens']}={row['seconds'] * 1e6:.0f}us" for row in new),
              flush=True)
    ref_after = reference_seconds()
    pieces = {}
    for p in PIECES:
        a, b, c = fit([row for row in rows if row["piece"] == p])
        pieces[p] = {"fixed_s": a, "per_request_s": b, "per_token_s": c}
    cpu = cpu_model()
    profile = {
        "what": "vLLM engine core host (CPU) seconds per step = sum over pieces of "
                "fixed_s + per_request_s * requests + per_token_s * tokens (docs/async-scheduling.md: Host time per step)",
        "vllm_version": vllm.__version__,
        "cpu": cpu,
        "python": platform.python_version(),
        "reference_loop_s": round(min(ref, ref_after), 4),
        "reference_loop": "bench/replay_speed.py reference_loop (fastest of 5, before and after)",
        "measured_by": "bench/host_time.py",
        "grid": {"requests": args.requests, "prompt_tokens": args.prompts, "reps": args.reps},
        "pieces": pieces,
        "rows": [{**row, "seconds": round(row["seconds"], 9)} for row in rows],
    }
    out = Path(args.out) if args.out else ROOT / "profiles" / "host" / f"vllm-{vllm.__version__}-{slug(cpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    for p, coef in pieces.items():
        print(f"{p:20s} fixed {coef['fixed_s'] * 1e6:8.2f} us  per request {coef['per_request_s'] * 1e6:7.3f} us"
              f"  per token {coef['per_token_s'] * 1e9:8.2f} ns")
    print(f"reference loop {profile['reference_loop_s']} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
