"""The block manager alone: its calls in a replay, recorded once and replayed against a fresh
BlockManager, timed (and checked: every answer must be the recorded one).

    python bench/block_manager_calls.py [TRACE] [--calls FILE] [--repeat N] [--profile] [--instructions] [--tree DIR ...]

The replay of TRACE (default: the Mooncake trace beside the repository, else the bundled sample;
chunked, Llama-3.1-8B on H100-SXM, budget 2048) runs with a block manager that records each of
its public calls, with the state of the request it is about (its computed and output tokens, its
preemptions, and the blocks the policies or fast-forward appended to its table since the block
manager last saw it). The calls are kept in FILE (a pickle; recorded again when FILE is missing),
then replayed --repeat times against fresh block managers of this checkout: the best CPU seconds
are printed beside the reference loop's (bench/replay_speed.py). The block manager's answers are
compared with the recorded ones on the first replay, so a change that alters an answer shows up
here already. --profile prints the replay's cProfile instead; --instructions the instructions of
one replay of the calls, counted by callgrind as bench/instructions.py does (the calls replayed
once and twice in a process: the difference), for each --tree (default: this checkout).
"""

from __future__ import annotations

import argparse
import cProfile
import pickle
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: --tree runs another checkout's block manager

from bench.instructions import callgrind_count, counting_env  # noqa: E402
from bench.replay_speed import MOONCAKE, MOONCAKE_SAMPLE, reference_loop, shared_trace  # noqa: E402


def record(trace_path: str) -> dict:
    """Replay the trace with a recording block manager; its calls and the requests they name."""
    import sim.app.plan as plan
    from sim.app.plan import resolve
    from sim.app.replay import ReplayOptions, replay
    from sim.block_manager import BlockManager
    from sim.config import SchedulerConfig
    from traces import read_trace

    calls: list[tuple] = []
    requests: dict[int, tuple] = {}
    known: dict[int, int] = {}  # each request's table length after the block manager last touched it
    depth = [0]

    def state(r):
        if r.index not in requests:
            requests[r.index] = (r.index, r.request_id, r.arrival_s, r.num_prompt_tokens, r.max_tokens, r.hash_ids,
                                 r.hash_block_tokens)
        extra = r.block_table[known.get(r.index, 0):]
        # (the steps that decide which of its tokens vLLM cached: BlockManager.num_cached_tokens)
        steps = r.last_scheduled_step, r.last_sampled_step, r.cached_short_step
        return r.index, r.num_computed_tokens, r.num_output_tokens, r.num_preemptions, extra, steps

    def recorded(name, about_request):
        method = getattr(BlockManager, name)

        def call(self, *args):
            if depth[0]:
                return method(self, *args)
            head = (state(args[0]), self.pipelined, self.step_in_flight) if about_request else None
            depth[0] += 1
            try:
                result = method(self, *args)
            finally:
                depth[0] -= 1
            if about_request:
                known[args[0].index] = len(args[0].block_table)
            calls.append((name, head, args[1:] if about_request else args,
                          list(result) if isinstance(result, list) else result))
            return result
        return call

    methods = {name: recorded(name, about) for name, about in (
        ("cached_prefix", True), ("num_cached_blocks", True), ("can_allocate", False), ("allocate", True),
        ("can_append", True), ("append", True), ("free", True), ("pop_free_blocks", False))}
    shape: list[tuple] = []

    def init(self, *args):
        shape.append(args)
        BlockManager.__init__(self, *args)

    Recording = type("Recording", (BlockManager,), dict(methods, __init__=init))
    original = plan.BlockManager
    plan.BlockManager = Recording
    try:
        options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=2048), model="Llama-3.1-8B",
                                hardware="H100-SXM")
        replay(read_trace(trace_path), resolve(options))
    finally:
        plan.BlockManager = original
    if len(shape) != 1:
        sys.exit(f"block_manager_calls: the replay made {len(shape)} block managers; one is recorded")
    return {"calls": calls, "requests": requests, "shape": shape[0], "format": FORMAT}


FORMAT = 2  # of the recording: 2 records the steps that decide caching, and the engine's pipelined schedule


def replay_calls(recording: dict, check: bool) -> float:
    """Replay the recorded calls against a fresh block manager; CPU seconds."""
    from sim.block_manager import BlockManager
    from sim.request import Request

    twins = {i: Request(*fields) for i, fields in recording["requests"].items()}
    bm = BlockManager(*recording["shape"])
    started = time.process_time()
    cached = None  # the last cached_prefix answer: the policies pass it on to can_allocate and allocate
    for name, head, args, result in recording["calls"]:
        if name in ("can_allocate", "allocate") and cached is not None and args[0] == cached:
            args = (cached, *args[1:])
        if head is not None:
            (index, computed, output, preemptions, extra, steps), bm.pipelined, bm.step_in_flight = head
            r = twins[index]
            r.num_computed_tokens, r.num_output_tokens, r.num_preemptions = computed, output, preemptions
            r.last_scheduled_step, r.last_sampled_step, r.cached_short_step = steps
            if extra:
                r.block_table.extend(extra)
            got = getattr(bm, name)(r, *args)
            if name == "cached_prefix":
                cached = got
            if name == "free" and not args:
                r.drop_block_hashes()
        else:
            got = getattr(bm, name)(*args)
        if check and got != result:
            sys.exit(f"block_manager_calls: {name}{args} answered {got!r:.200}, recorded {result!r:.200}")
    return time.process_time() - started


def instructions(tree: Path, calls_file: Path, replays: int) -> int:
    """Instructions callgrind counts for a process that replays the calls `replays` times with `tree`'s block manager."""
    command = [sys.executable, str(Path(__file__).resolve()), "--calls", str(calls_file), "--repeat", str(replays), "--bare"]
    return callgrind_count(command, tree, counting_env(tree), "block_manager_calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", default=None)
    parser.add_argument("--calls", default="/tmp/block_manager_calls.pickle", help="where the recorded calls are kept")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--tree", action="append", default=None, help="a servesim checkout (repeatable; default: this one)")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # replay only, unchecked: under callgrind
    args = parser.parse_args()
    calls_file = Path(args.calls)
    if not calls_file.exists():
        trace = args.trace or str(shared_trace(MOONCAKE) or MOONCAKE_SAMPLE)
        recording = record(trace)
        with calls_file.open("wb") as f:
            pickle.dump(recording, f, protocol=pickle.HIGHEST_PROTOCOL)
        print(f"recorded {len(recording['calls']):,} calls of {trace} in {calls_file}")
    if args.instructions:
        for tree in [Path(t).resolve() for t in (args.tree or [ROOT])]:
            one, two = instructions(tree, calls_file.resolve(), 1), instructions(tree, calls_file.resolve(), 2)
            print(f"{tree}: {(two - one) / 1e6:,.0f} M instructions for one replay of the calls", flush=True)
        return
    with calls_file.open("rb") as f:
        recording = pickle.load(f)
    if recording.get("format") != FORMAT:
        sys.exit(f"block_manager_calls: {calls_file} was recorded by an older version of this script: remove it "
                 "to record the calls again")
    if args.bare:
        for _ in range(args.repeat):
            replay_calls(recording, check=False)
        return
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(replay_calls, recording, False)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)
        return
    ref = reference_loop()
    times = [replay_calls(recording, check=i == 0) for i in range(args.repeat)]
    print(f"{len(recording['calls']):,} calls: best {min(times):.3f} s (of {', '.join(f'{t:.3f}' for t in times)}); "
          f"reference loop {ref:.3f} s; block manager / ref {min(times) / ref:.2f}")


if __name__ == "__main__":
    main()
