"""Streamed request outcomes and run tables: the same table and summary as built at the end,
whatever order requests finish in; Parquet and CSV tables read back to the same values."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.metrics import inter_token_latencies, requests_table
from reports.outcomes import REQUEST_COLUMNS, RequestOutcomes, outcomes_from_result
from reports.run_tables import TableWriter, read_run_table, write_table
from sim.app.cli import main
from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, replay
from sim.config import SLO, CacheConfig, SchedulerConfig
from traces import AZURE_CONV_SAMPLE, read_trace
from traces.transforms import apply


@pytest.fixture(scope="module")
def result():
    """A replay with a rejection, one-token outputs and preemptions (a cache too small for 120 requests)."""
    trace = apply(read_trace(AZURE_CONV_SAMPLE), num_requests=120, max_model_len=None)
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_model_len=2600),
                            cache=CacheConfig(num_blocks=400))
    run = replay(trace, resolve(options))
    assert run.num_preemptions > 0 and {r.status.value for r in run.requests} == {"finished", "rejected"}
    return run


def test_requests_csv_is_pandas_to_csv_of_the_whole_table(result, tmp_path):
    outcomes_from_result(result, writer=TableWriter(tmp_path / "requests.csv", "csv"))
    requests_table(result).to_csv(tmp_path / "pandas.csv", index=False)
    assert (tmp_path / "requests.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


def test_outcomes_in_any_finishing_order_give_the_same_table_and_sketches(result, tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    in_order = outcomes_from_result(result, writer=TableWriter(tmp_path / "a" / "requests.parquet", "parquet"))
    shuffled = RequestOutcomes(writer=TableWriter(tmp_path / "b" / "requests.parquet", "parquet"), batch_rows=7)
    order = np.random.default_rng(1).permutation(len(result.requests))
    for position in order.tolist():
        r = result.requests[position]
        shuffled.add(position, r, result.tokens_of(position) if r.finish_s is not None else None)
    shuffled.close()
    a, b = read_run_table(tmp_path / "a", "requests"), read_run_table(tmp_path / "b", "requests")
    pd.testing.assert_frame_equal(a, b)
    assert list(a.columns) == list(REQUEST_COLUMNS)
    for name in ("ttft", "tpot", "e2e", "scheduling_delay"):
        assert np.array_equal(in_order.sketches[name].values(), shuffled.sketches[name].values())
    assert np.array_equal(shuffled.itl.values(), inter_token_latencies(result))


@pytest.mark.parametrize("times_batch", [1, 50, 1 << 16])
@pytest.mark.parametrize("exact_limit", [1 << 22, 1000])
def test_gaps_of_token_times_in_bulk_are_each_requests_own(result, tmp_path, monkeypatch, times_batch, exact_limit):
    """Each request's token times are handed over as a list (as the engine keeps them), in a
    shuffled finishing order, and their gaps computed in bulk every `TIMES_BATCH` times: the table
    is pandas' of the whole result, each row's longest gap (a tbt SLO) is the request's own, and the
    ITL sketch gets exactly the chunks of each request's own gaps in arrival order (cut where
    GAP_BATCH gaps have gathered and at every batch of rows), exact or sketched."""
    import reports.outcomes as outcomes_module
    from reports.metrics import longest_token_gaps
    from reports.quantiles import StreamingQuantiles

    monkeypatch.setattr(outcomes_module, "TIMES_BATCH", times_batch)
    monkeypatch.setattr(outcomes_module, "GAP_BATCH", 300)  # several ITL chunks
    slo, batch_rows = SLO(tbt=0.05), 7
    outcomes = RequestOutcomes(slo, TableWriter(tmp_path / "requests.csv", "csv"), batch_rows=batch_rows,
                               exact_limit=exact_limit)
    counted = []  # each row's longest gap, as counted
    def count(columns, arrival, output, finish, latencies, from_send, count=outcomes._count):
        counted.append(latencies["tbt"])
        count(columns, arrival, output, finish, latencies, from_send)
    outcomes._count = count
    for position in np.random.default_rng(2).permutation(len(result.requests)).tolist():
        r = result.requests[position]
        outcomes.add(position, r, result.tokens_of(position).tolist() if r.finish_s is not None else None)
    outcomes.close()
    requests_table(result).to_csv(tmp_path / "pandas.csv", index=False)
    assert (tmp_path / "requests.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()
    finished = np.array([r.finish_s is not None for r in result.requests])
    own = np.where(finished, longest_token_gaps(result), np.nan)
    assert np.array_equal(np.concatenate(counted), own, equal_nan=True) and np.isfinite(own).sum() > 50
    # The chunks each request's own gaps make, fed to a sketch of the same limit.
    expected, chunk, rows = StreamingQuantiles(exact_limit), [], 0
    for position, r in enumerate(result.requests):
        if finished[position] and r.max_tokens > 1:
            chunk.append(np.diff(result.tokens_of(position)))
            if sum(map(len, chunk)) >= 300:
                expected.add(np.concatenate(chunk))
                chunk = []
        rows += 1
        if rows % batch_rows == 0 or position == len(result.requests) - 1:
            if chunk:
                expected.add(np.concatenate(chunk))
                chunk = []
    assert outcomes.itl.is_exact == expected.is_exact == (exact_limit > 1000)
    if outcomes.itl.is_exact:
        assert np.array_equal(outcomes.itl.values(), inter_token_latencies(result))
    assert outcomes.itl.stats() == expected.stats() and outcomes.itl.mean() == expected.mean()
    good = finished & (np.isnan(own) | (own <= 0.05))
    assert 0 < outcomes.num_good == good.sum() < outcomes.num_completed


def test_summary_figures_are_those_of_the_whole_table(result):
    outcomes = outcomes_from_result(result, SLO(ttft=2.0, tpot=0.05))
    frame = requests_table(result)
    done = frame[frame["status"] == "finished"]
    assert outcomes.num_completed == len(done) and outcomes.num_rejected == len(frame) - len(done)
    assert outcomes.duration_s() == float(done["finish_s"].max() - frame["arrival_s"].min())
    assert outcomes.total_output_tokens == done["output_tokens"].sum()
    ttft = done["ttft_s"].to_numpy()
    assert outcomes.sketches["ttft"].stats()["p90"] == float(np.percentile(ttft, 90))
    tpot = done["tpot_s"].to_numpy()
    good = (ttft <= 2.0) & (np.isnan(tpot) | (tpot <= 0.05))
    assert outcomes.num_good == good.sum()
    # (a request's figures read N; the run's own limit, --max-model-len 2600, is kept)
    reasons = frame.loc[frame["status"] == "rejected", "reject_reason"].str.replace(
        r"(?<!--max-model-len )(?<!\d)\d+", "N", regex=True)
    assert outcomes.reject_reason_counts() == reasons.value_counts().to_dict()


def test_a_missing_outcome_is_an_error():
    outcomes = RequestOutcomes()
    outcomes.add(1, type("R", (), {"request_id": "x", "arrival_s": 0.0, "num_prompt_tokens": 1, "max_tokens": 1,
                                   "status": type("S", (), {"value": "finished"}), "first_scheduled_s": 0.0,
                                   "first_token_s": 0.1, "finish_s": 0.1, "num_preemptions": 0,
                                   "num_prefix_hit_tokens": 0, "reject_reason": None})())
    with pytest.raises(RuntimeError, match="missing before position 1"):
        outcomes.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.floats(-1e6, 1e6), st.just(float("nan"))), st.integers(-5, 10**12),
                          st.sampled_from(["", "a,b", 'say "hi"', "plain"])), min_size=1, max_size=30),
       st.integers(1, 8))
def test_csv_batches_are_pandas_to_csv_byte_for_byte(tmp_path_factory, rows, chunk_rows):
    folder = tmp_path_factory.mktemp("t")
    columns = {"x": np.array([r[0] for r in rows]), "n": np.array([r[1] for r in rows], dtype=np.int64),
               "text": [r[2] for r in rows]}
    write_table(folder, "t", columns, "csv", chunk_rows=chunk_rows)
    pd.DataFrame(columns).to_csv(folder / "pandas.csv", index=False)
    assert (folder / "t.csv").read_bytes() == (folder / "pandas.csv").read_bytes()
    write_table(folder, "t", columns, "parquet", chunk_rows=chunk_rows)
    back = read_run_table(folder, "t")  # Parquet first
    assert back["n"].tolist() == columns["n"].tolist() and back["text"].tolist() == columns["text"]
    assert np.array_equal(back["x"].to_numpy(), columns["x"], equal_nan=True)



@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(alphabet=["a", " ", ",", '"', "\n", "\r", "'", "\t"], max_size=3)),
                min_size=1, max_size=12),
       st.booleans(), st.integers(1, 4))
def test_text_columns_are_quoted_as_pandas_quotes_them(tmp_path_factory, texts, alone, chunk_rows):
    """Text with line breaks, carriage returns, None and empty fields, beside a number or alone
    (where a lone empty field is quoted)."""
    folder = tmp_path_factory.mktemp("t")
    columns = {"text": texts} if alone else {"text": texts, "n": np.arange(len(texts), dtype=np.int64)}
    write_table(folder, "t", columns, "csv", chunk_rows=chunk_rows)
    pd.DataFrame(columns).to_csv(folder / "pandas.csv", index=False)
    assert (folder / "t.csv").read_bytes() == (folder / "pandas.csv").read_bytes()

def test_steps_table_formats(tmp_path):
    sample = [str(AZURE_CONV_SAMPLE), "--limit", "40", "--quiet"]
    for fmt in ("parquet", "csv", "none"):
        assert main(["replay", *sample, "--out", str(tmp_path / fmt), "--steps", fmt, "--requests", "parquet"]) == 0
    parquet, csv = read_run_table(tmp_path / "parquet", "steps"), pd.read_csv(tmp_path / "csv" / "steps.csv")
    assert len(parquet) == json.loads((tmp_path / "parquet" / "summary.json").read_text())["num_steps"]
    pd.testing.assert_frame_equal(parquet, csv, check_dtype=False)
    assert not (tmp_path / "none" / "steps.parquet").exists() and not (tmp_path / "none" / "steps.csv").exists()
    assert (tmp_path / "none" / "digest.json").read_bytes() == (tmp_path / "csv" / "digest.json").read_bytes()
    assert len(read_run_table(tmp_path / "none", "requests")) == 40  # requests.parquet


@pytest.mark.parametrize("steps,requests", [("parquet", "csv"), ("csv", "parquet")])
def test_a_streamed_replay_writes_the_files_of_an_in_memory_one(tmp_path, steps, requests):
    from sim.app.replay import replay_to, write_run

    trace = apply(read_trace(AZURE_CONV_SAMPLE), num_requests=150, max_model_len=None)
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_model_len=2600),
                            cache=CacheConfig(num_blocks=400), slo=SLO(ttft=1.0))
    streamed = replay_to(tmp_path / "streamed", trace, resolve(options), steps, requests, step_batch_rows=37)
    plan = resolve(options)
    kept = write_run(tmp_path / "kept", replay(trace, plan), plan, trace, steps=steps, requests=requests,
                     step_batch_rows=37)
    assert streamed == kept and streamed["preemptions"] > 0 and streamed["rejected"] > 0
    names = sorted(p.name for p in (tmp_path / "kept").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "streamed").iterdir())
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "kept" / name).read_bytes(), name
    assert len(read_run_table(tmp_path / "streamed", "steps")) == streamed["num_steps"] > 37


def test_the_step_timeline_is_exact_then_binned():
    from reports.digest import timeline
    from reports.timeline import StepTimeline

    starts = np.arange(1000.0)  # steps at whole seconds; value = start
    exact, binned = StepTimeline(("x",)), StepTimeline(("x",), exact_steps=300)
    for part in np.array_split(starts, 7):
        exact.add(part, {"x": part})
        binned.add(part, {"x": part})
    assert exact.timeline(10) == timeline(starts, {"x": starts}, 10)
    assert binned._kept is None and binned.num_steps == 1000
    # Bins of 99.9 s: every step is at least 0.1 s past a bin edge, more than one fine bin
    # (2 x 999 s / 65536), so each lands in its own bin: bin k holds the steps 100k .. 100k + 99
    # (the first 0 .. 99, the last 900 .. 999), whose mean is 100k + 49.5.
    got = binned.timeline(10)
    assert got["start_s"] == pytest.approx([99.9 * k for k in range(10)])
    assert got["x"] == pytest.approx([100 * k + 49.5 for k in range(10)])


def test_a_step_log_with_a_sink_hands_over_whole_batches_of_the_same_rows():
    from sim.step_log import StepLog

    rng = np.random.default_rng(3)
    kept, batches = StepLog(), []
    spilled = StepLog(sink=lambda columns, first: batches.append((first, {k: v.copy() for k, v in columns.items()})),
                      spill_rows=10)
    for single in (rng.random(40) < 0.5).tolist():
        for log in (kept, spilled):
            if single:
                log.append((1.0, 0.5, 3, 4, 5, 6, 7, 0), {"attention": 0.25})
            else:  # a run: num_prefill_tokens and num_preemptions left out, so they stay 0
                log.extend(7, {"start_s": np.arange(7.0), "seconds": 0.5, "num_decode_tokens": 2}, {"attention": 0.125})
    spilled.spill()
    assert len(spilled) == len(kept) and [first for first, _ in batches] == list(range(0, len(kept), 10))
    assert all(len(b["start_s"]) == 10 for _, b in batches[:-1])
    for name, values in kept.columns().items():
        assert np.array_equal(np.concatenate([b[name] for _, b in batches]), values), name


def test_a_step_log_reads_each_of_its_columns_as_an_attribute_and_nothing_else():
    from sim.step_log import STEP_COLUMNS, StepLog

    log = StepLog()
    log.append(tuple(range(1, 9)), {"attention": 0.25})
    log.extend(2, {"start_s": [2.0, 3.0], "num_requests": 4}, {"attention": 0.5})
    for name in STEP_COLUMNS:  # each one declared, in the table's order
        assert np.array_equal(getattr(log, name), log.columns()[name]), name
    assert all(isinstance(vars(StepLog)[name], property) for name in STEP_COLUMNS)
    assert not hasattr(StepLog, "__getattr__")  # it would keep CPython from specialising lookups on the log
    assert log.num_requests.tolist() == [5, 4, 4] and log.num_preemptions.tolist() == [8, 0, 0]
    with pytest.raises(AttributeError):
        log.attention  # a breakdown key is read through columns()


def test_a_step_log_makes_a_breakdown_column_when_its_key_first_comes_blank_before():
    from sim.step_log import StepLog

    log = StepLog()
    log.append(tuple(range(8)), {"attention": 0.25})
    log.append(tuple(range(8)), {"attention": 0.5, "host_s": 0.125})  # a key first seen after another
    log.extend(2, {"num_requests": 3}, {"host_s": 1.0, "gemm": 2.0, "attention": 0.75})
    columns = log.columns()
    assert columns["attention"].tolist() == [0.25, 0.5, 0.75, 0.75]
    assert np.isnan(columns["host_s"][0]) and columns["host_s"][1:].tolist() == [0.125, 1.0, 1.0]
    assert np.isnan(columns["gemm"][:2]).all() and columns["gemm"][2:].tolist() == [2.0, 2.0]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_csv_table_is_pandas_to_csv_for_any_column_kinds(tmp_path_factory, data):
    """Float arrays with NaN, infinities and -0.0; counts as arrays or lists; text with None: the
    CSV writer's fields are pandas' (the fast paths for float columns with NaN and lists of ints)."""
    num_rows = data.draw(st.integers(1, 12))
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-5, 1e16, 0.1]))
    columns = {
        "x": np.array(data.draw(st.lists(floats, min_size=num_rows, max_size=num_rows))),
        "counts": data.draw(st.lists(st.integers(-2**40, 2**40), min_size=num_rows, max_size=num_rows)),
        "n": np.array(data.draw(st.lists(st.integers(0, 10**6), min_size=num_rows, max_size=num_rows)), dtype=np.int32),
        "text": data.draw(st.lists(st.one_of(st.none(), st.text("ab, \"")), min_size=num_rows, max_size=num_rows)),
        "absent": np.full(num_rows, np.nan),  # a column with no value (the API server's part without a client)
    }
    folder = tmp_path_factory.mktemp("csv")
    write_table(folder, "t", columns, "csv", chunk_rows=data.draw(st.integers(1, 13)))
    pd.DataFrame(columns).to_csv(folder / "pandas.csv", index=False)
    assert (folder / "t.csv").read_bytes() == (folder / "pandas.csv").read_bytes()
