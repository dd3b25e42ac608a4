"""Step time as the sum of measured operator times (curves from backends/costmodel/optables/derive.py).

A step of t tokens (q tokens per request, contexts c after the step) costs, summed over layers:

- GEMMs: QKV, O, gate-up, down at m = t padded to vLLM's CUDA-graph size (a step of at most the
  largest capture size runs a captured graph of the next size up: the deployment's sizes,
  `sim.config.cuda_graph_sizes` from vllm/config/vllm.py, _set_cudagraph_sizes: [1, 2, 4] +
  range(8, 256, 8) + range(256, 513, 16) for vLLM's default max_num_seqs of 1024 on H100/H200, up to
  min(2 x max_num_seqs, 512) for fewer; `set_cuda_graph_sizes`);
- attention, one FlashAttention varlen call per layer for the whole batch
  (vllm/v1/attention/backends/flash_attn.py, FlashAttentionImpl.forward):
  * the decodes (q = 1): the generation table at (number of decodes, their mean KV length). Decode
    attention is memory-bound, time ~ batch x length, so the mean is exact where the table is
    linear; scripts/optables_loo.py measures the error of this choice on the table itself;
  * the prefill chunks (q > 1) on top of c - q cached tokens: the context table (measured without
    a cached prefix) at the same number of sequences and the *equivalent* prompt length, the isl
    whose causal query-key pairs isl (isl + 1) / 2 equal the chunks' mean pairs
    q (c - q) + q (q + 1) / 2; and at least the generation table's time to read their mean
    context's K/V (a short chunk on a long prefix is memory-bound like a decode);
  * a step with both pays the call's fixed floor once (the smallest measured decode call);
- all-reduces under TP: two per layer and one after the vocab-parallel embedding, each of
  m x hidden x 2 bytes (vLLM's RowParallelLinear and VocabParallelEmbedding), the graph kernel
  for steps inside a CUDA graph and the eager one past it, up to 8 MiB; larger messages at the
  NVLink bandwidth (a ring moves 2 (n - 1) / n of the message per GPU); the logits' all-gather
  (LogitsProcessor) as an all-reduce of half its bytes (a ring all-reduce is a reduce-scatter
  and an all-gather);
- the LM head: a bf16 GEMM at m = the logits rows;
- elementwise kernels, each the table's kernel floor plus its bytes over the table's achieved HBM
  bandwidth: per layer two fused add+RMSNorm, RoPE, the KV-cache write, SiLU-and-mul (Qwen3's
  q/k norms, and under
  fp8 the attention output's quantization; the other activation quantizations are fused into
  the norms and SiLU by vLLM's compilation passes); per step the embedding gather, the final
  norm and the sampler (by the requests' sampling parameters and the vLLM version: greedy's
  fp32 cast and argmax as three passes over the fp32 logits, vLLM 0.12's top-p sort far more;
  backends/sampler.py);
- a fixed per-step overhead (`StepOverhead`; where its value comes from is stated there).

Every function takes numpy arrays and works element by element, so a run of decode-only steps
is costed in one call with exactly the values single steps get (the engine's fast-forward relies on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.costmodel.optables.derive import GEMM_OPS, per_gpu_heads
from backends.costmodel.optables.interp import Curve, Grid
from backends.sampler import PricesSampler, sampler_seconds
from sim.config import cuda_graph_sizes
from sim.errors import ServesimError

# vLLM's default capture sizes on an H100 or H200 (max_num_seqs 1024): up to 512 tokens
CUDA_GRAPH_SIZES = np.array(cuda_graph_sizes(1024), dtype=np.int64)
MAX_TABLE = 1 << 18  # token and logits counts past this are costed without the tables
RUN_CHUNK = 512  # decode steps per cached stretch of a batch size's step times (see decode_run_values)
MAX_RUN_CHUNKS = 2048  # cached stretches at most (16 MiB); the cache starts afresh past it
MAX_FIRST_CHUNKS = 1 << 16  # first chunks' attention kept by length (see _first_chunk_attention)
QUANTIZED_BYTES = {"fp8": 1.0, "fp4": 0.5 + 1.0 / 16}  # bytes per quantized activation (nvfp4: 16-element blocks)


@dataclass(frozen=True)
class StepOverhead:
    """Time per step that no operator table measures: the engine core's CPU work between forward
    passes (schedule, prepare inputs, update states) while the GPU waits."""

    seconds: float
    source: str

    def __post_init__(self) -> None:
        if not (np.isfinite(self.seconds) and self.seconds >= 0):
            raise ServesimError(f"the per-step overhead must be >= 0 s, got {self.seconds}")


def graph_sizes_array(sizes) -> np.ndarray:
    """CUDA-graph capture sizes (`sim.config.cuda_graph_sizes`) as the sorted int64 array the operator-table
    models pad with; refused unless whole numbers of tokens from 1."""
    array = np.asarray(sorted(sizes), dtype=np.int64)
    if not len(array) or array[0] < 1:
        raise ServesimError(f"CUDA-graph sizes must be whole numbers of tokens from 1, got {array.tolist()}")
    return array


def padded_tokens(t, sizes: np.ndarray = CUDA_GRAPH_SIZES):
    """Tokens a step's dense layers run on: the next CUDA-graph size up (`sizes`, ascending) for t up
    to the largest, else t."""
    t = np.asarray(t, dtype=np.int64)
    i = np.minimum(np.searchsorted(sizes, t, side="left"), len(sizes) - 1)
    return np.where(t <= sizes[-1], sizes[i], t)


class OperatorModel(PricesSampler):
    """Seconds per part of a step, from one model's derived operator curves."""

    def __init__(self, derived: dict, model: dict, tp: int, dtype: str, kv_cache_dtype: str,
                 overhead: StepOverhead):
        self.model, self.tp, self.dtype, self.kv_cache_dtype = model, tp, dtype, kv_cache_dtype
        self.overhead = overhead
        self.layers = model["num_hidden_layers"]
        self.heads, self.kv_heads = per_gpu_heads(model, tp)
        self._gemms = {op: Curve(v["m"], v["seconds"]) for op, v in derived["gemm"].items()}
        self.vocab_per_gpu = derived["gemm"]["lm_head"]["n"]
        ctx, gen = derived["attention"]["context"], derived["attention"]["generation"]
        self._ctx = Grid(ctx["batch"], ctx["isl"], ctx["seconds"], power_b=2.0)
        self._gen = Grid(gen["batch"], gen["kv_len"], gen["seconds"])
        self.attention_floor_s = float(self._gen.grid[0, 0])
        ar = derived["allreduce"]
        self._allreduce = None if ar is None else {
            mode: Curve(ar[mode]["message_bytes"], ar[mode]["seconds"]) for mode in ("graph", "eager") if mode in ar}
        self._nccl = None if ar is None or "nccl" not in ar else Curve(ar["nccl"]["message_bytes"], ar["nccl"]["seconds"])
        # No NCCL rows for these GPUs: a ring over the link, never faster than NCCL's among the most GPUs
        # measured, its bytes scaled (derive.py, ring_scaled)
        below = None if ar is None else ar.get("nccl_floor")
        self._nccl_floor = None if below is None else Curve(below["message_bytes"], below["seconds"])
        # FlashInfer's fused all-reduce (and RMSNorm) of the hidden states up to `max_bytes`, where the
        # deployment turns it on (derive.py, derive_allreduce).
        fused = None if ar is None else ar.get("fused")
        self._fused = None if fused is None else Curve(fused["message_bytes"], fused["seconds"])
        self._fused_max_bytes = 0.0 if fused is None else float(fused["max_bytes"])
        self._ring_latency_s = 0.0 if ar is None else float(ar.get("ring_latency_s", 0.0))
        if ar is not None:
            self._table_max_bytes = float(ar["table_max_bytes"]) if self._allreduce else 0.0
            # A ring all-reduce moves 2 (n - 1) / n of the message through each GPU's link.
            link = ar.get("link_bytes_per_s", ar.get("nvlink_bytes_per_s"))
            self._nvlink_s_per_byte = 2.0 * (tp - 1) / tp / link
        if (ar is None) != (tp == 1):
            raise ServesimError(f"the derived curves are for {1 if ar is None else ar['num_gpus']} GPU(s), not --tp {tp}")
        mem = derived["memory"]
        self.bandwidth = mem["bandwidth_bytes_per_s"]
        self.kernel_floor_s = mem["kernel_floor_s"]
        self._layer_bytes_per_token, self._layer_kernels = self._elementwise_per_layer()
        self.extrapolated = 0  # operator lookups past a table's grid (scaled by work), counted
        # Tables of dense_parts' pieces, grown on use: arrays (an entry None where a part is absent) and lists.
        self._by_tokens: tuple[Any, ...] = ((),)
        self._by_logits: tuple[Any, ...] = ((),)
        self._by_tokens_list: tuple[Any, ...] = ((),)
        self._by_logits_list: tuple[Any, ...] = ((),)
        self._run_chunks: dict[tuple[int, int, int], tuple] = {}  # see decode_run_values
        self._run_seen: set[tuple[int, int, int]] = set()  # stretches asked for once
        self._first_chunks: dict[int, float] = {}  # see _first_chunk_attention
        self.graph_sizes = CUDA_GRAPH_SIZES  # vLLM's defaults on an H100 or H200 (set_cuda_graph_sizes)

    def set_cuda_graph_sizes(self, sizes) -> None:
        """The deployment's CUDA-graph capture sizes (`sim.config.cuda_graph_sizes`): a step of at most the
        largest is padded to the next size up and runs its all-reduces as graph kernels; the token-count
        tables and decode runs priced with other sizes are dropped."""
        sizes = graph_sizes_array(sizes)
        if np.array_equal(sizes, self.graph_sizes):
            return
        self.graph_sizes = sizes
        self._by_tokens = ((),)
        self._by_tokens_list = ((),)
        self._run_chunks.clear()
        self._run_seen.clear()

    def _forget_sampler(self) -> None:
        """Drop the tables and runs priced with another sampler (`PricesSampler`)."""
        self._by_logits = ((),)
        self._by_logits_list = ((),)
        self._run_chunks.clear()
        self._run_seen.clear()

    # Operators. Every argument may be an array; results have its shape.

    def _lookup(self, curve: Curve, x):
        t, scaled = curve.many(x)
        self.extrapolated += int(np.count_nonzero(scaled))
        return t

    def gemms(self, m):
        """One layer's QKV, O, gate-up and down GEMMs at m tokens."""
        total = 0.0
        for op in GEMM_OPS:
            total = total + self._lookup(self._gemms[op], m)
        return total

    def max_gemm_tokens_per_s(self, max_tokens: int) -> float:
        """The most tokens per second the tables' GEMMs allow a step of at most `max_tokens` tokens:
        max over the measured m <= max_tokens of m / (all layers' QKV, O, gate-up and down at m).
        Every step pays at least that for its tokens (attention, all-reduces, the LM head and the
        rest come on top), so a deployment that prefilled faster ran faster than its kernels."""
        grid = self._gemms[GEMM_OPS[0]].xs
        m = grid[grid <= max(max_tokens, grid[0])]
        return float(np.max(m / (self.layers * np.asarray(self.gemms(m)))))

    def lm_head(self, num_logits):
        n = np.asarray(num_logits, dtype=np.float64)
        return np.where(n > 0, self._lookup(self._gemms["lm_head"], np.maximum(n, 1.0)), 0.0)

    def allreduce(self, message_bytes, graph):
        """One all-reduce: the table's custom all-reduce up to 8 MiB (see backends/costmodel/optables/derive.py); past
        it the NVLink ring time, never less than the table's at 8 MiB (vLLM leaves the custom
        kernel there for faster ones, not slower)."""
        size = np.asarray(message_bytes, dtype=np.float64)
        if self._allreduce is None:
            return np.zeros_like(size)
        if not self._allreduce:  # no custom all-reduce (PCIe past two GPUs, or no table): NCCL throughout
            return self._large_allreduce(np.maximum(size, 1.0))
        custom = np.minimum(size, self._table_max_bytes)
        table = np.where(graph, self._lookup(self._allreduce["graph"], custom),
                         self._lookup(self._allreduce["eager"], custom))
        if self._nccl is None and not self._ring_latency_s:  # the link's ring past the table (profiles before NCCL)
            return np.where(size > self._table_max_bytes, np.maximum(table, size * self._nvlink_s_per_byte), table)
        return np.where(size > self._table_max_bytes, np.maximum(table, self._large_allreduce(size)), table)

    def hidden_allreduce(self, message_bytes, graph):
        """One all-reduce of the hidden states (after attention's O projection and after the MLP):
        `allreduce`, or FlashInfer's fused all-reduce up to its size where the deployment turns it on."""
        table = self.allreduce(message_bytes, graph)
        if self._fused is None:
            return table
        size = np.asarray(message_bytes, dtype=np.float64)
        return np.where(size <= self._fused_max_bytes, self._lookup(self._fused, np.maximum(size, 1.0)), table)

    def _large_allreduce(self, size):
        """NCCL's all-reduce: its table where the system has one, else a ring over the stated link."""
        if self._nccl is not None:
            return self._lookup(self._nccl, size)
        ring = size * self._nvlink_s_per_byte + self._ring_latency_s
        return ring if self._nccl_floor is None else np.maximum(ring, self._nccl_floor.many(size)[0])  # (a bound)

    def decode_attention(self, num_decodes, mean_kv_len):
        """One layer's attention of `num_decodes` decodes at a mean KV length (0 decodes: 0)."""
        b = np.asarray(num_decodes, dtype=np.float64)
        t, scaled = self._gen.many(np.maximum(b, 1.0), mean_kv_len)
        self.extrapolated += int(np.count_nonzero(scaled & (b > 0)))
        return np.where(b > 0, t, 0.0)

    def prefill_attention(self, num_chunks: int, sum_pairs: float, sum_context: int) -> float:
        """One layer's attention of `num_chunks` (> 0) prefill chunks, q new tokens each on c tokens
        of context after the step, whose causal query-key pairs q (c - q) + q (q + 1) / 2 sum to
        `sum_pairs` and whose contexts sum to `sum_context` (scalar lookups)."""
        pairs = sum_pairs / num_chunks
        isl = (math.sqrt(8.0 * pairs + 1.0) - 1.0) / 2.0  # correctly rounded, as numpy's sqrt
        t, scaled = self._ctx.at(num_chunks, isl)
        read, scaled_read = self._gen.at(num_chunks, sum_context / num_chunks)  # `decode_attention`
        self.extrapolated += scaled + scaled_read
        return max(t, read)

    def _elementwise_per_layer(self) -> tuple[float, int]:
        """Bytes per token and number of kernels of one layer's elementwise work."""
        m, b = self.model, 2  # activations are bf16
        h, hd, i = m["hidden_size"], m["head_dim"], m["intermediate_size"] // self.tp
        kv_bytes = 1 if self.kv_cache_dtype == "fp8" else 2
        per_token = (2 * 4 * h * b  # two fused add+RMSNorm: read x and residual, write both
                     + 2 * (self.heads + self.kv_heads) * hd * b  # RoPE on q and k, read and write
                     + 2 * self.kv_heads * hd * (b + kv_bytes)  # K and V into the paged cache
                     + 3 * i * b)  # SiLU-and-mul: read gate and up, write
        kernels = 5
        if m.get("qk_norm"):  # Qwen3: an RMSNorm on every query and key head, read and write
            per_token += 2 * (self.heads + self.kv_heads) * hd * b
            kernels += 1
        if self.dtype in QUANTIZED_BYTES:
            # The attention output's quantization (fp8: one byte; nvfp4: half a byte and an fp8 scale per 16).
            per_token += self.heads * hd * (b + QUANTIZED_BYTES[self.dtype])
            kernels += 1
        return per_token, kernels

    def token_parts(self, num_tokens) -> tuple:
        """The parts of a step that depend on its token count alone (arrays): all layers' GEMMs,
        the all-reduces of the hidden states, and the elementwise kernels but the sampler."""
        t = np.asarray(num_tokens, dtype=np.int64)
        m = padded_tokens(t, self.graph_sizes).astype(np.float64)
        graph = t <= self.graph_sizes[-1]
        h = self.model["hidden_size"]
        allreduce = (2 * self.layers + 1) * self.hidden_allreduce(m * h * 2, graph)
        floor, bw = self.kernel_floor_s, self.bandwidth
        layers = self.layers * (self._layer_kernels * floor + m * self._layer_bytes_per_token / bw)
        if self._fused is not None:  # FlashInfer's fused all-reduce does a layer's two add+RMSNorms too
            norms = 2 * (floor + m * 4 * h * 2 / bw)
            layers = layers - self.layers * np.where(m * h * 2 <= self._fused_max_bytes, norms, 0.0)
        embed_and_norm = 2 * floor + m * (2 * h * 2 + 4 * h * 2) / bw
        return self.layers * self.gemms(m), allreduce, layers + embed_and_norm

    def logits_parts(self, num_logits) -> tuple:
        """The parts of a step that depend on its logits rows alone (arrays): the LM head, the
        logits' all-gather (None without TP) and the sampler."""
        n = np.asarray(num_logits, dtype=np.float64)
        floor, bw = self.kernel_floor_s, self.bandwidth
        gather = None
        if self._allreduce is not None:
            logits_bytes = n * self.vocab_per_gpu * self.tp * 2
            gather = np.where(logits_bytes > 0, self.allreduce(np.maximum(logits_bytes / 2, 1.0), False), 0.0)
        sampler = sampler_seconds(self.sampling, self.sampler_version, n, self.vocab_per_gpu * self.tp, floor, bw)
        return self.lm_head(n), gather, sampler

    # Steps.

    def dense_parts(self, num_tokens, num_logits) -> dict:
        """Everything of a step but attention and the overhead, per step (arrays broadcast)."""
        gemm, allreduce, elementwise = self.token_parts(num_tokens)
        lm_head, gather, sampler = self.logits_parts(num_logits)
        if gather is not None:
            allreduce = allreduce + gather
        return {"gemm": gemm, "lm_head": lm_head, "allreduce": allreduce, "elementwise": elementwise + sampler}

    def attention(self, decode_attention, prefill_attention=0.0):
        """All layers' attention from one layer's decode and prefill parts (a single call pays its
        floor once)."""
        both = np.minimum(np.minimum(decode_attention, prefill_attention), self.attention_floor_s)
        shared = np.where((np.asarray(decode_attention) > 0) & (np.asarray(prefill_attention) > 0), both, 0.0)
        return self.layers * (decode_attention + prefill_attention - shared)

    def _tables(self, num_tokens: int, num_logits: int) -> None:
        """Grow the tables of `token_parts` (by token count) and `logits_parts` (by logits rows) to
        cover these counts: each entry is computed once, element by element as `dense_parts` does."""
        if num_tokens >= len(self._by_tokens[0]):
            size = 1 << max(12, int(num_tokens).bit_length())
            self._by_tokens = tuple(np.asarray(a, dtype=np.float64) for a in self.token_parts(np.arange(size)))
            self._by_tokens_list = tuple(a.tolist() for a in self._by_tokens)
        if num_logits >= len(self._by_logits[0]):
            size = 1 << max(10, int(num_logits).bit_length())
            parts = self.logits_parts(np.arange(size))
            self._by_logits = tuple(None if a is None else np.asarray(a, dtype=np.float64) for a in parts)
            self._by_logits_list = tuple(None if a is None else a.tolist() for a in self._by_logits)

    def dense_parts_at(self, num_tokens: int, num_logits: int) -> dict:
        """`dense_parts` of one step, as floats, from the tables (exactly the same values)."""
        if num_tokens >= len(self._by_tokens[0]) or num_logits >= len(self._by_logits[0]):
            if num_tokens >= MAX_TABLE or num_logits >= MAX_TABLE:  # a rare giant step: no table
                return {k: float(v[0]) for k, v in self.dense_parts(np.array([num_tokens]),
                                                                     np.array([num_logits])).items()}
            self._tables(num_tokens, num_logits)
        gemm, allreduce, elementwise = self._by_tokens_list
        lm_head, gather, sampler = self._by_logits_list
        ar = allreduce[num_tokens] if gather is None else allreduce[num_tokens] + gather[num_logits]
        return {"gemm": gemm[num_tokens], "lm_head": lm_head[num_logits], "allreduce": ar,
                "elementwise": elementwise[num_tokens] + sampler[num_logits]}

    def step_parts(self, q: list[int], c: list[int], num_logits: int) -> dict:
        """Seconds per part of one step: q tokens per request, c their contexts after the step.
        Scalar lookups, exactly the values `decode_steps` gives the same step."""
        return self.batch_step(q, [ci - qi for qi, ci in zip(q, c)], num_logits)[1]

    def batch_step(self, q: list[int], computed: list[int], num_logits: int) -> tuple[float, dict]:
        """The seconds (`total`) and parts (`step_parts`) of one step from a batch's own lists: q
        tokens per request and the tokens each had computed before the step (its context after it
        is computed + q). The lookups need sums over the decodes (q = 1) and over the prefill
        chunks (q > 1): taken with list methods where the step has at most one chunk (most steps),
        else in one pass. A lone chunk with nothing computed before it is priced once per length
        (`_first_chunk_attention`)."""
        num_tokens = sum(q)
        parts = self.dense_parts_at(num_tokens, num_logits)
        num_requests, num_decodes = len(q), q.count(1)
        prefill = 0.0
        if num_decodes == num_requests:
            sum_decodes = sum(computed) + num_decodes  # their contexts after the step
        elif num_requests - num_decodes == 1 and (chunk := num_tokens - num_decodes) > 1:
            before = computed[q.index(chunk)]
            sum_decodes = sum(computed) - before + num_decodes
            prefill = self._one_chunk_attention(chunk, before)
        else:
            # Requests with q = 0 (none from the engine) are neither; the pairs are added in order, as sum() would.
            sum_decodes = num_chunks = sum_context = 0
            sum_pairs = 0.0  # (0.0 + x is x, as 0 + x is)
            for qi, before in zip(q, computed):
                if qi == 1:
                    sum_decodes += before + 1
                elif qi > 1:
                    num_chunks += 1
                    sum_pairs += qi * before + qi * (qi + 1) / 2
                    sum_context += before + qi
            if num_chunks:
                prefill = self.prefill_attention(num_chunks, sum_pairs, sum_context)
        return self._finish_step(parts, num_decodes, sum_decodes, prefill)

    def _finish_step(self, parts: dict, num_decodes: int, sum_decodes: int, prefill: float) -> tuple[float, dict]:
        """A step's seconds and parts from its dense parts, its decodes (their number and their
        contexts' sum after the step) and its prefill chunks' attention."""
        decode = 0.0
        if num_decodes:  # `decode_attention` of the step, as a scalar lookup
            decode, scaled = self._gen.at(num_decodes, sum_decodes / num_decodes)
            self.extrapolated += scaled
        shared = min(decode, prefill, self.attention_floor_s) if decode > 0 and prefill > 0 else 0.0
        parts["attention"] = attention = self.layers * (decode + prefill - shared)
        parts["overhead"] = overhead = float(self.overhead.seconds)
        seconds = parts["gemm"] + parts["lm_head"] + parts["allreduce"] + parts["elementwise"] + attention + overhead
        return seconds, parts  # seconds: `total`'s sum, in its order

    def chunk_steps(self, num_decodes: int, sum_decodes: int, chunk: int, before: int,
                    num_steps: int) -> tuple[list[float], dict[str, list[float]]]:
        """Seconds and parts of `num_steps` steps of `num_decodes` decodes and one partial prefill
        chunk of `chunk` (> 1) tokens each: at step j the decodes' contexts after the step sum to
        `sum_decodes + num_decodes * j`, and the chunk's request had `before + chunk * j` tokens
        computed before it. Exactly the values `batch_step` gives each of these steps."""
        num_tokens = num_decodes + chunk
        seconds: list[float] = []
        columns: dict[str, list[float]] = {}
        for j in range(num_steps):
            prefill = self._one_chunk_attention(chunk, before + chunk * j)
            s, parts = self._finish_step(self.dense_parts_at(num_tokens, num_decodes), num_decodes,
                                         sum_decodes + num_decodes * j, prefill)
            seconds.append(s)
            for key, value in parts.items():
                column = columns.get(key)
                if column is None:
                    columns[key] = [value]
                else:
                    column.append(value)
        return seconds, columns

    def _one_chunk_attention(self, chunk: int, before: int) -> float:
        """`prefill_attention` of a step's only chunk, of `chunk` tokens on `before` computed ones."""
        if before:
            return self.prefill_attention(1, chunk * before + chunk * (chunk + 1) / 2, before + chunk)
        prefill = self._first_chunks.get(chunk)
        return self._first_chunk_attention(chunk) if prefill is None else prefill

    def _first_chunk_attention(self, chunk: int) -> float:
        """`prefill_attention` of a step's only chunk when nothing of its request is computed (a
        prompt's first chunk, no cached prefix): kept by its length, as most of a conversation
        trace's steps with one chunk have such a chunk of a length seen before, unless a lookup was
        off the grid (those are counted at every step)."""
        extrapolated = self.extrapolated
        seconds = self.prefill_attention(1, chunk * (chunk + 1) / 2, chunk)
        if self.extrapolated == extrapolated:
            if len(self._first_chunks) >= MAX_FIRST_CHUNKS:
                self._first_chunks.clear()
            self._first_chunks[chunk] = seconds
        return seconds

    def decode_steps(self, num_decodes, sum_context) -> dict:
        """Parts of decode-only steps (arrays, one entry per step): num_decodes requests, each with
        q = 1, whose contexts after the step sum to sum_context."""
        n = np.asarray(num_decodes, dtype=np.int64)
        largest = int(n.max(initial=0))
        if largest >= MAX_TABLE:
            parts = self.dense_parts(n, n)
        else:  # from the tables: exactly the values of dense_parts
            self._tables(largest, largest)
            gemm, allreduce, elementwise = self._by_tokens
            lm_head, gather, sampler = self._by_logits
            parts = {"gemm": gemm[n], "lm_head": lm_head[n],
                     "allreduce": allreduce[n] if gather is None else allreduce[n] + gather[n],
                     "elementwise": elementwise[n] + sampler[n]}
        mean = np.asarray(sum_context, dtype=np.float64) / np.maximum(n, 1)
        if n.ndim == 1 and len(n) and n.min() > 0:
            # Runs of steps with the same number of requests (a decode run's requests only leave),
            # each bracketed once: exactly decode_attention's values.
            starts = [0, *(np.flatnonzero(np.diff(n)) + 1).tolist(), len(n)]
            t, scaled = self._gen.along_b_pieces(n[starts[:-1]].astype(np.float64).tolist(), np.diff(starts), mean)
            self.extrapolated += int(np.count_nonzero(scaled))
            parts["attention"] = self.layers * t  # `attention` of decodes alone: nothing is shared
            parts["overhead"] = self.overhead.seconds
            return parts
        parts["attention"] = self.attention(self.decode_attention(n, mean))
        parts["overhead"] = self.overhead.seconds
        return parts

    def decode_pieces(self, num_decodes: list[int], lengths: list[int], sums: list[int]) -> tuple[np.ndarray, dict]:
        """Seconds and parts of decode-only steps in stretches: num_decodes[k] (> 0) requests for the
        next lengths[k] steps, whose contexts after step j sum to sums[k] + num_decodes[k] * j (j
        counted from the first step of all). Exactly `total(decode_steps(...))` and `decode_steps`'
        values (from `decode_run_values`)."""
        num_steps = sum(lengths)
        largest = max(num_decodes)
        if largest >= MAX_TABLE or min(num_decodes) <= 0 or max(sums) + largest * num_steps >= 1 << 52:
            reps = np.asarray(lengths, dtype=np.int64)
            n_of_step = np.repeat(np.asarray(num_decodes, dtype=np.int64), reps)
            sum_c = np.repeat(np.asarray(sums, dtype=np.int64), reps) + n_of_step * np.arange(num_steps, dtype=np.int64)
            parts = self.decode_steps(n_of_step, sum_c)
            return self.total(parts), parts
        # The usual case first: each stretch within one cached chunk, read as decode_run_values would.
        chunks, attention, seconds, dense, scaled = self._run_chunks, [], [], [], []
        step = 0
        for n, length, first_sum in zip(num_decodes, lengths, sums):
            r = first_sum % n
            q = (first_sum - r) // n + step
            c = q // RUN_CHUNK
            lo = q - c * RUN_CHUNK
            chunk = chunks.get((n, r, c)) if lo + length <= RUN_CHUNK else None
            if chunk is None:
                break
            attention.append(chunk[0][lo:lo + length])
            seconds.append(chunk[1][lo:lo + length])
            if chunk[2] is not None:
                scaled.append(chunk[2][lo:lo + length])
            parts = self.dense_parts_at(n, n)
            dense.append((parts["gemm"], parts["lm_head"], parts["allreduce"], parts["elementwise"]))
            step += length
        else:
            for mask in scaled:
                self.extrapolated += int(np.count_nonzero(mask))
            return self._pieces(dense, lengths, attention, seconds)
        # A stretch over two chunks, or one not cached: through decode_run_values.
        if not self._pieces_cached(num_decodes, lengths, sums):
            return self._decode_pieces_arrays(num_decodes, lengths, sums)
        attention, seconds, dense = [], [], []
        step = 0
        for n, length, first_sum in zip(num_decodes, lengths, sums):
            parts = self.decode_run_values(n, first_sum, step, step + length, attention, seconds)
            dense.append((parts["gemm"], parts["lm_head"], parts["allreduce"], parts["elementwise"]))
            step += length
        return self._pieces(dense, lengths, attention, seconds)

    def _pieces(self, dense: list[tuple], lengths: list[int], attention: list, seconds: list) -> tuple[np.ndarray, dict]:
        """A run's seconds and parts from its stretches: each one's dense parts (gemm, lm_head,
        allreduce, elementwise) repeated along its steps, and its attention and seconds arrays."""
        rows = np.repeat(np.array(dense, dtype=np.float64).T, lengths, axis=1)
        parts = {"gemm": rows[0], "lm_head": rows[1], "allreduce": rows[2], "elementwise": rows[3],
                 "attention": np.concatenate(attention), "overhead": self.overhead.seconds}
        return np.concatenate(seconds), parts

    def _pieces_cached(self, num_decodes: list[int], lengths: list[int], sums: list[int]) -> bool:
        """Whether every stretch's steps are in cached stretches (see decode_run_values). Stretches
        asked for before are cached now unless one of the run's was never asked for (then the run
        is costed with the array lookups, and its new stretches are noted as asked for)."""
        chunks, seen = self._run_chunks, self._run_seen
        missing: list[tuple[int, int, int]] = []
        new: list[tuple[int, int, int]] = []
        step = 0
        for n, length, first_sum in zip(num_decodes, lengths, sums):
            r = first_sum % n
            q = (first_sum - r) // n + step
            for c in range(q // RUN_CHUNK, (q + length - 1) // RUN_CHUNK + 1):
                key = (n, r, c)
                if key not in chunks:
                    (missing if key in seen else new).append(key)
            step += length
        if new:
            if len(seen) >= 8 * MAX_RUN_CHUNKS:
                seen.clear()
            seen.update(new)
            return False
        for key in missing:
            self._run_chunk(key, self.dense_parts_at(key[0], key[0]))
        return chunks is self._run_chunks  # (a full cache starts afresh: another dict)

    def _decode_pieces_arrays(self, num_decodes: list[int], lengths: list[int], sums: list[int]) -> tuple[np.ndarray, dict]:
        """decode_pieces with the array lookups over the whole run at once (stretches not cached)."""
        num_steps = sum(lengths)
        largest = max(num_decodes)
        self._tables(largest, largest)
        gemm, allreduce, elementwise = self._by_tokens_list
        lm_head, gather, sampler = self._by_logits_list
        g = [gemm[k] for k in num_decodes]
        lm = [lm_head[k] for k in num_decodes]
        ar = [allreduce[k] for k in num_decodes] if gather is None else [allreduce[k] + gather[k] for k in num_decodes]
        el = [elementwise[k] + sampler[k] for k in num_decodes]
        dense = [((gi + li) + ai) + ei for gi, li, ai, ei in zip(g, lm, ar, el)]  # total's order, as floats
        # One row per stretch's value, repeated along its steps (integers below 2**52 are exact).
        rows = np.repeat(np.array([g, lm, ar, el, dense, num_decodes, sums], dtype=np.float64), lengths, axis=1)
        n = rows[5]
        mean = (rows[6] + n * np.arange(num_steps, dtype=np.float64)) / n  # decode_steps' sum_context / n
        t, scaled = self._gen.along_b_pieces([float(k) for k in num_decodes], lengths, mean)
        self.extrapolated += int(np.count_nonzero(scaled))
        attention = self.layers * t  # `attention` of decodes alone: nothing is shared
        overhead = self.overhead.seconds
        parts = {"gemm": rows[0], "lm_head": rows[1], "allreduce": rows[2], "elementwise": rows[3],
                 "attention": attention, "overhead": overhead}
        return (rows[4] + attention) + overhead, parts

    def decode_run_of(self, num_decodes: int, first_sum: int, num_steps: int) -> tuple[np.ndarray, dict]:
        """Seconds and parts of `num_steps` decode-only steps of the same `num_decodes` requests whose
        contexts after step j sum to first_sum + num_decodes * j: exactly
        `total(decode_steps_of(...))` and its parts (the parts that depend on the number of requests
        alone as floats)."""
        if num_decodes >= MAX_TABLE or num_decodes <= 0 or first_sum + num_decodes * num_steps >= 1 << 52:
            parts = self.decode_steps_of(num_decodes, first_sum + num_decodes * np.arange(num_steps, dtype=np.int64))
            return self.total(parts), parts
        attention: list[np.ndarray] = []
        seconds: list[np.ndarray] = []
        parts = self.decode_run_values(num_decodes, first_sum, 0, num_steps, attention, seconds)
        parts["attention"] = attention[0] if len(attention) == 1 else np.concatenate(attention)
        parts["overhead"] = self.overhead.seconds
        return (seconds[0] if len(seconds) == 1 else np.concatenate(seconds)), parts

    def decode_run_values(self, n: int, first_sum: int, start: int, end: int, attention: list, seconds: list) -> dict:
        """Decode-only steps start..end-1 of n requests whose contexts after step j sum to
        first_sum + n j: appends their attention and seconds (read-only arrays) to the lists and
        returns the dense parts (floats, `dense_parts_at`).

        Each step's values depend on n and its sum s alone, elementwise (`decode_steps`), and a
        run's sums step by n: s = r + n q with r = first_sum mod n fixed and q one more each step.
        So they are computed for RUN_CHUNK consecutive q at a time with the array lookups (the same
        operations on the same numbers as `decode_steps`: mean s / n, `along_b`, layers x, the
        parts' sum in `total`'s order) and kept once a stretch is asked for a second time (the
        first time only the steps asked for are computed), and later runs of the same n and r read
        them."""
        dense = self.dense_parts_at(n, n)
        r = first_sum % n
        q, q_end = (first_sum - r) // n + start, (first_sum - r) // n + end
        chunks = self._run_chunks
        while q < q_end:
            c = q // RUN_CHUNK
            lo = q - c * RUN_CHUNK
            hi = min(q_end - c * RUN_CHUNK, RUN_CHUNK)
            key = (n, r, c)
            chunk = chunks.get(key)
            if chunk is None:
                if key in self._run_seen:  # asked for a second time: worth keeping
                    chunk = self._run_chunk(key, dense)
                else:  # the first time: only the steps asked for
                    if len(self._run_seen) >= 8 * MAX_RUN_CHUNKS:
                        self._run_seen.clear()
                    self._run_seen.add(key)
                    chunk = self._run_values(n, r, q, q + hi - lo, dense)
                    lo, hi = 0, hi - lo
            attention.append(chunk[0][lo:hi])
            seconds.append(chunk[1][lo:hi])
            if chunk[2] is not None:
                self.extrapolated += int(np.count_nonzero(chunk[2][lo:hi]))
            q = (c + 1) * RUN_CHUNK
        return dense

    def _run_chunk(self, key: tuple[int, int, int], dense: dict) -> tuple:
        if len(self._run_chunks) >= MAX_RUN_CHUNKS:
            self._run_chunks = {}
        n, r, c = key
        chunk = self._run_values(n, r, c * RUN_CHUNK, (c + 1) * RUN_CHUNK, dense)
        chunk[0].flags.writeable = chunk[1].flags.writeable = False
        self._run_chunks[key] = chunk
        return chunk

    def _run_values(self, n: int, r: int, q0: int, q1: int, dense: dict) -> tuple:
        """(attention, seconds, scaled mask or None) of the decode steps of n requests whose
        contexts sum to r + n q, for q in q0..q1-1."""
        q = np.arange(q0, q1, dtype=np.float64)
        mean = (r + n * q) / n  # decode_steps' sum_context / n (sums below 2**52 are exact)
        t, scaled = self._gen.along_b(float(n), mean)
        attention = self.layers * t  # `attention` of decodes alone: nothing is shared
        seconds = ((((dense["gemm"] + dense["lm_head"]) + dense["allreduce"]) + dense["elementwise"]) + attention) \
            + self.overhead.seconds  # total's order
        return attention, seconds, scaled if scaled.any() else None

    def decode_steps_of(self, num_decodes: int, sum_context) -> dict:
        """`decode_steps` of steps that all have the same `num_decodes` requests: the parts that
        depend on it alone are floats, attention an array (exactly decode_steps' values)."""
        parts = self.dense_parts_at(num_decodes, num_decodes)
        mean = np.asarray(sum_context, dtype=np.float64) / num_decodes
        t, scaled = self._gen.along_b(float(num_decodes), mean)
        self.extrapolated += int(np.count_nonzero(scaled))
        parts["attention"] = self.layers * t  # `attention` of decodes alone: nothing is shared
        parts["overhead"] = self.overhead.seconds
        return parts

    def total(self, parts: dict):
        """The step's seconds: its parts in a fixed order."""
        return (parts["gemm"] + parts["lm_head"] + parts["allreduce"] + parts["elementwise"] + parts["attention"]
                + parts["overhead"])
