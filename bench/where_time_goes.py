"""Where a replay's time goes: wall time per call of the engine's parts, measured in the process
that runs `sim replay` (timers wrapped around each part; the timers' own cost is about 0.2 us a
call, small beside the parts').

    python bench/where_time_goes.py [TRACE] [--rate-scale X] [--out DIR]

TRACE defaults to the Azure conversation hour (`../shared/traces/raw/`, else the bundled sample);
the replay is chunked, Llama-3.1-8B on H100-SXM, budget 2048, as `bench/replay_speed.py` runs it,
written to a run folder (--out, default a temporary one) as `sim replay` writes it. Times are
inclusive: a part called inside another (the cost model's decode run inside the fast-forward plan,
say) counts in both, and its row says which it is part of. A reference loop's CPU seconds are
printed beside them (this machine is shared: compare figures relative to it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from replay_speed import AZURE, AZURE_SAMPLE, reference_loop, shared_trace  # bench/ is this script's folder

# (module, class, method, what it is part of): the parts timed, in the order printed.
PARTS = (
    ("sim.engine", "Engine", "run", ""),
    ("sim.engine", "Engine", "plan", "Engine.run"),
    ("sim.fast_forward", "FastForward", "plan", "Engine.plan"),
    ("backends.costmodel.optables.backend", "OpTableBackend", "decode_run", "FastForward.plan"),
    ("sim.fast_forward", "FastForward", "plan_chunks", "Engine.plan"),
    ("backends.costmodel.optables.backend", "OpTableBackend", "chunk_steps", "FastForward.plan_chunks"),
    ("backends.costmodel.optables.backend", "OpTableBackend", "execute", "Engine.plan"),
    ("sim.engine", "Engine", "apply", "Engine.run"),
    ("sim.engine", "Engine", "_apply_step", "Engine.apply"),
    ("sim.engine", "Engine", "_advance_decode_run", "Engine.apply"),
    ("sim.engine", "Engine", "_log_decode_run", "Engine.apply"),
    ("sim.engine", "Engine", "_apply_chunk_run", "Engine.apply"),
    ("sim.block_manager", "BlockManager", "append", "ChunkedPolicy.schedule"),
    ("sim.block_manager", "BlockManager", "grow_tables", "Engine.apply, ChunkedPolicy.schedule"),
    ("sim.step_log", "StepLog", "extend", "Engine._log_decode_run, _apply_chunk_run"),
    ("sim.step_log", "StepLog", "append_step", "Engine.apply"),
    ("sim.arrivals", "TraceArrivals", "deliver", "Engine.run"),
    ("policies.chunked", "ChunkedPolicy", "schedule", "Engine.run"),
    ("sim.block_manager", "BlockManager", "allocate", "ChunkedPolicy.schedule"),
    ("sim.block_manager", "BlockManager", "pop_free_blocks", "allocate, append, grow_tables"),
    ("sim.engine", "Engine", "finish", "Engine.apply"),
    ("sim.block_manager", "BlockManager", "free", "Engine.finish"),
    ("sim.app.run_folder", "RunFolder", "on_request", "Engine.finish"),
    ("reports.outcomes", "RequestOutcomes", "_gaps_of_times", "RunFolder.on_request, finish"),
    ("sim.app.run_folder", "RunFolder", "on_steps", "the step log's batches"),
    ("sim.app.run_folder", "RunFolder", "finish", "closing the run folder"),
)


def wrap(owner, name: str, totals: list) -> None:
    """Time every call of owner.name into totals ([calls, seconds]); generators by their whole life."""
    import inspect

    original = getattr(owner, name)
    clock = time.perf_counter
    if inspect.isgeneratorfunction(original):
        def timed_generator(*args, **kwargs):
            started = clock()
            generator = original(*args, **kwargs)
            spent = 0.0
            try:
                value = next(generator)
                while True:
                    spent += clock() - started
                    sent = yield value
                    started = clock()
                    value = generator.send(sent)
            except StopIteration:
                spent += clock() - started
            totals[0] += 1
            totals[1] += spent
        setattr(owner, name, timed_generator)
        return

    def timed(*args, **kwargs):
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            totals[0] += 1
            totals[1] += clock() - started
    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", default=None)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="the run folder (default: a temporary one)")
    args = parser.parse_args()
    trace_path = args.trace or str(shared_trace(AZURE) or AZURE_SAMPLE)

    import importlib

    from sim.app.cli import main as cli_main

    totals = {}
    for module, cls, method, _ in PARTS:
        owner = getattr(importlib.import_module(module), cls)
        totals[(cls, method)] = [0, 0.0]
        wrap(owner, method, totals[(cls, method)])
    ref = reference_loop()
    with tempfile.TemporaryDirectory(prefix="where_time_goes_") as temporary:
        out = args.out or temporary
        started = time.perf_counter()
        status = cli_main(["replay", trace_path, "--policy", "chunked", "--max-num-batched-tokens", "2048",
                           "--model", "Llama-3.1-8B", "--hardware", "H100-SXM", "--rate-scale", f"{args.rate_scale:g}",
                           "--out", out, "--quiet", "--overwrite"])
        if status:
            sys.exit(f"where_time_goes: sim replay failed ({status})")
        wall = time.perf_counter() - started
    print(f"trace {trace_path} at {args.rate_scale:g}x: `sim replay` in-process {wall:.2f} s wall "
          f"(start-up not included), reference loop {ref:.2f} s CPU")
    print(f"{'part':<34}{'part of':<36}{'calls':>9}{'s':>8}{'us a call':>11}")
    for module, cls, method, parent in PARTS:
        calls, seconds = totals[(cls, method)]
        if calls:
            print(f"{cls + '.' + method:<34}{parent:<36}{calls:>9}{seconds:>8.3f}{1e6 * seconds / calls:>11.1f}")


if __name__ == "__main__":
    main()
