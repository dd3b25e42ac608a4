"""Decode-only steps replayed from CUDA graphs, as vLLM and gpt-fast do.

A decode step of a large model at small batch launches a few hundred kernels that each run for
microseconds; launched one by one from Python, the launches, not the GPU, set the step time.
Each padded batch size is captured once (embedding -> layers -> LM head -> argmax) on static
input buffers; a step copies its arrays into them and replays the graph.

Padding rows are decodes of a scratch token: position 0, context 1, written to and read from a
scratch block past the block manager's ids, so they touch no request's KV.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.real.model import Decoder
from backends.real.ops import Ops
from backends.real.reference import AttentionMetadata
from sim.batch import FlatBatch

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in SIZES if s < max_batch]
    return sizes + [max_batch]


def graph_size_for(flat: FlatBatch, sizes: list[int], max_blocks: int) -> int | None:
    """The captured size that runs this step, or None: not decode-only (every request one token and a
    logits row), more requests than the largest graph, or a block table wider than the static one."""
    n = len(flat.seq_lens)
    if (n == 0 or n > sizes[-1] or len(flat.input_ids) != n or len(flat.logits_indices) != n
            or flat.block_table.shape[1] > max_blocks):
        return None
    return next(s for s in sizes if s >= n)


def padded_decode_inputs(flat: FlatBatch, size: int, scratch_block: int, block_size: int) -> dict[str, np.ndarray]:
    """A decode-only step's arrays padded to `size` requests (rows past the real ones decode a scratch
    token in the scratch block)."""
    n = len(flat.seq_lens)
    width = flat.block_table.shape[1]

    def pad(values, fill, dtype):
        out = np.full(size, fill, dtype=dtype)
        out[:n] = values
        return out

    block_table = np.full((size, width), scratch_block, dtype=np.int32)
    block_table[:n] = flat.block_table
    return {
        "input_ids": pad(flat.input_ids, 0, np.int64),
        "positions": pad(flat.positions, 0, np.int64),
        "slot_mapping": pad(flat.slot_mapping, scratch_block * block_size, np.int64),
        "seq_lens": pad(flat.seq_lens, 1, np.int32),
        "block_table": block_table,
    }


class DecodeGraphs:
    def __init__(self, model: Decoder, ops: Ops, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, max_batch: int, scratch_block: int):
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = graph_sizes(max_batch)
        size = self.sizes[-1]
        cfg = model.cfg
        self.max_blocks = -(-cfg.max_position_embeddings // block_size)

        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        # Static inputs, read by every graph (a graph of b requests reads the first b rows).
        self.inputs = {
            "input_ids": full((size,), 0, torch.int64),
            "positions": full((size,), 0, torch.int64),
            "slot_mapping": full((size,), scratch_block * block_size, torch.int64),
            "seq_lens": full((size,), 1, torch.int32),
            "block_table": full((size, self.max_blocks), scratch_block, torch.int32),
        }
        query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        logits_indices = torch.arange(size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sampled: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
            s = self.inputs
            meta = AttentionMetadata(
                query_start_loc=query_start_loc[:b + 1], seq_lens=s["seq_lens"][:b],
                block_table=s["block_table"][:b], slot_mapping=s["slot_mapping"][:b], max_query_len=1,
                max_seq_len=cfg.max_position_embeddings,  # fixes the split-KV count for any context
                query_start_loc_np=np.arange(b + 1, dtype=np.int32), seq_lens_np=np.ones(b, dtype=np.int32))

            def step(b=b, meta=meta):
                hidden = model(ops, s["input_ids"][:b], s["positions"][:b], meta, kv_caches, logits_indices[:b])
                return model.logits(hidden).argmax(dim=-1)

            step()  # compiles and initialises outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.sampled[b] = step()
            self.graphs[b] = graph
        torch.cuda.synchronize(device)

    def size_for(self, flat: FlatBatch) -> int | None:
        return graph_size_for(flat, self.sizes, self.max_blocks)

    def stage(self, flat: FlatBatch, size: int, stage) -> None:
        """Copy the step's arrays, padded to `size`, into the static inputs with `stage(name, array, out)`."""
        for name, array in padded_decode_inputs(flat, size, self.scratch_block, self.block_size).items():
            dst = self.inputs[name][:size]
            if name == "block_table":
                dst = dst[:, :array.shape[1]]
            stage(name, array, dst)

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """Run the captured step; the sampled tokens of the real requests, [num_reqs] on the device."""
        self.graphs[size].replay()
        return self.sampled[size][:num_reqs]
