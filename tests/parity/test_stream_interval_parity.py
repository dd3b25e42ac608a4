"""servesim's streamed chunks (reports/outcomes.py, stream_chunk_times: --stream-interval N) against vLLM 0.33's and
0.34's own OutputProcessor (vllm/v1/engine/output_processor.py), built as vLLM's AsyncLLM builds it with the
server's stream_interval (no tokenizer: detokenize=False, so only the token counts matter, as for vLLM's bench,
which sends ignore_eos and max_tokens).

A servesim replay's token times are fed to it as the engine core would send them: each step (each distinct
token time) one EngineCoreOutput per request that emitted a token then, with FinishReason.LENGTH on a request's
last token, through OutputProcessor.process_outputs, as a streaming client's request (RequestOutputKind.DELTA).
Every RequestOutput it returns is one chunk of the stream: its step's time must be exactly servesim's chunk
time, in order, and it must carry exactly the tokens since the previous chunk. A non-streaming request
(FINAL_ONLY) gets one output, at the finish, with every token, whatever N is.

Skipped where vLLM is not installed (the `parity` extra: see the README).
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
output_processor = pytest.importorskip("vllm.v1.engine.output_processor",
                                       reason="vLLM is not installed (pip install '.[parity]')")

from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402

from reports.outcomes import stream_chunk_times  # noqa: E402
from sim.app.options import ReplayOptions  # noqa: E402
from sim.app.plan import resolve  # noqa: E402
from sim.app.replay import replay  # noqa: E402
from sim.config import CacheConfig, SchedulerConfig  # noqa: E402
from tests.helpers import make_trace  # noqa: E402


def vllm_chunks(result, interval: int, kind: RequestOutputKind) -> dict[int, list[tuple[float, int]]]:
    """Request index -> the (step time, tokens carried) of every output vLLM's OutputProcessor returns."""
    processor = output_processor.OutputProcessor(None, log_stats=False, stream_interval=interval)
    steps: dict[float, list[tuple[int, int]]] = defaultdict(list)  # time -> (request, its token's index)
    for i, r in enumerate(result.requests):
        if r.finish_s is None:
            continue
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, detokenize=False)
        params.output_kind = kind
        processor.add_request(EngineCoreRequest(
            request_id=str(i), prompt_token_ids=[1] * r.num_prompt_tokens, mm_features=None, sampling_params=params,
            pooling_params=None, arrival_time=r.arrival_s, lora_request=None, cache_salt=None, data_parallel_rank=None,
            external_req_id=str(i)), None)
        for k, t in enumerate(result.tokens_of(i).tolist()):
            steps[t].append((i, k))
    chunks: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for t in sorted(steps):
        outputs = [EngineCoreOutput(str(i), [1000 + k],
                                    finish_reason=FinishReason.LENGTH if k == result.requests[i].max_tokens - 1 else None)
                   for i, k in steps[t]]
        for out in processor.process_outputs(outputs).request_outputs:
            chunks[int(out.request_id)].append((t, len(out.outputs[0].token_ids)))
    assert not processor.has_unfinished_requests()
    return chunks


@pytest.fixture(scope="module")
def result():
    """Requests of 1 to 70 output tokens, arriving together and apart, sharing steps (small cache: preemptions)."""
    rng = np.random.default_rng(7)
    rows = [(round(float(t), 3), int(p), int(o)) for t, p, o in
            zip(np.sort(rng.uniform(0, 0.5, 40)), rng.integers(1, 400, 40), rng.integers(1, 71, 40))]
    options = ReplayOptions(model="tiny", scheduler=SchedulerConfig("chunked", 512, 16), cache=CacheConfig(16, 40))
    run = replay(make_trace(rows), resolve(options))
    assert run.num_preemptions > 0 and all(r.finish_s is not None for r in run.requests)
    return run


@pytest.mark.parametrize("interval", [1, 2, 3, 5, 16, 100])
def test_streamed_chunks_as_vllms_output_processor(result, interval):
    chunks = vllm_chunks(result, interval, RequestOutputKind.DELTA)
    for i, r in enumerate(result.requests):
        times = result.tokens_of(i)
        ours = stream_chunk_times(times, interval)
        assert [t for t, _ in chunks[i]] == list(ours), (i, r.max_tokens)
        # each carries the tokens since the last: the token counts at the sends, differenced
        sent_at = np.searchsorted(times, np.asarray(ours)) + 1
        assert [n for _, n in chunks[i]] == np.diff(sent_at, prepend=0).tolist()


@pytest.mark.parametrize("interval", [1, 4])
def test_a_non_streaming_request_gets_one_output_at_the_finish(result, interval):
    chunks = vllm_chunks(result, interval, RequestOutputKind.FINAL_ONLY)
    assert all(chunks[i] == [(r.finish_s, r.max_tokens)] for i, r in enumerate(result.requests))
