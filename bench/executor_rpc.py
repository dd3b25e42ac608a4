"""The per-step messages between vLLM's engine core and its TP workers, measured with vLLM's own queue.

    VLLM_TARGET_DEVICE=cpu .venv-parity/bin/python bench/executor_rpc.py [--requests 1,8,32,128,512]

With tensor parallelism vLLM runs its workers in other processes (`MultiprocExecutor`,
vllm/v1/executor/multiproc_executor.py) and each synchronous step is two RPCs over shared-memory message
queues (`MessageQueue`, vllm/distributed/device_communicators/shm_broadcast.py; `EngineCore.step`,
vllm/v1/engine/core.py): `execute_model` broadcasts the step's `SchedulerOutput` and waits for the output
rank's reply (None), then `sample_tokens` returns the `ModelRunnerOutput`. This script sends vLLM's own
SchedulerOutput and ModelRunnerOutput of R decoding requests (built by vLLM's scheduler as
bench/host_time.py builds them) through vLLM's MessageQueue to a worker process that answers as the output
rank does, and prints the wall time of the step's two round trips (median of 400) beside this CPU's
reference loop. Run it with two cores free: the two processes poll their queues, and with the cores taken by
other work a round trip waits for a time slice (12 ms a step here with both cores busy). On this project's
2-core machine (2026-12-07, reference loop 0.11 s): 73, 52, 61, 93 and 243 us for 1, 8, 32, 128 and 512
requests. It is not added to the host-time profile: a tenth of the
millisecond a step that the vLLM 0.12 deployments' TPOT leaves unexplained (docs/async-scheduling.md). It also
times the engine core's output thread's encoding of the step's EngineCoreOutputs (vLLM's `MsgpackEncoder`,
this thread's CPU seconds): 3-10 us a step for 8-128 requests (vLLM 0.12 and 0.33 alike).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker_main(handle, conn, reply_bytes: bytes) -> None:
    """The output rank: dequeue each RPC, answer execute_model with None and sample_tokens with the output."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    requests = MessageQueue.create_from_handle(handle, 0)
    replies = MessageQueue(1, 1)
    conn.send(replies.export_handle())
    requests.wait_until_ready()
    replies.wait_until_ready()
    reply = pickle.loads(reply_bytes)
    while True:
        method, _args, _kwargs, _rank = requests.dequeue(indefinite=True)
        if method == "stop":
            break
        replies.enqueue((0, None if method == "execute_model" else reply))


def step_messages(num_running: int):
    """vLLM's SchedulerOutput, ModelRunnerOutput and EngineCoreOutputs of a decode step of `num_running` requests."""
    import numpy as np
    from host_time import Worker  # bench/ is this script's folder
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from tests.parity.vllm_driver import EngineSetup, _block_hasher_ready, make_scheduler

    _block_hasher_ready()
    tokens = num_running * 512 + 64
    setup = EngineSetup(block_size=16, num_gpu_blocks=num_running * 40 + 64, max_num_batched_tokens=tokens,
                        max_num_seqs=num_running + 1, max_model_len=8192)
    scheduler = make_scheduler(setup)
    worker = Worker(num_running + 1, 8192, tokens, 16)
    hasher = get_request_block_hasher(16, sha256)
    rng = np.random.default_rng(0)
    for i in range(num_running):
        scheduler.add_request(Request(f"{i:08d}", rng.integers(1, 1 << 19, 512).tolist(),
                                      SamplingParams(max_tokens=1 << 20, ignore_eos=True), None,
                                      arrival_time=time.time(), block_hasher=hasher))
    for _ in range(4):  # admitted, then decoding
        out = scheduler.schedule()
        worker.update_states(out)
        worker.prepare_inputs(out)
        output = worker.bookkeeping(rng.integers(1, 1 << 19, len(out.num_scheduled_tokens)).tolist())
        engine_outputs = scheduler.update_from_output(out, output)
    return out, output, next(iter(engine_outputs.values()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="1,8,32,128,512")
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, str(ROOT))
    from replay_speed import reference_loop
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.serial_utils import MsgpackEncoder

    print(f"reference loop {min(reference_loop() for _ in range(3)):.3f} s")
    for num_running in (int(x) for x in args.requests.split(",")):
        scheduler_output, runner_output, engine_outputs = step_messages(num_running)
        requests = MessageQueue(1, 1)
        parent, child = mp.Pipe()
        worker = mp.get_context("fork").Process(target=worker_main, args=(requests.export_handle(), child,
                                                                          pickle.dumps(runner_output)))
        worker.start()
        replies = MessageQueue.create_from_handle(parent.recv(), 0)
        requests.wait_until_ready()
        replies.wait_until_ready()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            requests.enqueue(("execute_model", (scheduler_output,), {}, 0))
            replies.dequeue()
            requests.enqueue(("sample_tokens", (None,), {}, 0))
            replies.dequeue()
            times.append(time.perf_counter() - t0)
        requests.enqueue(("stop", (), {}, 0))
        worker.join()
        size = len(pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL))
        # The engine core's output thread encodes the step's EngineCoreOutputs for the front end (EngineCoreProc.
        # process_output_sockets: MsgpackEncoder.encode_into), in the engine core's process, beside the step.
        encoder, buffer, encode = MsgpackEncoder(), bytearray(), []
        for _ in range(args.reps):
            t0 = time.thread_time()
            encoder.encode_into(engine_outputs, buffer)
            encode.append(time.thread_time() - t0)
        print(f"R={num_running}: a step's two RPCs {statistics.median(times) * 1e6:.0f} us (median of {args.reps}); "
              f"SchedulerOutput {size} bytes pickled; EngineCoreOutputs encoded in "
              f"{statistics.median(encode) * 1e6:.0f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
