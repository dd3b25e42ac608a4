"""The host (CPU) side of vLLM's sampler: its Python and per-op dispatch, measured with vLLM's own Sampler.

    VLLM_TARGET_DEVICE=cpu python bench/sampler_host.py     # in a virtualenv with vLLM (0.12, or from 0.33)

vLLM's sampler runs outside the CUDA graph (vllm/v1/sample/sampler.py `Sampler.forward`; on a GPU its top-k
and top-p go through `TopKTopPSampler.forward_native` up to vLLM 0.21 unless FlashInfer's sampler is turned on),
so each of its ops is launched from Python every step. This script runs vLLM's own `Sampler` on the CPU over a
16-token vocabulary (so the ops' own work is next to nothing), with temperature 0.6, top_p 0.95 and top_k 5 for
every row (the sort path that Qwen3's generation config makes vLLM 0.12 take), and prints this thread's CPU
seconds per call (median of 250): the Python and the dispatcher, not the CUDA launches (about 30 of them on a
GPU, a few microseconds each; not measured here). On this project's machine with vLLM 0.12 (2026-12-07,
reference loop 0.11 s): 39, 48 and 85 us for 8, 32 and 128 rows. Beside the GPU's own time for those kernels
(backends/sampler.py: 0.18 ms for 8 rows of 151,936 logits on an H100), the host side is not what makes the
vLLM 0.12 deployments' steps longer than servesim prices them (docs/calibration-and-validation.md).
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    import vllm
    from host_time import use_this_cpu

    use_this_cpu()
    import torch
    from replay_speed import reference_loop
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    torch.set_num_threads(1)
    vocab = 16
    print(f"vLLM {vllm.__version__}; reference loop {min(reference_loop() for _ in range(3)):.3f} s")
    for rows in (8, 32, 128):
        sampler = Sampler()
        sampler.topk_topp_sampler.forward = sampler.topk_topp_sampler.forward_native  # a GPU's path, not the CPU's
        given = dict(temperature=torch.full((rows,), 0.6), all_greedy=False, all_random=True,
                     top_p=torch.full((rows,), 0.95), top_k=torch.full((rows,), 5, dtype=torch.int32), generators={},
                     max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                     frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
                     repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
                     allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
        accepted = inspect.signature(SamplingMetadata).parameters
        metadata = SamplingMetadata(**{name: given.get(name) for name in accepted})
        logits = torch.randn(rows, vocab)
        times = []
        for _ in range(300):
            x = logits.clone()
            t0 = time.thread_time()
            sampler(x, metadata)
            times.append(time.thread_time() - t0)
        print(f"{rows} rows: Sampler.forward {statistics.median(times[50:]) * 1e6:.0f} us of this thread's CPU", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
