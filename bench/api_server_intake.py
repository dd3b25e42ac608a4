"""What vLLM does to take one request in, measured with vLLM's own code, by prompt length.

    VLLM_TARGET_DEVICE=cpu .venv-parity/bin/python bench/api_server_intake.py [--tokens 128,512,...]

`sim validate` and `--api-server` price the API server's share of a request's TTFT as
`ClientOverhead` (backends/costmodel/optables/profile.py): a fixed part and a cost per prompt token.
This script times, for a completions request of P prompt tokens (a text prompt, as `vllm bench serve`
sends its random prompts), the steps vLLM 0.33 runs between the HTTP body and the scheduler's
waiting queue (vllm/entrypoints/openai/completion/serving.py `create_completion`, vllm/v1/engine/
async_llm.py `add_request`, vllm/v1/engine/core.py `preprocess_add_request`), each with vLLM's own
classes in one process:

| piece | vLLM code run |
|-------|---------------|
| `render` | `Renderer.render_cmpl`: the prompt's tokenization (the model's fast tokenizer) and its checks |
| `process_inputs` | `InputProcessor.process_inputs` and `assign_request_id`: the `EngineCoreRequest` |
| `output_processor` | `OutputProcessor.add_request`: the request's detokenizer and output state |
| `to_engine_core` | `MsgpackEncoder.encode` in the API server, `MsgpackDecoder.decode` in the engine core |
| `engine_request` | `Request.from_engine_core_request` without prefix caching |
| `block_hashes` | what prefix caching adds: the block hashes (sha256 a 16-token block), said apart |

The tokenizer: this machine has no real model's, so a byte-level BPE of 32,000 tokens is trained here
on the Python library's sources (bench/api_server_stream.py `stand_in_tokenizer`), and a prompt is the
text of P random token ids, re-encoded (about P tokens). Not timed: the HTTP server's parsing of the
body (uvicorn, FastAPI, pydantic's `CompletionRequest`), the ZMQ sockets' copies, and the asyncio
hand-offs between these steps. The engine core's two pieces run in its busy loop between steps.

Each piece is the median of 30 runs a length (`time.perf_counter`), and a line fixed + per token is fitted
to each (least squares on relative error, non-negative); the reference loop beside them carries the
figures to another CPU (docs/async-scheduling.md, "Carried to a serving host").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIECES = ("render", "process_inputs", "output_processor", "to_engine_core", "engine_request", "block_hashes")


def vllm_pieces(folder: str):
    """vLLM's intake objects for a one-layer Llama of the stand-in tokenizer's vocabulary in `folder`."""
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor

    LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1 << 16,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    model = ModelConfig(model=folder, tokenizer=folder, dtype="bfloat16", seed=0, max_model_len=32768)
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768,
                                is_encoder_decoder=False, enable_chunked_prefill=True)
    config = VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=CacheConfig(block_size=16))
    processor = InputProcessor(config)
    outputs = OutputProcessor(processor.renderer.get_tokenizer(), log_stats=True)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)  # vLLM's default, sha256
    init_none_hash(hash_fn)
    return processor, outputs, get_request_block_hasher(16, hash_fn)


def one_request(processor, outputs, hasher, text: str, index: int) -> dict[str, float]:
    """Seconds of each piece for one completions request of `text`."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import RequestOutputCollector
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    out = {}
    t = time.perf_counter()
    (engine_input,) = processor.renderer.render_cmpl([{"prompt": text}])
    out["render"] = time.perf_counter() - t
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    t = time.perf_counter()
    request = processor.process_inputs(f"r{index}", engine_input, params, ("generate",))
    processor.assign_request_id(request)  # (AsyncLLM.add_request's next call)
    out["process_inputs"] = time.perf_counter() - t
    t = time.perf_counter()
    outputs.add_request(request, text, None, 0, RequestOutputCollector(RequestOutputKind.DELTA, f"r{index}"))
    out["output_processor"] = time.perf_counter() - t
    t = time.perf_counter()
    frames = MsgpackEncoder().encode(request)
    received = MsgpackDecoder(EngineCoreRequest).decode(frames)
    out["to_engine_core"] = time.perf_counter() - t
    t = time.perf_counter()
    Request.from_engine_core_request(received, None)
    out["engine_request"] = time.perf_counter() - t
    t = time.perf_counter()
    Request.from_engine_core_request(received, hasher)
    out["block_hashes"] = max(time.perf_counter() - t - out["engine_request"], 0.0)
    outputs.request_states.pop(request.request_id, None)
    return out


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """fixed + per_token x tokens, least squares on relative error, both >= 0 (a negative one
    dropped and the other refitted alone)."""
    import numpy as np

    p = np.array([float(t) for t, _ in points])
    y = np.array([s for _, s in points])
    x = np.stack([np.ones_like(p), p], axis=1) / y[:, None]
    fixed, per_token = np.linalg.lstsq(x, np.ones_like(y), rcond=None)[0]
    if fixed < 0:
        fixed, per_token = 0.0, float(np.sum(x[:, 1]) / np.sum(x[:, 1] ** 2))
    elif per_token < 0:
        fixed, per_token = float(np.sum(x[:, 0]) / np.sum(x[:, 0] ** 2)), 0.0
    return float(fixed), float(per_token)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,512,1024,2048,4096,8192", help="prompt tokens, comma-separated")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    from api_server_stream import stand_in_tokenizer, vllm_on_this_cpu

    banner = vllm_on_this_cpu()
    from tests.parity.vllm_driver import allow_config_without_triton

    allow_config_without_triton()
    folder = tempfile.mkdtemp(prefix="servesim-intake-")
    tokenizer = stand_in_tokenizer()
    tokenizer.save_pretrained(folder)
    processor, outputs, hasher = vllm_pieces(folder)
    rng = random.Random(0)
    print(banner)
    print(f"{'tokens':>7} " + " ".join(f"{p:>16}" for p in PIECES) + f"   (us, median of {args.runs})")
    medians: dict[str, list[tuple[int, float]]] = {p: [] for p in PIECES}
    index = 0
    for n in (int(x) for x in args.tokens.split(",")):
        text = tokenizer.decode([rng.randrange(256, 32000) for _ in range(n)])
        tokens = len(tokenizer(text).input_ids)
        runs = []
        for _ in range(args.runs + 3):
            runs.append(one_request(processor, outputs, hasher, text, index))
            index += 1
        runs = runs[3:]  # (the first runs warm caches up)
        row = {p: statistics.median(r[p] for r in runs) for p in PIECES}
        for p in PIECES:
            medians[p].append((tokens, row[p]))
        print(f"{tokens:7d} " + " ".join(f"{row[p] * 1e6:16.0f}" for p in PIECES), flush=True)
    print("fitted: fixed + per token (us)")
    total_fixed = total_per_token = 0.0
    for p in PIECES:
        fixed, per_token = fit_line(medians[p])
        if p != "block_hashes":
            total_fixed, total_per_token = total_fixed + fixed, total_per_token + per_token
        print(f"  {p:>16}: {fixed * 1e6:8.1f} + {per_token * 1e6:6.3f} x tokens")
    print(f"  {'intake':>16}: {total_fixed * 1e6:8.1f} + {total_per_token * 1e6:6.3f} x tokens  "
          "(every piece but block_hashes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
