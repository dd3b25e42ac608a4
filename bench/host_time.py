"""Host time per step: what vLLM's engine core does on the CPU each step, measured by running vLLM's own code.

    VLLM_TARGET_DEVICE=cpu .venv-parity/bin/python bench/host_time.py [--out FILE] [--reps N]   # vLLM 0.12, or from 0.33
    python3 bench/host_time.py --reference-only     # on a serving host: its reference loop, to carry a profile there

Needs vLLM (the `parity` extra); writes profiles/host/vllm-<version>-<cpu>.json (docs/async-scheduling.md: Host time per step).
vLLM 0.12 (the version of the synchronous deployments `sim validate` reads) in a virtualenv of its own:
`pip install torch==2.13.0 && pip install --no-deps vllm==0.12.0 && pip install -e '.[parity,test]' gguf blake3 diskcache`;
its scheduler's pieces are its own code, its worker's the 0.33 statements below on 0.12's InputBatch, with 0.12's
slot mapping, which it computes on the CPU (BlockTable.compute_slot_mapping, numpy) where 0.33 launches a kernel.

Each step of a steady batch of R running requests (decoding, prompts of 512 tokens) is driven through:

- `schedule`: vLLM's `Scheduler.schedule()` (vllm/v1/core/sched/scheduler.py), as built by the parity suite
  (tests/parity/vllm_driver.py: make_scheduler), prefix caching on, stats logged as `vllm serve` logs them;
- `update_from_output`: vLLM's `Scheduler.update_from_output` (appending each token, stop checks, finishing,
  freeing and caching blocks, the `EngineCoreOutputs`);

and the worker's two pieces, which follow the installed vLLM's model runner:

vLLM 0.33 (V1's GPU model runner, vllm/v1/worker/gpu_model_runner.py; `Worker`):
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

vLLM 0.34 on (the model runner of vllm/v1/worker/gpu/, which replaced V1's; `Worker34`): vLLM's own
`GPUModelRunner` methods (vllm/v1/worker/gpu/model_runner.py), bound to a stand-in runner whose state is
vLLM's own classes in CPU memory (`RequestState`, states.py; `BlockTables`, block_table.py; `InputBuffers`;
`Sampler`, `PromptLogprobsWorker`, `LoraState`), the Triton kernels launching nothing:
- `prepare_inputs`: as `execute_model` calls them, `finish_requests` (`_remove_request`), `free_states`,
  `add_requests` (`RequestState.add_request`, `BlockTables.append_block_ids`, the sampler's and prompt
  logprobs' `add_request`, the staged writes' CPU side: `StagedWriteTensor.apply_write`'s buffers),
  `update_requests` (each running request's computed tokens and new blocks), `BlockTables.apply_staged_writes`,
  `gather_batch_req_state` (the batch's order, `idx_mapping`, prefill state) and `prepare_inputs` (its numpy
  work: `query_start_loc`, the optimistic `seq_lens`; the `InputBatch`). Its token ids, positions and
  `seq_lens` are built by Triton kernels on the GPU (`prepare_prefill_inputs`, `prepare_pos_seq_lens`,
  `combine_sampled_and_draft_tokens`), not on the CPU as 0.33 built them;
- `sample_bookkeeping`: `sample_tokens`' CPU part (the prompt logprobs' checks, the `ModelRunnerOutput`, the
  KV connector's `post_forward`) and `AsyncOutput.get_output` (the sampled ids `.tolist()`, trimmed per
  request). The sampled tokens stay on the GPU (`postprocess_sampled`'s `post_update` kernel): no per-request
  CPU writes, as 0.33's `_bookkeeping_sync` made.

The step alternates: one step that admits a new request of P prompt tokens (max_tokens 1, so it also finishes
and frees its blocks) beside the R decodes, then one step of the R decodes alone. Each piece's seconds are fitted
as a + b * requests + c * tokens (tokens: scheduled this step; non-negative coefficients, least squares on the
relative error) over the grid R in 1..512 (14 sizes), P in {0, 256, 1024, 4096}. A piece's seconds are this
thread's CPU seconds (`time.thread_time`: other processes on a shared machine do not count), the median of
--reps steps per point.

Not timed here (no GPU): the attention metadata builders and CUDA-graph dispatch (the worker's per-step work
that needs CUDA; left out rather than guessed; for 0.34 also `prepare_attn`'s block-table gather and slot
mappings, Triton kernels, and the launches of its Triton kernels, about five a step, `Worker34`'s docstring),
and the engine core's
output thread (msgspec encoding of `EngineCoreOutputs`, another thread) and the front end's `OutputProcessor`
(another process): they run beside the step, not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def use_this_cpu() -> None:
    """vLLM before 0.33 finds no CPU platform in its GPU wheel (vllm/platforms/__init__.py, cpu_platform_plugin,
    asks for a CPU build or macOS), and its configs need one: this CPU's, as the parity suite's vLLM finds it."""
    import vllm

    from sim.config import vllm_release

    if (vllm_release(vllm.__version__) or (0, 0)) < (0, 33):
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform

        vllm.platforms._current_platform = CpuPlatform()


def new_model_runner() -> bool:
    """Whether the installed vLLM's GPU worker is the model runner of vllm/v1/worker/gpu/ (0.34 on, which
    removed V1's gpu_model_runner.py and gpu_input_batch.py): `Worker34` times it, `Worker` the one before."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_input_batch") is None


class Worker:
    """The worker's CPU side of a step (GPUModelRunner._update_states, _prepare_inputs, _bookkeeping_sync),
    on vLLM's own InputBatch in CPU memory."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_tokens: int, block_size: int):
        import numpy as np
        import torch
        from vllm.v1.worker.gpu_input_batch import InputBatch

        self.np, self.torch = np, torch
        import inspect

        args = dict(max_num_reqs=max_num_reqs, max_model_len=max_model_len, max_num_batched_tokens=max_tokens,
                    device=torch.device("cpu"), vocab_size=1 << 20, block_sizes=[block_size],
                    max_num_blocks_per_req=[max_model_len // block_size])
        accepted = inspect.signature(InputBatch.__init__).parameters
        if "max_num_blocks_per_req" not in accepted:  # vLLM 0.12's InputBatch: pinned memory and kernel block sizes
            args = {**{k: v for k, v in args.items() if k != "max_num_blocks_per_req"}, "pin_memory": False,
                    "kernel_block_sizes": [block_size]}
        self.batch = InputBatch(**args)
        # vLLM 0.12 computes the slot mapping on the CPU (BlockTable.compute_slot_mapping(req_indices, positions),
        # numpy); 0.33 launches a Triton kernel for it (num_reqs, query_start_loc, positions), on the GPU side.
        slots = inspect.signature(type(self.batch.block_table).compute_slot_mapping).parameters
        self.slot_mapping_on_cpu = "req_indices" in slots
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
        if self.slot_mapping_on_cpu:
            batch.block_table.compute_slot_mapping(req_indices, positions)
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
        required = {f.name for f in dataclasses.fields(ModelRunnerOutput)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        older = {k: v for k, v in (("logprobs", None), ("prompt_logprobs_dict", {}), ("pooler_output", []))
                 if k in required}  # vLLM 0.12's ModelRunnerOutput has no defaults for them
        return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index=dict(batch.req_id_to_index),
                                 sampled_token_ids=valid, **older)


class _NoKernel:
    """A Triton kernel's stand-in: launching it does nothing (its work runs on the GPU, in the GPU step's time)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class Worker34:
    """vLLM 0.34's model runner (vllm/v1/worker/gpu/model_runner.py: GPUModelRunner), its CPU side of a step,
    run by vLLM's own methods on a stand-in runner whose tensors are in CPU memory.

    Run as vLLM's code (the methods of GPUModelRunner, bound to this stand-in): `finish_requests`
    (`_remove_request`), `free_states`, `add_requests` (`RequestState.add_request`, `BlockTables.append_block_ids`,
    `Sampler.add_request`, `PromptLogprobsWorker.add_request`, `LoraState`, the staged writes applied),
    `update_requests`, `BlockTables.apply_staged_writes`, `gather_batch_req_state` and `prepare_inputs`, as
    `execute_model` calls them; after the forward, `sample_tokens`' CPU part (`compute_prompt_logprobs` and
    `compute_prompt_token_id_logprobs`' checks, the `ModelRunnerOutput`, the no-op KV connector's
    `post_forward`) and `AsyncOutput.get_output` (the sampled ids `.tolist()`, trimmed per request).

    Stood in for (they need CUDA): the Triton kernels (`_apply_write_kernel` of the staged writes,
    `prepare_prefill_inputs`, `prepare_pos_seq_lens`, `combine_sampled_and_draft_tokens`) launch nothing; a
    UVA buffer is its CPU tensor (on a GPU, `get_accelerator_view_from_cpu_tensor` gives the GPU's view of
    the same pinned memory, made once); `AsyncOutput.__init__`'s stream and event work is its CPU copies
    only. Not run: `dispatch_cg_and_sync_dp` (the CUDA-graph dispatch), `prepare_attn` and the model
    state's attention metadata builders, the sampler and `postprocess_sampled` (GPU kernels)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_tokens: int, block_size: int, vllm_config):
        import numpy as np
        import torch
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu import buffer_utils
        from vllm.v1.worker.gpu import model_runner as mr
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR
        from vllm.v1.worker.gpu.lora_utils import LoraState
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState
        from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler
        from vllm.v1.worker.gpu.states import RequestState

        class CpuUvaBuffer(buffer_utils.UvaBuffer):  # pinned memory and its GPU view need CUDA
            def __init__(self, size, dtype):
                self.cpu = torch.zeros(size, dtype=dtype, device="cpu")
                self.np = self.cpu.numpy()
                self._uva = self.cpu

        buffer_utils.UvaBuffer = CpuUvaBuffer
        buffer_utils.is_uva_available = lambda: True
        buffer_utils._apply_write_kernel = _NoKernel()
        logits_indices = torch.zeros(max_num_reqs, dtype=torch.int64)
        mr.prepare_prefill_inputs = lambda *args, **kwargs: None
        mr.prepare_pos_seq_lens = lambda *args, **kwargs: None
        mr.combine_sampled_and_draft_tokens = lambda *args, **kwargs: logits_indices[:args[-2]]

        cpu = torch.device("cpu")
        vocab = 1 << 20

        class Runner:
            _remove_request = mr.GPUModelRunner._remove_request
            finish_requests = mr.GPUModelRunner.finish_requests
            free_states = mr.GPUModelRunner.free_states
            update_pp_decode_requests = mr.GPUModelRunner.update_pp_decode_requests
            add_requests = mr.GPUModelRunner.add_requests
            update_requests = mr.GPUModelRunner.update_requests
            gather_batch_req_state = mr.GPUModelRunner.gather_batch_req_state
            prepare_inputs = mr.GPUModelRunner.prepare_inputs

        runner = Runner()
        runner.device = cpu
        runner.max_num_reqs = max_num_reqs
        runner.req_states = RequestState(max_num_reqs=max_num_reqs, max_model_len=max_model_len,
                                         max_num_batched_tokens=max_tokens, num_speculative_steps=0,
                                         vocab_size=vocab, device=cpu)
        runner.block_tables = BlockTables(block_sizes=[block_size], max_num_reqs=max_num_reqs,
                                          max_num_batched_tokens=max_tokens,
                                          max_num_blocks_per_group=[max_model_len // block_size], device=cpu)
        runner.input_buffers = InputBuffers(max_num_reqs=max_num_reqs, max_num_tokens=max_tokens, device=cpu)
        model_state = object.__new__(DefaultModelState)  # a text model: no M-RoPE, no prompt embeddings
        model_state.rope_state = None
        model_state.prompt_embeds_state = None
        runner.model_state = model_state
        drafts = object.__new__(DraftTokensHandler)  # its __init__ makes a CUDA stream and event
        drafts.device, drafts._copy_pending, drafts._draft_tokens_by_req, drafts._deferred_req_ids = cpu, False, {}, None
        runner.draft_tokens_handler = drafts
        runner.lora_state = LoraState(max_num_reqs=max_num_reqs)
        runner.sampler = Sampler(vllm_config=vllm_config, max_num_reqs=max_num_reqs, vocab_size=vocab, device=cpu,
                                 req_states=runner.req_states)
        runner.prompt_logprobs_worker = PromptLogprobsWorker(max_num_reqs, cpu)
        for name in ("adaptive_verification", "speculator", "pooling_runner", "encoder_cache", "pp_handler",
                     "kv_block_zeroer", "pcp_manager", "fast_prefill"):
            setattr(runner, name, None)
        runner.is_last_pp_rank = True
        runner.use_pp = False
        runner.decode_query_len = 1
        runner.model_config = vllm_config.model_config
        self.np, self.torch, self.mr = np, torch, mr
        self.runner = runner
        self.no_kv_connector = NO_OP_KV_CONNECTOR
        self.cg_none = CUDAGraphMode.NONE
        self.BatchExecutionDescriptor = BatchExecutionDescriptor
        self.input_batch = None
        self.out = None
        self.gpu_sampled = None

    def update_states(self, out) -> None:
        """`execute_model`'s request bookkeeping, in its order."""
        runner = self.runner
        runner.draft_tokens_handler.begin_step(out)
        runner.update_pp_decode_requests()
        runner.finish_requests(out)
        runner.free_states(out)
        runner.add_requests(out)
        runner.update_requests(out)
        runner.block_tables.apply_staged_writes()

    def prepare_inputs(self, out):
        """`execute_model`'s batch state and inputs (the CUDA-graph dispatch left out: an eager batch)."""
        runner = self.runner
        self.out = out
        with self.torch.inference_mode():
            batch_req_state, _uniform = runner.gather_batch_req_state(out, False)
            batch_desc = self.BatchExecutionDescriptor(cg_mode=self.cg_none, num_tokens=batch_req_state.num_tokens,
                                                       num_reqs=None)
            self.input_batch = runner.prepare_inputs(out, batch_req_state, batch_desc, 0)
        return self.input_batch

    def gpu_output(self, sampled_ids: list[int]) -> None:
        """The sampler's output on the GPU (not timed): a token per request, in batch order."""
        torch = self.torch
        self.gpu_sampled = (torch.tensor(sampled_ids, dtype=torch.int64).view(-1, 1),
                            torch.ones(len(sampled_ids), dtype=torch.int32))

    def bookkeeping(self, sampled_ids: list[int]):
        """`sample_tokens`' CPU part and `AsyncOutput.get_output`."""
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.gpu.async_utils import AsyncOutput, async_copy_to_np

        runner, input_batch = self.runner, self.input_batch
        sampled, num_sampled = self.gpu_sampled
        with self.torch.inference_mode():
            prompt_logprobs_dict = runner.prompt_logprobs_worker.compute_prompt_logprobs(
                None, None, input_batch, runner.req_states.all_token_ids.gpu,
                runner.req_states.num_computed_tokens.gpu, runner.req_states.prompt_len.np)
            prompt_token_id_logprobs_dict = runner.prompt_logprobs_worker.compute_prompt_token_id_logprobs(
                None, None, input_batch, runner.req_states.prompt_len.np)
            output = ModelRunnerOutput(req_ids=input_batch.req_ids, sampled_token_ids=None,
                                       prompt_logprobs_dict=prompt_logprobs_dict,
                                       prompt_token_id_logprobs_dict=prompt_token_id_logprobs_dict,
                                       cudagraph_stats=None)
            # AsyncOutput.__init__ without its CUDA stream and event: the device-to-host copies, on the CPU
            async_output = object.__new__(AsyncOutput)
            async_output.model_runner_output = output
            async_output.pending_aux_output = None
            async_output.copy_event = _NoEvent()
            async_output._has_fault = None
            async_output.sampled_token_ids = async_copy_to_np(sampled)
            async_output.logprobs_tensors = None
            async_output.num_nans = None
            async_output.num_sampled_tokens_np = async_copy_to_np(num_sampled)
            async_output.sampling_mask_tensors = None
            async_output.prompt_logprobs_dict = {
                k: v.to_cpu_nonblocking() if v is not None else None for k, v in output.prompt_logprobs_dict.items()}
            async_output.prompt_token_id_logprobs_dict = {
                k: v.to("cpu", non_blocking=True) for k, v in output.prompt_token_id_logprobs_dict.items()}
            output.kv_connector_output = self.no_kv_connector.post_forward(self.out.finished_req_ids)
            return async_output.get_output()


class _NoEvent:
    def synchronize(self) -> None:
        pass


def measure(num_running: int, prompts: list[int], reps: int) -> list[dict]:
    """Rows (piece, requests, tokens, seconds: the median of `reps` steps) for R running requests."""
    import inspect

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
    if new_model_runner():
        worker: Worker | Worker34 = Worker34(num_running + 1, setup.max_model_len, max_tokens, block_size,
                                             scheduler.vllm_config)
    else:
        worker = Worker(num_running + 1, setup.max_model_len, max_tokens, block_size)
    hasher = get_request_block_hasher(block_size, sha256)
    rng = np.random.default_rng(num_running)
    REQUEST_ARGS = inspect.signature(Request.__init__).parameters
    serial = itertools.count()

    def add(prompt: int, max_out: int) -> None:
        ids = rng.integers(1, 1 << 19, prompt).tolist()  # distinct prompts: no prefix hits
        params = SamplingParams(max_tokens=max_out, ignore_eos=True)
        older = {"eos_token_id": None} if "eos_token_id" in REQUEST_ARGS else {}  # vLLM 0.12's Request takes it
        scheduler.add_request(Request(f"{next(serial):08d}", ids, params, None, arrival_time=time.time(),
                                      block_hasher=hasher, **older))

    clock = time.thread_time  # this thread's CPU seconds: other processes on a shared machine do not count

    def step() -> tuple[int, int, dict[str, float]]:
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        worker.update_states(out)
        worker.prepare_inputs(out)
        t2 = clock()
        sampled = rng.integers(1, 1 << 19, len(out.num_scheduled_tokens)).tolist()  # the GPU's sampled tokens
        if isinstance(worker, Worker34):
            worker.gpu_output(sampled)
        t3 = clock()
        output = worker.bookkeeping(sampled)
        t4 = clock()
        scheduler.update_from_output(out, output)
        t5 = clock()
        if isinstance(worker, Worker34):  # the runner's batch is the scheduler's (not timed)
            batch = worker.input_batch
            assert batch.num_reqs == len(out.num_scheduled_tokens) == worker.runner.req_states.num_reqs
            assert int(batch.query_start_loc_np[batch.num_reqs]) == out.total_num_scheduled_tokens
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

    use_this_cpu()
    if new_model_runner():
        # Imported before the parity driver tells vLLM that Triton is there (tests/parity/vllm_driver.py:
        # allow_config_without_triton), so the runner's kernels are Triton's placeholders on this CPU.
        import vllm.v1.worker.gpu.model_runner  # noqa: F401
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
