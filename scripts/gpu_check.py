"""GPU check of the real backend: kernels correct in bf16, steps measured against their rooflines.

    python scripts/gpu_check.py                    # on a GPU: Llama-3.1-8B shapes, bf16 (< 5 min on an H200)
    python scripts/gpu_check.py --out bench/gpu_check_H200.md
    python scripts/gpu_check.py --dry-run          # on the CPU: the tiny preset, fp32, Triton interpreted

1. Every Triton kernel against its torch reference on the model's own shapes (max error, bf16).
2. Decode steps (batch 1..256 x context 512..8192): measured step time next to the memory
   roofline (weights read once + every request's KV over HBM bandwidth); target <= 1.5x.
3. The paged-attention kernel alone on those decode batches: achieved HBM bandwidth; target
   >= 60% for 64+ requests at 2k+ context.
4. Mixed steps (the decodes plus a prefill chunk filling a 2048-token budget) next to
   max(FLOPs / peak, bytes / bandwidth).
5. A 2048-token prefill step: achieved TFLOP/s; target >= 50% of dense bf16 peak.
6. Mixture of experts (Qwen3-30B-A3B's shapes: 128 experts, top-8, hidden 2048, expert
   intermediate 768; the tiny Qwen3-MoE with --dry-run): the grouped-GEMM Triton kernel and the
   whole MoE layer against the torch reference, the experts alone timed against
   max(FLOPs / peak, bytes of the experts hit / bandwidth), and whole steps of a model of
   --moe-layers such layers (decode batches and a prefill), CUDA graphs as for the dense model.

Batches whose KV does not fit in the cache are listed as skipped. Exit code 1 when a kernel is
wrong; missed performance targets are reported in the table, not as a failure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model preset (default: Llama-3.1-8B; tiny with --dry-run)")
    p.add_argument("--hardware", default=None,
                   help="hardware preset for the rooflines (default: from the GPU's name; H200 with --dry-run)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default: 1,8,32,64,128,256)")
    p.add_argument("--contexts", default=None, help="comma list (default: 512,2048,8192)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case, after two warm-ups (median)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (to compare)")
    p.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--moe-layers", type=int, default=4,
                   help="layers of the Qwen3-30B-A3B-shaped model whose steps are timed (default 4; 0 skips the "
                        "MoE step)")
    p.add_argument("--dry-run", action="store_true",
                   help="run everything on the CPU: tiny preset, fp32, Triton kernels interpreted; "
                        "checks the script, its numbers mean nothing")
    return p.parse_args(argv)


class Report:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # Triton reads this when a kernel is defined: set it before anything imports triton.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from backends.hardware import HARDWARE, resolve_hardware
    from backends.presets import get_model

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; use --dry-run on the CPU", file=sys.stderr)
        return 2
    model_name = args.model or ("tiny" if args.dry_run else "Llama-3.1-8B")
    hardware_name = args.hardware or ("H200" if args.dry_run else _detect_hardware(torch, HARDWARE))
    if hardware_name is None:
        print(f"gpu_check: cannot tell the hardware preset of {torch.cuda.get_device_name()}; pass --hardware "
              f"({', '.join(HARDWARE)})", file=sys.stderr)
        return 2
    hw = resolve_hardware(hardware_name)
    preset = get_model(model_name)
    batch_sizes = _ints(args.batch_sizes, "1,4" if args.dry_run else "1,8,32,64,128,256")
    contexts = _ints(args.contexts, "32,64" if args.dry_run else "512,2048,8192")
    budget = 64 if args.dry_run else 2048

    report = Report()
    where = "CPU (dry run: Triton interpreted, numbers mean nothing)" if args.dry_run else \
        torch.cuda.get_device_name()
    report(f"# gpu_check: {model_name} on {where}, torch {torch.__version__}")
    report(f"rooflines from the {hardware_name} preset: {hw.peak_bf16_flops / 1e12:.0f} TFLOP/s dense bf16, "
           f"{hw.memory_bandwidth / 1e12:.2f} TB/s HBM")
    report()
    started = time.perf_counter()
    ok = check_kernels(torch, preset, device, report)

    from backends.real import RealBackend

    backend = RealBackend(model_name, device=device, block_size=16, seed=0, max_num_batched_tokens=budget,
                          num_blocks=4096 if args.dry_run else None, cuda_graphs=not args.no_cuda_graphs)
    report(f"KV cache: {backend.num_blocks} blocks of 16 tokens ({backend.num_blocks * 16} tokens); "
           f"set up in {time.perf_counter() - started:.0f} s")
    graphs = backend.runner.graphs
    eager_reason = backend.cuda_graph_error or ("CPU" if args.dry_run else "--no-cuda-graphs")
    report("decode-only steps: " + (f"CUDA graphs (batch sizes {graphs.sizes[0]}..{graphs.sizes[-1]})" if graphs
                                    else f"eager ({eager_reason})"))
    if device == "cuda":
        report(f"device copy bandwidth (torch, 2 GiB): {_copy_bandwidth(torch) / 1e12:.2f} TB/s")
    report()
    bench = Bench(torch, backend, preset, hw, args.repeats)
    bench.decode_table(batch_sizes, contexts, report)
    bench.mixed_table(batch_sizes, contexts, budget, report)
    bench.prefill_line(budget, report)
    report()
    if args.moe_layers > 0:
        del bench, backend
        if device == "cuda":
            torch.cuda.empty_cache()
        ok = moe_check(torch, device, args, hw, budget, report) and ok
        report()
    report(f"kernels {'correct' if ok else 'WRONG'}; total {time.perf_counter() - started:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report.lines) + "\n")
    return 0 if ok else 1


def _ints(text: str | None, default: str) -> list[int]:
    return [int(x) for x in (text or default).split(",")]


def _detect_hardware(torch, presets: dict) -> str | None:
    name = torch.cuda.get_device_name()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return next(p for p in presets if p.startswith(key))
    return None


def _copy_bandwidth(torch) -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del x, y
    return 2 * (1 << 31) / seconds  # read + write


# 1. Kernels against references.

def check_kernels(torch, preset: dict, device: str, report: Report) -> bool:
    """Each Triton kernel on the model's shapes against its torch reference (computed in fp32 on the
    same inputs). bf16 outputs differ from fp32 by rounding: relative max error <= 2e-2 passes."""
    import numpy as np

    from backends.real import reference as ref
    from backends.real.kernels import elementwise, kv_write, paged_attention

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    nh, nkv, hd = preset["num_attention_heads"], preset["num_key_value_heads"], preset["head_dim"]
    h, inter = preset["hidden_size"], preset["intermediate_size"]
    gen = torch.Generator(device=device).manual_seed(0)
    rng = np.random.default_rng(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    rows = []

    def record(name, got, want, exact=False):
        got, want = got.float(), want.float()
        err = (got - want).abs().max().item()
        rel = err / max(want.abs().max().item(), 1e-30)
        passed = err == 0 if exact else rel <= tolerance
        rows.append((name, err, rel, passed))

    # Paged attention: decodes at long contexts, a fresh prefill, a later chunk; blocks scattered.
    block_size = 16
    small = device == "cpu"
    q_lens = np.array([1, 1, 37, 150, 1] if not small else [1, 1, 9, 20, 1])
    ctx_lens = np.array([511, 2047, 0, 700, 4000] if not small else [40, 70, 0, 30, 90])
    seq_lens = (q_lens + ctx_lens).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    per_req = -(-seq_lens // block_size)
    num_blocks = int(per_req.sum()) + 8
    perm = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), per_req.max()), dtype=np.int32)
    start = 0
    for r, k in enumerate(per_req):
        table[r, :k] = perm[start:start + k]
        start += k
    k_cache, v_cache = randn(num_blocks, block_size, nkv, hd), randn(num_blocks, block_size, nkv, hd)
    q = randn(int(qsl[-1]), nh, hd)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    meta = ref.AttentionMetadata(t(qsl), t(seq_lens), t(table), None, int(q_lens.max()), int(seq_lens.max()),
                                 qsl, seq_lens)
    scale = hd ** -0.5
    record("paged_attention (mixed batch)", paged_attention.paged_attention(q, k_cache, v_cache, meta, scale),
           ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale))
    two = np.arange(3, dtype=np.int32)  # the first two requests alone: a decode-only batch
    decode = ref.AttentionMetadata(t(two), t(seq_lens[:2]), t(table[:2]), None, 1, int(seq_lens[:2].max()), two,
                                   seq_lens[:2])
    want = ref.paged_attention(q[:2].float(), k_cache.float(), v_cache.float(), decode, scale)
    for splits in (1, 4):
        record(f"paged_attention (decodes, {splits} KV split{'s' if splits > 1 else ''})",
               paged_attention.paged_attention(q[:2], k_cache, v_cache, decode, scale, num_splits=splits), want)

    num_tokens = 64
    k_new, v_new = randn(num_tokens, nkv, hd), randn(num_tokens, nkv, hd)
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)).to(device)
    got_k, got_v, want_k, want_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    kv_write.write_kv(k_new, v_new, got_k, got_v, slots)
    ref.write_kv(k_new, v_new, want_k, want_v, slots)
    record("write_kv", torch.stack([got_k, got_v]), torch.stack([want_k, want_v]), exact=True)

    x, residual, w = randn(num_tokens, h), randn(num_tokens, h), randn(h)
    record("rms_norm", elementwise.rms_norm(x, w, 1e-5), ref.rms_norm(x.float(), w.float(), 1e-5))
    got, got_sum = elementwise.add_rms_norm(x, residual.clone(), w, 1e-5)
    want, want_sum = ref.add_rms_norm(x.float(), residual.float(), w.float(), 1e-5)
    record("add_rms_norm", torch.cat([got, got_sum]), torch.cat([want, want_sum]))
    qkv = randn(num_tokens, (nh + 2 * nkv) * hd)
    qq, kk, _ = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    qq, kk = qq.view(num_tokens, nh, hd), kk.view(num_tokens, nkv, hd)
    positions = torch.from_numpy(rng.integers(0, 8192, num_tokens)).to(device)
    cos_sin = ref.rope_cos_sin(8192, hd, preset["rope_theta"], device)
    norms = (randn(hd), randn(hd)) if preset["qk_norm"] else (None, None)
    got = elementwise.qk_norm_rope(qq, kk, positions, cos_sin, *norms, 1e-6)
    want = ref.qk_norm_rope(qq.float(), kk.float(), positions, cos_sin,
                            *(n.float() if n is not None else None for n in norms), 1e-6)
    record("qk_norm_rope" if preset["qk_norm"] else "rope", torch.cat([got[0], got[1]], 1),
           torch.cat([want[0], want[1]], 1))
    gate_up = randn(num_tokens, 2 * inter)
    record("silu_mul", elementwise.silu_mul(gate_up), ref.silu_mul(gate_up.float()))

    report(f"## kernels vs torch references ({str(dtype).replace('torch.', '')}, pass: relative max error "
           f"<= {tolerance:g})")
    report("| kernel | max abs error | relative | result |")
    report("|---|---:|---:|---|")
    for name, err, rel, passed in rows:
        report(f"| {name} | {err:.2e} | {rel:.2e} | {'pass' if passed else 'FAIL'} |")
    report()
    return all(r[3] for r in rows)


# 2-5. Step timings against rooflines.

class SyntheticTokens:
    """Token ids of a request that exists only for timing: position p holds p % vocab."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def token_ids(self, start: int, end: int):
        import numpy as np

        return np.arange(start, end, dtype=np.int64) % self.vocab_size


class Bench:
    def __init__(self, torch, backend, preset: dict, hw, repeats: int):
        from backends.model_config import ModelConfig

        config = ModelConfig.from_fields("preset", preset)

        self.torch, self.backend, self.preset, self.hw, self.repeats = torch, backend, preset, hw, repeats
        self.tokens = SyntheticTokens(preset["vocab_size"])
        self.block_size = backend.block_size
        self.capacity = backend.num_blocks * backend.block_size
        h, v = preset["hidden_size"], preset["vocab_size"]
        embedding = 0 if preset["tie_word_embeddings"] else v * h
        self.matmul_params = config.num_parameters - embedding  # every weight a step reads (LM head included)
        self.linear_params = self.matmul_params - v * h  # per-token matmuls, without the LM head
        self.kv_bytes_per_token = config.kv_bytes_per_token()
        self.bytes_per_param = 2

    def batch(self, decodes: int, context: int, chunk: int = 0, chunk_context: int = 0):
        """`decodes` requests at context `context` (after this step) and, optionally, one prefill chunk of
        `chunk` tokens after `chunk_context` cached ones; blocks laid out request after request."""
        from sim.batch import Batch

        b = Batch()
        next_block = 0
        per_decode = -(-context // self.block_size)
        for i in range(decodes):
            b.add(f"d{i}", context - 1, 1, list(range(next_block, next_block + per_decode)), True,
                  is_decode=True, token_source=self.tokens)
            next_block += per_decode
        if chunk:
            n = -(-(chunk_context + chunk) // self.block_size)
            b.add("p", chunk_context, chunk, list(range(next_block, next_block + n)), True, token_source=self.tokens)
        return b

    def fits(self, decodes: int, context: int, chunk: int = 0) -> bool:
        per_decode = -(-context // self.block_size) * self.block_size
        return decodes * per_decode + chunk + self.block_size <= self.capacity

    def time_step(self, batch) -> float:
        for _ in range(2):
            self.backend.execute(batch)
        return statistics.median(self.backend.execute(batch).seconds for _ in range(self.repeats))

    def time_attention(self, batch) -> float:
        """Seconds of the paged-attention kernel alone on one layer of the batch."""
        torch, be = self.torch, self.backend
        _, _, meta, _ = be.runner.stage(batch.flatten(self.block_size))
        p = self.preset
        q = torch.randn(len(batch), p["num_attention_heads"], p["head_dim"], device=be.device).to(be.dtype)
        k_cache, v_cache = be.kv_caches[0]
        scale = p["head_dim"] ** -0.5

        def call():
            be.ops.paged_attention(q, k_cache, v_cache, meta, scale)

        return _time_call(torch, be.device.type, call)

    def flops(self, q_lens: list[int], contexts: list[int], num_logits: int) -> float:
        p = self.preset
        attention = sum(4 * p["num_attention_heads"] * p["head_dim"] * (q * c - q * (q - 1) / 2)
                        for q, c in zip(q_lens, contexts)) * p["num_hidden_layers"]
        lm_head = 2 * num_logits * p["hidden_size"] * p["vocab_size"]
        return 2 * sum(q_lens) * self.linear_params + attention + lm_head

    def memory_floor(self, kv_tokens: int) -> float:
        return (self.matmul_params * self.bytes_per_param + kv_tokens * self.kv_bytes_per_token) / \
            self.hw.memory_bandwidth

    def decode_table(self, batch_sizes: list[int], contexts: list[int], report: Report) -> None:
        p = self.preset
        report("## decode steps: measured vs memory roofline (weights + KV over HBM bandwidth); "
               "target <= 1.5x. Attention kernel alone (one layer): HBM bandwidth; target >= 60% at 64+ "
               "requests, 2k+ context")
        report("| batch | context | step ms | roofline ms | x roofline | step target | attention us | "
               "attention TB/s | % of HBM | attention target |")
        report("|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
        for b in batch_sizes:
            for c in contexts:
                if not self.fits(b, c):
                    report(f"| {b} | {c} | skipped: {b * c} tokens of KV do not fit in the cache ({self.capacity}) "
                           "| | | | | | | |")
                    continue
                batch = self.batch(b, c)
                seconds = self.time_step(batch)
                floor = self.memory_floor(b * c)
                attn = self.time_attention(batch)
                # K and V of every context token of one layer, plus q and the output.
                attn_bytes = b * c * 2 * p["num_key_value_heads"] * p["head_dim"] * 2 \
                    + 2 * b * p["num_attention_heads"] * p["head_dim"] * 2
                bandwidth = attn_bytes / attn
                share = bandwidth / self.hw.memory_bandwidth
                attn_target = ("ok" if share >= 0.6 else "MISS") if b >= 64 and c >= 2048 else "-"
                report(f"| {b} | {c} | {seconds * 1e3:.3f} | {floor * 1e3:.3f} | {seconds / floor:.2f} | "
                       f"{'ok' if seconds <= 1.5 * floor else 'MISS'} | {attn * 1e6:.1f} | {bandwidth / 1e12:.2f} | "
                       f"{share:.0%} | {attn_target} |")
        report()

    def mixed_table(self, batch_sizes: list[int], contexts: list[int], budget: int, report: Report) -> None:
        cached = min(1024, budget)
        report(f"## mixed steps: the decodes plus a prefill chunk filling the {budget}-token budget (after {cached} "
               "cached tokens); roofline max(FLOPs / peak, bytes / bandwidth)")
        report("| batch | context | chunk | step ms | roofline ms | x roofline | TFLOP/s |")
        report("|---:|---:|---:|---:|---:|---:|---:|")
        for b in batch_sizes:
            chunk = budget - b
            for c in contexts:
                if chunk < 1 or not self.fits(b, c, cached + chunk):
                    report(f"| {b} | {c} | {max(chunk, 0)} | skipped | | | |")
                    continue
                seconds = self.time_step(self.batch(b, c, chunk, cached))
                flops = self.flops([1] * b + [chunk], [c] * b + [cached + chunk], b + 1)
                floor = max(flops / self.hw.peak_bf16_flops, self.memory_floor(b * c + cached + chunk))
                report(f"| {b} | {c} | {chunk} | {seconds * 1e3:.3f} | {floor * 1e3:.3f} | {seconds / floor:.2f} | "
                       f"{flops / seconds / 1e12:.0f} |")
        report()

    def prefill_line(self, budget: int, report: Report) -> None:
        report(f"## a {budget}-token prefill step (one new request); target >= 50% of dense bf16 peak")
        report("| tokens | step ms | roofline ms | TFLOP/s | % of peak | target |")
        report("|---:|---:|---:|---:|---:|---|")
        if not self.fits(0, 1, budget):
            report(f"| {budget} | skipped: the cache holds {self.capacity} tokens | | | | |")
            return
        seconds = self.time_step(self.batch(0, 1, budget, 0))
        flops = self.flops([budget], [budget], 1)
        floor = max(flops / self.hw.peak_bf16_flops, self.memory_floor(budget))
        share = flops / seconds / self.hw.peak_bf16_flops
        report(f"| {budget} | {seconds * 1e3:.3f} | {floor * 1e3:.3f} | {flops / seconds / 1e12:.0f} | {share:.0%} | "
               f"{'ok' if share >= 0.5 else 'MISS'} |")


# 6. Mixture of experts.

def moe_config(dry_run: bool, layers: int):
    """Qwen3-30B-A3B's shapes (its config.json) with `layers` layers; the tiny Qwen3-MoE on a dry run."""
    from backends.real.moe import MoeModelConfig, tiny_moe

    if dry_run:
        return tiny_moe("qwen3_moe")
    return MoeModelConfig(name=f"Qwen3-30B-A3B shapes, {layers} layers", hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, qk_norm=True, architecture="Qwen3MoeForCausalLM",
                          model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True)


def moe_check(torch, device: str, args, hw, budget: int, report: Report) -> bool:
    """The grouped GEMM and the MoE layer against the torch reference, the experts timed, and whole steps."""
    from backends.real import moe
    from backends.real import reference as ref
    from backends.real.kernels import elementwise
    from backends.real.kernels.grouped_gemm import grouped_gemm
    from backends.real.ops import triton_ops

    ops = triton_ops()
    cfg = moe_config(args.dry_run, args.moe_layers)
    spec = moe.moe_spec(cfg)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    e, k, h, i = spec.num_experts, spec.top_k, cfg.hidden_size, spec.intermediate_size
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    router, w13, w2 = randn(e, h, scale=h ** -0.5), randn(e, 2 * i, h, scale=h ** -0.5), randn(e, h, i, scale=i ** -0.5)
    token_counts = [1, 16, 64] if args.dry_run else [1, 64, 256, 2048, 8192]
    report(f"## MoE: {e} experts, top-{k}, hidden {h}, expert intermediate {i} ({str(dtype).replace('torch.', '')})")
    report(f"kernels vs the torch reference (fp32 on the same inputs), pass: relative max error <= {tolerance:g}; "
           "experts alone (route + grouped GEMMs + combine) vs max(FLOPs / peak, bytes of the experts hit / "
           "bandwidth)")
    report("| tokens | experts hit | grouped GEMM rel. error | MoE layer rel. error | result | experts us | "
           "roofline us | x roofline |")
    report("|---:|---:|---:|---:|---|---:|---:|---:|")
    ok = True
    for t in token_counts:
        x = randn(t, h)
        weights, ids = moe.route(x, router, spec)
        rows = moe.SortedRows(ids, e)
        a = x[rows.token_of_row]
        got = grouped_gemm(a, w13, rows).float()
        want = moe.torch_grouped_gemm(a.float(), w13.float(), rows)
        gemm_rel = ((got - want).abs().max() / want.abs().max()).item()
        got = moe.experts(x, w13, w2, weights, ids, grouped_gemm, elementwise.silu_mul).float()
        want = moe.experts(x.float(), w13.float(), w2.float(), weights, ids, moe.torch_grouped_gemm, ref.silu_mul)
        layer_rel = ((got - want).abs().max() / want.abs().max()).item()
        passed = gemm_rel <= tolerance and layer_rel <= tolerance
        ok = ok and passed
        hit = int((rows.counts > 0).sum())

        def call():
            moe.moe_forward(ops, x, router, w13, w2, spec)

        seconds = _time_call(torch, device, call)
        flops = 2 * t * k * 3 * h * i + 2 * t * e * h
        floor = max(flops / hw.peak_bf16_flops, (hit * 3 * h * i + e * h) * 2 / hw.memory_bandwidth)
        report(f"| {t} | {hit} | {gemm_rel:.2e} | {layer_rel:.2e} | {'pass' if passed else 'FAIL'} | "
               f"{seconds * 1e6:.1f} | {floor * 1e6:.1f} | {seconds / floor:.2f} |")
    report()

    from backends.real import RealBackend

    started = time.perf_counter()
    backend = RealBackend(cfg, device=device, block_size=16, seed=0, max_num_batched_tokens=budget, max_num_seqs=64,
                          num_blocks=512 if args.dry_run else 8192, cuda_graphs=not args.no_cuda_graphs)
    graphs = backend.runner.graphs
    report(f"### whole steps of {cfg.name} ({cfg.num_hidden_layers} layers), set up in "
           f"{time.perf_counter() - started:.0f} s; decode-only steps: "
           + (f"CUDA graphs (batch sizes {graphs.sizes[0]}..{graphs.sizes[-1]})" if graphs
              else f"eager ({backend.cuda_graph_error or ('CPU' if args.dry_run else '--no-cuda-graphs')})"))
    report("| step | tokens | step ms | ms per layer |")
    report("|---|---:|---:|---:|")
    from sim.batch import Batch

    tokens = SyntheticTokens(cfg.vocab_size)
    context = 64 if args.dry_run else 1024
    per_req = -(-context // 16)
    for name, decodes, chunk in (("decode", 1, 0), ("decode", 64, 0), ("prefill", 0, budget)):
        b = Batch()
        for r in range(decodes):
            b.add(f"d{r}", context - 1, 1, list(range(r * per_req, (r + 1) * per_req)), True, is_decode=True,
                  token_source=tokens)
        if chunk:
            b.add("p", 0, chunk, list(range(-(-chunk // 16))), True, token_source=tokens)
        for _ in range(2):
            backend.execute(b)
        seconds = statistics.median(backend.execute(b).seconds for _ in range(args.repeats))
        label = f"{name} of {decodes} at context {context}" if decodes else f"{name} of {chunk} tokens"
        report(f"| {label} | {decodes + chunk} | {seconds * 1e3:.3f} | "
               f"{seconds * 1e3 / cfg.num_hidden_layers:.3f} |")
    report(f"MoE kernels {'correct' if ok else 'WRONG'}")
    return ok


def _time_call(torch, device: str, call) -> float:
    """Seconds of one call: the mean of 10 after two warm-ups on a GPU (CUDA events), one on the CPU."""
    for _ in range(2):
        call()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / 10
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
