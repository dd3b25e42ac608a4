"""The API server's work for each streamed token, measured with vLLM's own output path.

    VLLM_TARGET_DEVICE=cpu .venv-parity/bin/python bench/api_server_stream.py [--requests 1,8,32,128,512]

vLLM's API server is one asyncio process. Besides taking requests in (what `sim validate` and `--api-server`
price: 1 ms plus 2 us a prompt token, `ClientOverhead`), it turns every engine step's outputs into the
streamed chunks: `AsyncLLM`'s output handler gives each step's `EngineCoreOutput`s to the `OutputProcessor`
(vllm/v1/engine/output_processor.py, `process_outputs`: the incremental detokenizer, the request's
`RequestOutputCollector`), and each request's coroutine wakes, builds its `CompletionStreamResponse` and dumps
it to JSON (vllm/entrypoints/openai/completion/serving.py, `completion_stream_generator`). This script runs
those with vLLM's own classes for R running requests streaming one token a step, in one asyncio loop as the
server does (one task a request awaiting its collector), and prints the wall time per step (median of 200)
and per request, beside this CPU's reference loop. The detokenizer needs a tokenizer and this machine has
none of a real model's: a byte-level BPE of 32,000 tokens is trained here on the Python library's sources
(`tokenizers`, a few seconds), so a token's text is as long as a real tokenizer's. Not measured: the
socket write of each chunk (uvicorn) and the client's reading of it.

On this project's 2-core machine (2026-12-07, vLLM 0.33, reference loop 0.11 s): 20, 13, 13, 13 and
14 us a request a step for 1, 8, 32, 128 and 512 running requests. At 64 running requests and 10 ms steps
that is 0.8 ms of every 10 (8% of the API server's time), so a request arriving then waits little for it;
servesim's API server takes requests in and leaves the streaming out (docs/calibration-and-validation.md,
"Which TTFT").
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stand_in_tokenizer():
    """A byte-level BPE trained on this Python's library sources, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=32000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


async def one_run(tokenizer, num_running: int, steps: int) -> list[float]:
    """Wall seconds per step for `num_running` streaming requests, each a task awaiting its collector."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats

    rng = random.Random(0)
    processor = OutputProcessor(tokenizer, log_stats=True)
    collectors = []
    for i in range(num_running):
        params = SamplingParams(max_tokens=10**6, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        request = EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=[rng.randrange(1000, 30000) for _ in range(64)],
                                    mm_features=None, sampling_params=params, pooling_params=None,
                                    arrival_time=time.time(), lora_request=None, cache_salt=None,
                                    data_parallel_rank=None, external_req_id=f"r{i}")
        collector = RequestOutputCollector(RequestOutputKind.DELTA, f"r{i}")
        processor.add_request(request, None, None, 0, collector)
        collectors.append(collector)
    done = asyncio.Queue()

    async def stream(i: int, collector) -> None:  # serving.py's generator, one chunk a step
        while True:
            out = await collector.get()
            chunk = CompletionStreamResponse(id=f"cmpl-r{i}", object="text_completion", created=0, model="m", choices=[
                CompletionResponseStreamChoice(index=0, text=out.outputs[0].text, logprobs=None, finish_reason=None,
                                               stop_reason=None)])
            f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            done.put_nowait(i)

    tasks = [asyncio.create_task(stream(i, c)) for i, c in enumerate(collectors)]
    seconds = []
    for _ in range(steps):
        outputs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[rng.randrange(1000, 30000)])
                   for i in range(num_running)]
        t0 = time.perf_counter()
        processor.process_outputs(outputs, time.monotonic(), IterationStats())
        for _ in range(num_running):
            await done.get()
        seconds.append(time.perf_counter() - t0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return seconds


def vllm_on_this_cpu() -> str:
    """Sets up vLLM for the CPU (quietly) and returns the line that heads a bench's figures: the vLLM
    version and this CPU's reference loop (bench/replay_speed.py), the fastest of three."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import vllm
    from replay_speed import reference_loop

    return f"vLLM {vllm.__version__}; reference loop {min(reference_loop() for _ in range(3)):.3f} s"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,8,32,128,512", help="running requests, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    banner = vllm_on_this_cpu()
    tokenizer = stand_in_tokenizer()
    print(banner)
    for n in (int(x) for x in args.requests.split(",")):
        step = statistics.median(asyncio.run(one_run(tokenizer, n, args.steps))[20:])
        print(f"{n:4d} running requests: {step * 1e6:8.0f} us a step, {step / n * 1e6:5.1f} us a request", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
