"""The model runner: a `Batch` in, greedy next tokens and the step's measured time out.

Each step: flatten the batch into its seven arrays (vectorised numpy), copy them into persistent
buffers (pinned host memory and device tensors on a GPU, grown only when a step is larger than
any before), run embedding -> layers -> final norm -> LM head on the `logits_indices` rows only,
and take the argmax. On a GPU a decode-only step replays a captured CUDA graph instead.
Timing: CUDA events on a GPU (plus the host's preparation time), `time.perf_counter` on the
CPU; the parts add up to the step's seconds.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from backends.real.cuda_graphs import DecodeGraphs
from backends.real.model import Decoder
from backends.real.ops import Ops
from backends.real.reference import AttentionMetadata
from sim.batch import Batch, FlatBatch
from sim.tokens import TokenSpec


class StagedInputs:
    """Persistent host (pinned on a GPU) and device buffers, one per input array."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}

    def stage(self, name: str, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `array` into buffer `name` and on to the device (async on a GPU): into `out` when given,
        else into the buffer's own device tensor. Returns the device tensor of the array's shape."""
        size = array.size
        host = self._host.get(name)
        if host is None or host.numel() < size:
            capacity = max(size, 2 * (0 if host is None else host.numel()), 256)
            dtype = torch.from_numpy(array[:0]).dtype
            host = torch.empty(capacity, dtype=dtype, pin_memory=self.is_cuda)
            self._host[name] = host
            self._device[name] = torch.empty(capacity, dtype=dtype, device=self.device) if self.is_cuda else host
        host[:size].numpy()[:] = array.reshape(-1)
        if out is not None:
            out.copy_(host[:size].view(array.shape), non_blocking=True)
            return out
        dev = self._device[name][:size]
        if self.is_cuda:
            dev.copy_(host[:size], non_blocking=True)
        return dev.view(array.shape)


class ModelRunner:
    def __init__(self, model: Decoder, ops: Ops, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, token_spec: TokenSpec | None = None):
        self.model = model
        self.token_spec = token_spec  # synthesises the token ids of scheduler requests
        self.ops = ops
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.inputs = StagedInputs(device)
        self.is_cuda = device.type == "cuda"
        self.graphs: DecodeGraphs | None = None  # set by the backend once captured
        if self.is_cuda:
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            self._sampled_host = torch.empty(256, dtype=torch.int64, pin_memory=True)

    def stage(self, flat: FlatBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        s = self.inputs.stage
        # The block table is the largest input: start its copy first.
        block_table = s("block_table", flat.block_table)
        q_lens = np.diff(flat.query_start_loc)
        meta = AttentionMetadata(
            query_start_loc=s("query_start_loc", flat.query_start_loc), seq_lens=s("seq_lens", flat.seq_lens),
            block_table=block_table, slot_mapping=s("slot_mapping", flat.slot_mapping),
            max_query_len=int(q_lens.max(initial=0)), max_seq_len=int(flat.seq_lens.max(initial=0)),
            query_start_loc_np=flat.query_start_loc, seq_lens_np=flat.seq_lens)
        return s("input_ids", flat.input_ids), s("positions", flat.positions), meta, s("logits_indices",
                                                                                       flat.logits_indices)

    def logits(self, flat: FlatBatch) -> torch.Tensor:
        """[num_logits, vocab] fp32 for one flattened step, for the tests (`execute` runs the same stage,
        forward and LM head, timing each part, and samples)."""
        input_ids, positions, meta, logits_indices = self.stage(flat)
        hidden = self.model(self.ops, input_ids, positions, meta, self.kv_caches, logits_indices)
        return self.model.logits(hidden)

    def execute(self, batch: Batch) -> tuple[np.ndarray, dict[str, float]]:
        """Greedy next token per logits row, and seconds per part: prepare, forward, sample."""
        return self._execute_cuda(batch) if self.is_cuda else self._execute_cpu(batch)

    def _execute_cpu(self, batch: Batch) -> tuple[np.ndarray, dict[str, float]]:
        t0 = time.perf_counter()
        input_ids, positions, meta, logits_indices = self.stage(batch.flatten(self.block_size, self.token_spec))
        t1 = time.perf_counter()
        hidden = self.model(self.ops, input_ids, positions, meta, self.kv_caches, logits_indices)
        logits = self.model.logits(hidden)
        t2 = time.perf_counter()
        sampled = logits.argmax(dim=-1).numpy().copy()
        t3 = time.perf_counter()
        return sampled, {"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2}

    def _execute_cuda(self, batch: Batch) -> tuple[np.ndarray, dict[str, float]]:
        start, staged, forwarded, sampled_ev = self._events
        t0 = time.perf_counter()
        flat = batch.flatten(self.block_size, self.token_spec)
        size = self.graphs.size_for(flat) if self.graphs is not None else None
        host_s = time.perf_counter() - t0
        start.record()
        if size is not None:  # a decode-only step: replay its CUDA graph
            self.graphs.stage(flat, size, self.inputs.stage)
            staged.record()
            sampled = self.graphs.replay(size, len(flat.seq_lens))
        else:
            input_ids, positions, meta, logits_indices = self.stage(flat)
            staged.record()
            hidden = self.model(self.ops, input_ids, positions, meta, self.kv_caches, logits_indices)
            logits = self.model.logits(hidden)
        forwarded.record()
        if size is None:
            sampled = logits.argmax(dim=-1)
        n = sampled.shape[0]
        if self._sampled_host.numel() < n:
            self._sampled_host = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
        self._sampled_host[:n].copy_(sampled, non_blocking=True)
        sampled_ev.record()
        sampled_ev.synchronize()
        parts = {"prepare": host_s + start.elapsed_time(staged) / 1e3,
                 "forward": staged.elapsed_time(forwarded) / 1e3,  # a replayed graph includes the argmax
                 "sample": forwarded.elapsed_time(sampled_ev) / 1e3}
        return self._sampled_host[:n].numpy().copy(), parts
