"""`sim validate`: measured deployments in AIConfigurator's silicon format against simulated benchmarks.

The first tests run anywhere, on synthetic operator tables (tests/optables_fixture.py) named as an
H100's and a tiny Llama config; the last one runs a 5-row cut of the shared measured file when
../shared/gpu-data is there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.app.cli import main
from sim.errors import ServesimError
from tests.helpers import shared_dir
from tests.optables_fixture import write_tables

SHARED = shared_dir() / "gpu-data" / "aiconfigurator"
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
               "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 512, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False}
COLUMNS = ["id", "silicon_data_source", "backend", "backend_version", "model_path", "system", "precision", "mode",
           "isl", "osl", "batch_size", "tp_size", "pp_size", "silicon_ttft_ms", "silicon_tpot_ms"]


def measured_rows() -> list[dict]:
    base = {"silicon_data_source": "", "backend": "vllm", "backend_version": "", "model_path": "org/toy",
            "system": "h100_sxm", "precision": "", "mode": "agg", "isl": 64, "osl": 16, "batch_size": 2,
            "tp_size": 1, "pp_size": 1, "silicon_ttft_ms": 1.0, "silicon_tpot_ms": 0.1}
    return [dict(base, id="a"),
            dict(base, id="b", tp_size=2, batch_size=8, silicon_data_source="f.csv; silicon_concurrency=4"),
            dict(base, id="c", backend="sglang", backend_version="0.5"),
            dict(base, id="d", mode="disagg"),
            dict(base, id="e", system="b200_sxm", precision="fp4")]


def setup(tmp_path) -> tuple[Path, Path, Path]:
    ops = tmp_path / "ops"
    ops.mkdir()
    write_tables(ops, system="h100_sxm")
    models = tmp_path / "models"
    (models / "org" / "toy").mkdir(parents=True)
    (models / "org" / "toy" / "config.json").write_text(json.dumps(TINY_CONFIG))
    csv = tmp_path / "measured.csv"
    pd.DataFrame(measured_rows(), columns=COLUMNS).to_csv(csv, index=False)
    return csv, ops, models


@pytest.mark.slow
def test_validate_writes_the_issue_shape_and_skips_with_reasons(tmp_path):
    csv, ops, models = setup(tmp_path)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "validate.json").read_text())
    assert list(summary) == ["groups", "all", "skipped"]
    assert [list(g) for g in summary["groups"]] == [["system", "model", "backend", "backend_version", "precision",
                                                     "rows", "ttft_mape", "tpot_mape"]] * 2
    assert [(g["backend"], g["backend_version"], g["precision"], g["rows"]) for g in summary["groups"]] == \
        [("sglang", "0.5", "", 1), ("vllm", "", "", 2)]
    assert summary["skipped"] == [
        {"id": "d", "reason": "mode disagg: disaggregated serving (prefill and decode workers) is not simulated"},
        {"id": "e", "reason": "no operator tables for system b200_sxm (tables for h100_sxm)"}]
    rows = pd.read_csv(out / "validate.csv")
    assert rows["id"].tolist() == ["a", "b", "c"]
    assert rows["concurrency"].tolist() == [2, 4, 2]  # row b's source column wins over its batch_size
    assert rows["tp"].tolist() == [1, 2, 1]
    vllm = rows[rows["backend"] == "vllm"]
    group = next(g for g in summary["groups"] if g["backend"] == "vllm")
    assert group["ttft_mape"] == pytest.approx(vllm["ttft_error_pct"].abs().mean(), rel=1e-12)
    assert group["tpot_mape"] == pytest.approx(vllm["tpot_error_pct"].abs().mean(), rel=1e-12)
    assert summary["all"]["rows"] == 3
    # Client-side TTFT: the API server's fixed 1 ms and 2 us per prompt token come on top of the engine's.
    assert (rows["predicted_ttft_ms"] >= rows["predicted_engine_ttft_ms"] + 1.0 + 0.002 * 0.8 * 64).all()
    assert "Predicted against measured" in (out / "report.html").read_text()
    # sim report on the folder says whose page its report.html is (it said "nothing to report")
    with pytest.raises(ServesimError, match="the measured deployments of sim validate; its report.html is sim "
                                            "validate's own page"):
        from reports.html import folder_report

        folder_report(out)


def test_validate_refuses_a_file_without_its_columns(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("id,system\nx,h100_sxm\n")
    ops = tmp_path / "ops"
    ops.mkdir()
    write_tables(ops, system="h100_sxm")
    assert main(["validate", str(bad), "--ops", str(ops), "--out", str(tmp_path / "o")]) == 2
    assert "bad.csv: lacks column(s) backend, backend_version" in capsys.readouterr().err


@pytest.mark.parametrize("column, value, message", [
    ("tp_size", 0, "tp_size must be a positive whole number, got 0"),
    ("isl", -5, "isl must be a positive whole number, got -5"),
    ("osl", 2.5, "osl must be a positive whole number, got 2.5"),
    ("osl", 1, "osl must be at least 2 for the row's TPOT (the time between output tokens), got 1"),
    ("silicon_ttft_ms", "", "silicon_ttft_ms must be a positive number, got ''"),
    ("silicon_tpot_ms", "nan", "silicon_tpot_ms must be a positive number"),
    ("pp_size", "two", "pp_size must be a positive whole number, got 'two'"),
    ("backend_version", "0.12.x", "backend_version must be a release such as 0.12.0 or a build's name, got '0.12.x'"),
    ("backend_version", "nightly dev", "backend_version must be a release such as 0.12.0 or a build's name"),
    # Past sim bench's bounds: skipped naming flags never given (--max-model-len, --max-num-batched-tokens), or
    # run for hours (a million clients).
    ("isl", 10**12, "isl is 1,000,000,000,000, more than 16,777,216 tokens"),
    ("osl", 10**9, "osl is 1,000,000,000, more than 16,777,216 tokens"),
    ("isl", 16_777_210, "isl + osl is 16,777,226 tokens, more than 16,777,216"),
    ("tp_size", 10**6, "tp_size is 1,000,000, more than 1,024 GPUs"),
    ("batch_size", 10**9, "batch_size is 1,000,000,000, more than 1,048,576 requests"),
    ("batch_size", "abc", "batch_size must be a positive whole number, got 'abc'"),  # (it said concurrency)
    ("isl", "", "isl must be a positive whole number, got ''"),  # (a blank cell: it said nan)
    ("batch_size", 2**20, "concurrency 1,048,576 x --prompts-per-client 10 is 10,485,760 requests, more than "
                          "10,000,000"),
    # Found by a review with odd files: no deployment's measurement, and a version read as a number.
    ("silicon_tpot_ms", 1e-300, "silicon_tpot_ms is 1e-300 ms, less than 0.001 ms (a microsecond to 11 days: no "
                                "deployment measures outside them)"),
    ("silicon_ttft_ms", 1e300, "silicon_ttft_ms is 1e+300, more than 1,000,000,000 ms (a microsecond to 11 days: no "
                               "deployment measures outside them)"),
    ("backend_version", "1e3", "backend_version must be a release such as 0.12.0 or a build's name, got '1e3'"),
])
def test_a_malformed_row_is_refused_naming_the_row_column_and_value(tmp_path, capsys, column, value, message):
    """Before, these ended in a traceback (tp_size 0, a negative ISL, a blank TTFT) or were read as
    something else (backend_version '0.12.x': the newest tables)."""
    csv, ops, models = setup(tmp_path)
    rows = measured_rows()
    rows[0][column] = value
    pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"measured.csv: row 1 (a): {message}" in err and "Traceback" not in err


def test_the_packages_own_conventions_are_read_not_refused(tmp_path):
    """AIConfigurator's package writes 0 in a dense model's layout columns (not stated) and rows of
    builds (nightly-<commit>, gpt-oss-dev): both were refused, and the whole file with them."""
    csv, ops, models = setup(tmp_path)
    rows = [dict(r, attention_dp_size="", moe_tp_size=0, moe_ep_size=0.0) for r in measured_rows()[:2]]
    rows[1]["backend_version"] = "nightly-5b8c30d62b754b57"  # (SGLang's rows write nightly-dev)
    columns = COLUMNS + ["attention_dp_size", "moe_tp_size", "moe_ep_size"]
    pd.DataFrame(rows, columns=columns).to_csv(csv, index=False)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet"]) == 0
    frame = pd.read_csv(out / "validate.csv", keep_default_na=False)
    assert frame["id"].tolist() == ["a", "b"]
    assert frame["tables"][1] == frame["tables"][0]  # a nightly build: the newest tables, as without a version
    assert frame["notes"][1] == "backend_version nightly-5b8c30d62b754b57: a build, not a release: priced with the " \
        "newest tables"
    rows[0]["moe_ep_size"] = -1  # still a number that cannot be a layout
    pd.DataFrame(rows, columns=columns).to_csv(csv, index=False)
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(tmp_path / "o2"),
                 "--quiet"]) == 2


def test_whole_numbers_written_as_floats_read_as_the_same_row(tmp_path):
    """pandas writes an integer column that has a blank as floats (tp_size 2.0, isl 64.0): check_row
    accepts them as whole, and they were then read with int("2.0"), an internal error."""
    csv, ops, models = setup(tmp_path)
    rows = measured_rows()[:2] + [dict(measured_rows()[3], tp_size="")]  # a disaggregated row states no tp_size
    out = tmp_path / "ints"
    pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet"]) == 0
    floats = tmp_path / "floats.csv"
    text = pd.DataFrame(rows, columns=COLUMNS).astype({c: float for c in ("isl", "osl", "batch_size")})
    text["tp_size"] = ["1.0", "2.0", ""]
    text.to_csv(floats, index=False)
    assert ",2.0," in floats.read_text()
    out2 = tmp_path / "floats"
    assert main(["validate", str(floats), "--ops", str(ops), "--models", str(models), "--out", str(out2),
                 "--quiet"]) == 0
    a, b = pd.read_csv(out / "validate.csv"), pd.read_csv(out2 / "validate.csv")
    assert b["tp"].tolist() == [1, 2] and b["isl"].tolist() == [64, 64]
    pd.testing.assert_frame_equal(a, b)


def test_a_mode_that_is_neither_agg_nor_disagg_is_skipped_saying_so():
    from sim.app.validate import skip_reason

    row = dict(measured_rows()[0], mode="")
    assert skip_reason(row, ["h100_sxm"], None) == "mode '': only aggregated serving (mode agg) is simulated"


def test_an_unknown_model_is_skipped_not_guessed(tmp_path, capsys):
    csv, ops, _ = setup(tmp_path)
    out = tmp_path / "out"
    # Every row skipped: the validation is written, and a warning says nothing was validated.
    assert main(["validate", str(csv), "--ops", str(ops), "--out", str(out), "--quiet"]) == 0
    assert "sim: warning: none of the 5 rows could be simulated" in capsys.readouterr().err
    skipped = json.loads((out / "validate.json").read_text())["skipped"]
    assert skipped[0] == {"id": "a", "reason": "no config for org/toy: give --models DIR holding org/toy/config.json"}


@pytest.mark.parametrize("source, message", [
    ("f.csv; silicon_concurrency=8.5", "silicon_data_source's silicon_concurrency must be a positive whole number, "
                                       "got '8.5'"),
    ("f.csv; silicon_concurrency=-4", "got '-4'"),
    ("silicon_concurrency=", "got ''"),
])
def test_a_malformed_stated_concurrency_is_refused_not_read_as_another(tmp_path, capsys, source, message):
    csv, ops, models = setup(tmp_path)
    rows = measured_rows()
    rows[0]["silicon_data_source"] = source
    pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "measured.csv: row 1 (a): silicon_data_source's silicon_concurrency" in err and message in err


def test_only_the_stated_concurrency_key_is_read():
    from sim.app.validate import STATED_CONCURRENCY

    sources = pd.Series(["f.csv; silicon_concurrency=16", "max_silicon_concurrency=64", "silicon_concurrency=8"])
    assert sources.str.extract(STATED_CONCURRENCY)[0].tolist()[::2] == ["16", "8"]
    assert pd.isna(sources.str.extract(STATED_CONCURRENCY)[0][1])


def test_an_empty_file_or_tables_folder_is_refused(tmp_path, capsys):
    csv, ops, models = setup(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["validate", str(csv), "--ops", str(empty), "--models", str(models), "--out", str(tmp_path / "o")]) == 2
    assert f"{empty}: holds no operator tables" in capsys.readouterr().err
    header = tmp_path / "header.csv"
    header.write_text(",".join(COLUMNS) + "\n")
    assert main(["validate", str(header), "--ops", str(ops), "--out", str(tmp_path / "o")]) == 2
    assert "header.csv: holds no rows, only a header" in capsys.readouterr().err


def test_a_dense_rows_data_parallel_ranks_are_skipped_saying_so(tmp_path):
    csv, ops, models = setup(tmp_path)
    rows = [dict(measured_rows()[0], attention_dp_size=4), measured_rows()[0]]
    rows[1]["id"] = "one-rank"
    pd.DataFrame(rows, columns=[*COLUMNS, "attention_dp_size"]).to_csv(csv, index=False)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "validate.json").read_text())
    assert summary["skipped"][0]["id"] == "a" and "attention_dp_size 4 on a dense model" in summary["skipped"][0]["reason"]
    assert summary["all"]["rows"] == 1


@pytest.mark.skipif(not (SHARED / "silicon_llama3.1.csv").exists(), reason="needs ../shared/gpu-data")
def test_validate_on_a_cut_of_the_shared_measurements(tmp_path):
    frame = pd.read_csv(SHARED / "silicon_llama3.1.csv", keep_default_na=False)
    ids = ["2026_04_06_llama_3_1_70b_h200_sxm_vllm_fp8_agg_1024x1024_c4_tp8_ep1_728",
           "2026_04_06_llama_3_1_70b_h200_sxm_vllm_fp8_agg_1024x1024_c8_tp8_ep1_681",
           "2026_04_06_llama_3_1_70b_h100_sxm_vllm_fp8_agg_8192x1024_c4_tp4_ep1_698",
           "2026_04_06_llama_3_1_70b_b200_sxm_trtllm_fp4_agg_1024x1024_c8_tp2_ep1_257"]
    cut = pd.concat([frame[frame["id"].isin(ids)], frame[frame["backend"] == "trtllm"].head(1)])
    assert len(cut) == 5
    csv = tmp_path / "cut.csv"
    cut.to_csv(csv, index=False)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--ops", str(SHARED), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "validate.json").read_text())
    assert [(g["system"], g["backend"], g["rows"]) for g in summary["groups"]] == \
        [("h100_sxm", "vllm", 1), ("h100_sxm", "trtllm", 1), ("h200_sxm", "vllm", 2)]
    assert summary["skipped"] == [{"id": ids[3], "reason": "no operator tables for system b200_sxm (tables for h100_sxm, "
                                                           "h200_sxm)"}]
    rows = pd.read_csv(out / "validate.csv")
    vllm = rows[rows["backend"] == "vllm"]
    assert (vllm["tpot_error_pct"].abs() < 10).all() and (vllm["ttft_error_pct"].abs() < 30).all()


@pytest.mark.parametrize("async_scheduling,ttft", [(False, 1.0), (True, 2.0)])
def test_async_scheduling_makes_a_new_request_wait_one_step_more(async_scheduling, ttft):
    """Steps of 1 s, two clients. a (3 tokens) and b (5 tokens) prefill in [0, 1]; a's third token
    ends it at 3 and c is sent then. Synchronously c joins the step starting at 3 (first token at
    4); asynchronously the step [3, 4] was scheduled at 2, so c first runs in [4, 5]."""
    from backends.costmodel.optables.profile import ClientOverhead
    from policies import load_policy
    from sim.app.validate import ThroughApiServer
    from sim.arrivals import simulate
    from sim.block_manager import BlockManager
    from sim.config import SchedulerConfig
    from sim.engine import Engine, TokenTimes
    from sim.request import Request
    from tests.helpers import ConstantBackend

    requests = [Request(0, "a", 0.0, 4, 3), Request(1, "b", 0.0, 4, 5), Request(2, "c", 0.0, 4, 2)]
    engine = Engine(load_policy("chunked")(SchedulerConfig(async_scheduling=async_scheduling)), ConstantBackend(1.0),
                    BlockManager(64, 16, False), TokenTimes(requests), 100)
    workload = ThroughApiServer(requests, [0.0] * 3, 2, engine, ClientOverhead(0.0, 0.0), False)  # the engine's
    simulate(engine, workload)
    assert [r.first_token_s for r in requests[:2]] == [1.0, 1.0] and requests[0].finish_s == 3.0
    assert workload.sent_s[2] == 3.0 and requests[2].first_token_s - workload.sent_s[2] == ttft


def test_the_kv_cache_dtype_comes_from_the_sources_launch_scripts():
    """InferenceMAX's H200 scripts set an fp8 KV cache, its H100 vLLM script none; a row of an
    unknown source gets vLLM's default. --kv-cache-dtype auto|fp8 overrides every row."""
    from sim.app.validate import LAUNCH_RECIPES, Protocol

    imax = "source_file=2026-04-06.csv; model=Llama-3.1-70B; ; measured=2025-10-29T00:00:00.000Z; wip=False"
    other = "source_file=/data/h200_sxm/vllm/0.12.0/x.csv; silicon_concurrency=8"
    row = {"silicon_data_source": imax, "backend": "vllm", "system": "h200_sxm", "model_path": "meta-llama/Llama-3.1-70B"}
    assert Protocol().kv_cache_for(row) == ("fp8", LAUNCH_RECIPES[0].cites)
    assert "70b_fp8_h200_slurm.sh" in LAUNCH_RECIPES[0].cites
    assert Protocol().kv_cache_for({**row, "backend": "trtllm"})[0] == "fp8"
    assert Protocol().kv_cache_for({**row, "system": "h100_sxm"})[0] == "auto"
    assert Protocol().kv_cache_for({**row, "silicon_data_source": other}) == (
        "auto", "not stated by the row or its source: vLLM's default, auto")
    assert Protocol(kv_cache_dtype="auto").kv_cache_for(row) == ("auto", "--kv-cache-dtype auto")
    # B200 (70b_fp8_b200_docker.sh, 70b_fp4_b200_docker.sh): an fp8 KV cache, and FlashInfer's
    # all-reduce fusion up to the sizes its VLLM_FLASHINFER_ALLREDUCE_FUSION_THRESHOLDS_MB gives per TP.
    b200 = {**row, "system": "b200_sxm", "tp_size": 8}
    assert Protocol().kv_cache_for(b200)[0] == "fp8" and "70b_fp8_b200_docker.sh" in Protocol().kv_cache_for(b200)[1]
    assert Protocol().allreduce_fusion_bytes(b200) == 8 * 2**20
    assert Protocol().allreduce_fusion_bytes({**b200, "tp_size": 4}) == 32 * 2**20
    assert Protocol().allreduce_fusion_bytes({**b200, "tp_size": 1}) == 0.0
    assert Protocol().allreduce_fusion_bytes({**row, "tp_size": 8}) == 0.0  # H200's script: no fusion
    assert Protocol().kv_cache_for({**b200, "backend": "trtllm"})[0] == "fp8"
    with pytest.raises(ServesimError, match="unknown --kv-cache-dtype 'bf8'"):
        Protocol(kv_cache_dtype="bf8")


def test_a_launch_recipe_is_its_scripts_model_and_gives_its_token_budget():
    """A recipe cites one model's script: the Llama-3.1-70B scripts say nothing of another model
    served on the same GPU by the same source. InferenceX's MiniMax-M2.5 B300 scripts set an fp8 KV
    cache and --max-num-batched-tokens "$((ISL * 2))" (both checkpoints), its gpt-oss B200 script an
    fp8 KV cache and 8192, its gpt-oss H100 and H200 scripts no KV dtype; the database dumps
    (`db-dump/...`) are the same runs as the dashboard's exports."""
    from sim.app.validate import DEFAULT_BUDGET, KV_DEFAULT, Protocol

    export = "source_file=2026-04-06.csv; model=MiniMax-M2.5; ; measured=2026-04-03T00:00:00.000Z; wip=False"
    dump = "db-dump/2026-04-27; config_id=732; ; measured=2026-04-17T00:00:00.000Z; workflow_run_id=758"
    minimax = {"backend": "vllm", "system": "b300_sxm", "model_path": "MiniMaxAI/MiniMax-M2.5", "precision": "fp8",
               "isl": 8192, "concurrency": 16}
    for source in (export, dump):
        row = {**minimax, "silicon_data_source": source}
        kv, why = Protocol().kv_cache_for(row)
        assert kv == "fp8" and "minimaxm2.5_fp8_b300.sh" in why
        assert Protocol().budget_for(row) == 2 * 8192
        assert Protocol().budget_for({**row, "isl": 1024, "concurrency": 4096}) == 4096  # at least one token each
        assert Protocol(max_num_batched_tokens=4096).budget_for(row) == 4096  # the flag, for every row
        assert Protocol().budget_for({**row, "precision": "fp4"}) == 2 * 8192
    # On B200 the script of vLLM 0.19.0's days is the one the B300 script copied; 0.17.0's set neither.
    b200_minimax = {**minimax, "system": "b200_sxm", "silicon_data_source": dump, "backend_version": "0.19.0"}
    assert Protocol().kv_cache_for(b200_minimax)[0] == "fp8" and Protocol().budget_for(b200_minimax) == 2 * 8192
    assert Protocol().budget_for({**b200_minimax, "backend_version": "nightly-5b8c30d62b754b57"}) == 2 * 8192
    early = {**b200_minimax, "backend_version": "0.17.0"}
    assert Protocol().kv_cache_for(early) == ("auto", KV_DEFAULT) and Protocol().budget_for(early) == DEFAULT_BUDGET
    # The Llama-3.1-70B H200 script's fp8 cache is not MiniMax's on H200 (its scripts disagree): the default.
    h200 = {**minimax, "system": "h200_sxm", "silicon_data_source": export}
    assert Protocol().kv_cache_for(h200) == ("auto", KV_DEFAULT) and Protocol().budget_for(h200) == DEFAULT_BUDGET
    gptoss = {**h200, "model_path": "openai/gpt-oss-120b", "precision": "fp4"}
    assert Protocol().kv_cache_for(gptoss)[0] == "auto" and "gptoss_fp4_h200.sh" in Protocol().kv_cache_for(gptoss)[1]
    b200 = {**gptoss, "system": "b200_sxm"}
    assert Protocol().kv_cache_for(b200)[0] == "fp8" and Protocol().allreduce_fusion_bytes({**b200, "tp_size": 8}) == 0
    # gpt-oss's H100 and H200 scripts set VLLM_MXFP4_USE_MARLIN=1 (the experts run Marlin), its B200 one
    # VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1; every other recipe and source leaves vLLM's own choice.
    for system in ("h100_sxm", "h200_sxm"):
        assert Protocol().moe_kernel_for({**gptoss, "system": system}) == "marlin"
    assert Protocol().moe_kernel_for(b200) == "flashinfer-mxfp8" and Protocol().moe_kernel_for(minimax) == "auto"
    assert Protocol().moe_kernel_for({**gptoss, "silicon_data_source": "source_file=gap.csv"}) == "auto"
    assert Protocol(moe_kernel="auto").moe_kernel_for({**gptoss, "system": "h100_sxm"}) == "auto"  # the flag wins
    assert Protocol(moe_kernel="marlin").moe_kernel_for(minimax) == "marlin"
    # Every gpt-oss script's config.yaml sets max-cudagraph-capture-size: 2048; the others leave vLLM's default.
    assert {Protocol().cuda_graphs_for({**gptoss, "system": system}) for system in ("h100_sxm", "h200_sxm")} == {2048}
    assert Protocol().cuda_graphs_for(b200) == 2048 and Protocol().cuda_graphs_for(minimax) is None
    with pytest.raises(ServesimError, match="unknown --moe-kernel 'cutlass'; choose recipe, auto, marlin"):
        Protocol(moe_kernel="cutlass")
    # Kimi-K2.5's int4 scripts set no KV dtype; its fp4 scripts disagree, so no recipe.
    kimi = {**b200, "model_path": "moonshotai/Kimi-K2.5", "precision": "int4"}
    assert "kimik2.5_int4_b200.sh" in Protocol().kv_cache_for(kimi)[1]
    assert Protocol().kv_cache_for({**kimi, "precision": "fp4"}) == ("auto", KV_DEFAULT)
    # Another source's row: no recipe.
    assert Protocol().kv_cache_for({**minimax, "silicon_data_source": "source_file=gap.csv"}) == ("auto", KV_DEFAULT)
    with pytest.raises(ServesimError, match=r"--warmup-waves must be auto or in \[0, --prompts-per-client\), got 10"):
        Protocol(warmup_waves=10)


@pytest.mark.slow  # two validate runs over a deployment table
def test_an_fp8_kv_cache_holds_twice_the_tokens_and_validate_csv_says_why(tmp_path):
    csv, ops, models = setup(tmp_path)
    frame = pd.read_csv(csv, keep_default_na=False)
    frame.loc[0, "silicon_data_source"] = "source_file=2026-04-06.csv; model=toy; ; measured=2025-10-29"
    frame.loc[0, "system"] = "h100_sxm"
    frame.to_csv(csv, index=False)
    out, out8 = tmp_path / "out", tmp_path / "out8"
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet"]) == 0
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out8), "--quiet",
                 "--kv-cache-dtype", "fp8"]) == 0
    rows, rows8 = pd.read_csv(out / "validate.csv"), pd.read_csv(out8 / "validate.csv")
    assert rows["kv_cache_dtype"].tolist() == ["auto"] * 3 and rows8["kv_cache_dtype"].tolist() == ["fp8"] * 3
    # InferenceMAX's Llama-3.1-70B scripts do not speak for another model on the same GPU: vLLM's default.
    assert rows["kv_cache_dtype_from"].tolist() == ["not stated by the row or its source: vLLM's default, auto"] * 3
    assert rows["max_num_batched_tokens"].tolist() == [8192] * 3
    # Same GPU memory, half the bytes per token: about twice the blocks (vLLM's plan, less rounding).
    tp1 = rows["tp"] == 1  # (row b's TP 2 cache is capped at the block table's limit)
    assert (rows8["num_gpu_blocks"][tp1] / rows["num_gpu_blocks"][tp1]).between(1.95, 2.05).all()


@pytest.mark.slow
def test_the_physical_check_flags_rows_faster_than_the_tables_gemms(tmp_path):
    """The implied token rate is C x (mean prompt + mean output - 1) / (TTFT + (mean output - 1) x
    TPOT): a row whose measured times are far below what its steps cost is flagged; the toy rows'
    1 ms and 0.1 ms are not."""
    csv, ops, models = setup(tmp_path)
    frame = pd.read_csv(csv, keep_default_na=False)
    frame.loc[1, ["silicon_ttft_ms", "silicon_tpot_ms"]] = [1e-3, 1e-3]  # (a microsecond: the least a row may state)
    frame.to_csv(csv, index=False)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet"]) == 0
    rows = pd.read_csv(out / "validate.csv")
    rng = np.random.default_rng(0)  # row b: 10 x C = 40 prompts, prompt lengths drawn first
    isls, osls = rng.integers(int(0.8 * 64), 65, size=40), rng.integers(int(0.8 * 16), 17, size=40)
    want = 4 * (isls.mean() + osls.mean() - 1) / (1e-6 + (osls.mean() - 1) * 1e-6)
    assert rows["implied_tokens_per_s"][1] == pytest.approx(want, rel=1e-9)
    assert rows["faster_than_tables"].tolist() == [False, True, False]
    assert (rows["tables_max_tokens_per_s"] > 0).all()
    assert "imply a token rate above" in (out / "report.html").read_text()
    # Its measured TTFT (1 ns) is also below what 4 prompts sent together allow: its first wave is left out.
    assert rows["warmup_waves"].tolist() == [0, 1, 0]
    assert rows["warmup_from"][1].startswith("measured TTFT 0 ms is below the")


def test_the_first_wave_bound_and_the_scheduling_per_row():
    """C prompts sent together at the start: the i-th waits for i prompts through the GEMMs, so the
    mean TTFT over C x K requests is at least (C + 1) / 2 x prompt / rate / K. vLLM schedules
    asynchronously by default from 0.14."""
    from sim.app.validate import Protocol, first_wave_ttft_bound_ms

    assert first_wave_ttft_bound_ms(3, 1000.0, 10_000.0, 10) == pytest.approx(1e3 * 2 * 0.1 / 10)
    row = {"backend": "vllm", "backend_version": "0.12.0", "silicon_ttft_ms": 50.0}
    assert Protocol().async_for(row) is False
    assert Protocol().async_for({**row, "backend_version": "0.14.1"}) is True
    assert Protocol().async_for({**row, "backend_version": ""}) is True  # InferenceMAX: --async-scheduling
    assert Protocol().async_for({**row, "backend": "sglang"}) is True
    assert Protocol(async_scheduling=True).async_for(row) is True
    assert Protocol().warmup_for(row, 60.0)[0] == 1 and Protocol().warmup_for(row, 40.0)[0] == 0
    assert Protocol(warmup_waves=0).warmup_for(row, 60.0) == (0, "--warmup-waves 0")
    # One prompt a client: the first wave is every request, so auto counts it (leaving it out left no
    # request: NaN means and a "nan%" MAPE).
    waves, why = Protocol(prompts_per_client=1).warmup_for(row, 60.0)
    assert waves == 0 and why.endswith("with --prompts-per-client 1 the first wave is every request: counted")


def test_warmup_waves_leave_the_first_wave_out_of_the_means():
    """Steps of 1 s, 2 clients, a budget of 4 tokens: the first wave (a, b: 4-token prompts) queues
    for prefill: a's first token at 1; b's chunks share the budget with a's decodes (3 tokens, then
    1), its first token at 3; c and d are sent as a and b end. With one warm-up wave only c and d
    count."""
    from backends.costmodel.optables.profile import ClientOverhead
    from policies import load_policy
    from sim.app.validate import ThroughApiServer, client_means
    from sim.arrivals import simulate
    from sim.block_manager import BlockManager
    from sim.config import SchedulerConfig
    from sim.engine import Engine, TokenTimes
    from sim.request import Request
    from tests.helpers import ConstantBackend

    requests = [Request(i, name, 0.0, 4, 3) for i, name in enumerate("abcd")]
    engine = Engine(load_policy("chunked")(SchedulerConfig("chunked", 4, 2)), ConstantBackend(1.0),
                    BlockManager(64, 16, False), TokenTimes(requests), 100)
    workload = ThroughApiServer(requests, [0.0] * 4, 2, engine, ClientOverhead(0.0, 0.0), False)
    simulate(engine, workload)
    ttft = {r.request_id: r.first_token_s - workload.sent_s[r.index] for r in requests}
    assert ttft["a"] == 1.0 and ttft["b"] == 3.0
    assert client_means(requests, workload.sent_s)[0] == pytest.approx(sum(ttft.values()) / 4, rel=1e-12)
    assert client_means(requests, workload.sent_s, 2)[0] == pytest.approx((ttft["c"] + ttft["d"]) / 2, rel=1e-12)


def test_a_bad_warmup_waves_is_a_one_line_error(tmp_path, capsys):
    csv, ops, models = setup(tmp_path)
    assert main(["validate", str(csv), "--ops", str(ops), "--out", str(tmp_path / "o"), "--warmup-waves", "x"]) == 2
    assert "--warmup-waves must be auto or a whole number, got 'x'" in capsys.readouterr().err


def test_unique_prompts_cycle_a_dataset_and_hit_the_prefix_cache():
    """--unique-prompts 2: requests send prompts 0, 1, 0, 1 (each prompt keeps its length, each
    request its output length); a prompt sent again finds its blocks cached (all but the last
    token's block, as vLLM: 48 of 64 tokens, then 16 of 20)."""
    from backends.costmodel.optables.profile import ClientOverhead
    from policies import load_policy
    from sim.app.validate import Protocol, ThroughApiServer
    from sim.arrivals import simulate
    from sim.block_manager import BlockManager
    from sim.config import SchedulerConfig
    from sim.engine import Engine, TokenTimes
    from tests.helpers import ConstantBackend

    requests = Protocol(unique_prompts=2).requests([64, 20, 30, 40], [2, 3, 4, 5])
    assert [r.num_prompt_tokens for r in requests] == [64, 20, 64, 20]
    assert [r.max_tokens for r in requests] == [2, 3, 4, 5]
    assert (requests[0].hash_ids == requests[2].hash_ids).all() and requests[0].hash_ids[0] != requests[1].hash_ids[0]
    assert all(r.hash_ids is None for r in Protocol().requests([64, 20], [2, 3]))
    engine = Engine(load_policy("chunked")(SchedulerConfig("chunked", 256, 1)), ConstantBackend(1.0),
                    BlockManager(64, 16, True), TokenTimes(requests), 100)
    simulate(engine, ThroughApiServer(requests, [0.0] * 4, 1, engine, ClientOverhead(0.0, 0.0), False))
    assert [r.num_prefix_hit_tokens for r in requests] == [0, 0, 48, 16]
    with pytest.raises(ServesimError, match="--unique-prompts must be 0"):
        Protocol(unique_prompts=-1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fast_forward_gives_the_same_validation_run_with_long_prompts(async_scheduling):
    """vLLM's benchmark client through the API server (`ThroughApiServer`, which delivers by the
    times it is given) with prompts of several budgets each: chunk runs and decode runs give the
    answers of stepping one by one, with and without async scheduling."""
    from backends.costmodel.optables.profile import ClientOverhead
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.app.validate import ThroughApiServer
    from sim.arrivals import simulate
    from sim.config import SchedulerConfig
    from sim.engine import Engine, TokenTimes
    from sim.request import Request

    results = []
    for fast_forward in (True, False):
        plan = resolve(ReplayOptions(scheduler=SchedulerConfig("chunked", 2048, 4, 20_000)), None)
        requests = [Request(i, str(i), 0.0, 7000 + 300 * i, 40 + i) for i in range(12)]
        engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), TokenTimes(requests), 20_000,
                        fast_forward=fast_forward)
        workload = ThroughApiServer(requests, [0.0] * 12, 4, engine, ClientOverhead(0.002, 1e-6), async_scheduling)
        results.append((simulate(engine, workload), workload.sent_s))
    (fast, fast_sent), (slow, slow_sent) = results
    assert fast_sent == slow_sent
    assert [r.arrival_s for r in fast.requests] == [r.arrival_s for r in slow.requests]
    np.testing.assert_array_equal(fast.token_times, slow.token_times)
    fc, sc = fast.steps.columns(), slow.steps.columns()
    assert all(np.array_equal(fc[k], sc[k], equal_nan=True) for k in fc)


def test_a_launch_scripts_kernel_the_tables_do_not_measure_is_said_per_row():
    from sim.app.validate import kernel_caveats

    row = {"silicon_data_source": "source_file=2026-04-06.csv; model=GPT-OSS-120B; image=vllm/vllm-openai:v0.18.0",
           "backend": "vllm", "system": "h100_sxm", "model_path": "openai/gpt-oss-120b"}
    (caveat,) = kernel_caveats(row)
    assert "VLLM_MXFP4_USE_MARLIN=1" in caveat and "gptoss_fp4_h100.sh" in caveat
    (caveat,) = kernel_caveats({**row, "system": "h200_sxm"})  # the H200 script sets it too
    assert "VLLM_MXFP4_USE_MARLIN=1" in caveat and "gptoss_fp4_h200.sh" in caveat
    # The nvfp4 GEMM caveat is the Llama-3.1-70B fp4 rows' (gpt-oss's experts are MXFP4, no nvfp4 GEMM);
    # gpt-oss's B200 script runs the experts with MXFP8 activations, which the tables do not measure.
    (caveat,) = kernel_caveats({**row, "system": "b200_sxm", "precision": "fp4"})
    assert "VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1" in caveat and "MARLIN" not in caveat
    llama = {**row, "system": "b200_sxm", "precision": "fp4", "model_path": "meta-llama/Llama-3.1-70B"}
    assert len(kernel_caveats(llama)) == 1 and "FlashInferCuteDslNvFp4LinearKernel" in kernel_caveats(llama)[0]
    assert kernel_caveats({**row, "model_path": "Qwen/Qwen3-235B-A22B-FP8"}) == []
    # The gap analysis's rows: no launch-script kernel, but the front end they were measured through
    (caveat,) = kernel_caveats({**row, "silicon_data_source": "source_file=/x/aic-auto-gap-analysis/a.csv"})
    assert "Dynamo" in caveat and "genai-perf" in caveat and "MARLIN" not in caveat
    # B200's fp4 rows: the one nvfp4 GEMM kernel the tables measure (vLLM 0.24's); not its fp8 rows.
    b200 = {**row, "system": "b200_sxm", "model_path": "meta-llama/Llama-3.1-70B", "precision": "fp4"}
    (caveat,) = kernel_caveats(b200)
    assert "FlashInferCuteDslNvFp4LinearKernel" in caveat
    assert kernel_caveats({**b200, "precision": "fp8"}) == []


@pytest.mark.parametrize("version, release", [
    ("0.12.0", True), ("1.0.0rc3", True), ("0.5.6.post2", True), ("1.1.0rc2.post2", True), ("0.19.0+cu130", True),
    ("0.12", True), ("nightly-5b8c30d62b754b57", True), ("nightly-dev", True), ("nightly", True), ("nightly-", True),
    ("gpt-oss-dev", True), ("0.12.x", False), ("0.19.0-x", False), ("nightly dev", False)])
def test_the_versions_a_row_may_state(version, release):
    from sim.app.validate import ROW_VERSION

    assert bool(ROW_VERSION.fullmatch(version)) is release


def test_vllms_client_sends_its_test_request_first():
    """InferenceMAX's benchmark_serving.py, as vllm/benchmarks/serve.py `benchmark`: one test request,
    the first prompt and its output length, before the benchmark; AIPerf's client (unique prompts)
    sends none, nor does a protocol with the test request off."""
    from sim.app.validate import Protocol

    protocol = Protocol()
    isls, osls = protocol.lengths(1000, 100, 8)
    requests = protocol.requests(isls, osls)
    (stage,) = protocol.warmup_stages(requests)
    (test,) = stage
    assert (test.num_prompt_tokens, test.max_tokens) == (isls[0], osls[0]) and test.index == len(requests)
    assert Protocol(unique_prompts=4).warmup_stages(requests) == []
    assert Protocol(test_request=False).warmup_stages(requests) == []


def many_rows(n: int = 20) -> list[dict]:
    """`measured_rows`' kinds again and again, with other sizes: several deployments and skipped rows."""
    rows = []
    for k in range(n):
        row = dict(measured_rows()[k % 5], id=f"r{k}")
        row["batch_size"] = row["batch_size"] + k % 3
        rows.append(row)
    return rows


@pytest.mark.slow
def test_jobs_give_the_same_files_as_one_process(tmp_path):
    """--jobs N runs the rows in N worker processes (sim/app/workers.py), a deployment's rows together
    where they can be: the same validate.csv and validate.json, in the same order, as one process."""
    csv, ops, models = setup(tmp_path)
    pd.DataFrame(many_rows(), columns=COLUMNS).to_csv(csv, index=False)
    written = {}
    for jobs in ("1", "3"):
        out = tmp_path / f"jobs{jobs}"
        assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet",
                     "--jobs", jobs]) == 0
        written[jobs] = {name: (out / name).read_bytes() for name in ("validate.csv", "validate.json")}
    assert written["1"] == written["3"]
    assert pd.read_csv(tmp_path / "jobs3" / "validate.csv")["id"].tolist() == \
        [f"r{k}" for k in range(20) if k % 5 in (0, 1, 2)]


@pytest.mark.slow
def test_jobs_refuse_the_first_malformed_row_as_one_process_does(tmp_path, capsys):
    csv, ops, models = setup(tmp_path)
    rows = many_rows()
    rows[17]["tp_size"] = 0
    rows[2]["silicon_ttft_ms"] = -1.0  # the first refused, whichever worker meets the other first
    pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
    for jobs in ("1", "2"):
        assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out",
                     str(tmp_path / f"o{jobs}"), "--quiet", "--jobs", jobs]) == 2
        err = capsys.readouterr().err
        assert "measured.csv: row 3 (r2): silicon_ttft_ms" in err and "Traceback" not in err


def _a_worker_that_dies(*args):
    """In place of `_run_rows` in a worker process: the process ends as one killed (the OOM killer) ends."""
    import os

    os._exit(9)


@pytest.mark.slow
def test_jobs_name_a_worker_that_died(tmp_path, capsys, monkeypatch):
    # A worker process killed while it ran rows (the OOM killer, kill -9) was an internal error
    # (BrokenProcessPool); it is named, with what to do, and the command ends as for any refusal.
    from sim.app import validate as validate_module

    csv, ops, models = setup(tmp_path)
    pd.DataFrame(many_rows(), columns=COLUMNS).to_csv(csv, index=False)
    monkeypatch.setattr(validate_module, "_run_rows", _a_worker_that_dies)
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(tmp_path / "o"),
                 "--quiet", "--jobs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and "worker process" in err and "--jobs 1" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not (SHARED / "silicon_llama3.1.csv").exists(), reason="needs ../shared/gpu-data")
def test_the_gap_analysis_rows_say_they_were_measured_through_dynamo(tmp_path):
    """Every row of AIConfigurator's gap analysis, dense or MoE, any framework, says in validate.csv's
    notes that it was measured through Dynamo's front end, which servesim does not model; no other row does."""
    import pandas as pd

    from sim.app.validate import FRONT_END_CAVEAT

    rows = pd.read_csv(SHARED / "silicon_qwen3_32b_tp2.csv").head(1)
    llama = pd.read_csv(SHARED / "silicon_llama3.1.csv")
    gap = llama[llama["silicon_data_source"].str.contains("aic-auto-gap-analysis")]
    other = llama[~llama["silicon_data_source"].str.contains("aic-auto-gap-analysis")]
    cut = pd.concat([rows, gap[gap["backend"] == "sglang"].head(1), other[other["system"] == "h100_sxm"].head(1)])
    cut.to_csv(tmp_path / "cut.csv", index=False)
    out = tmp_path / "out"
    assert main(["validate", str(tmp_path / "cut.csv"), "--ops", str(SHARED), "--out", str(out), "--quiet",
                 "--jobs", "1"]) == 0
    notes = pd.read_csv(out / "validate.csv", keep_default_na=False)["notes"].tolist()
    assert [FRONT_END_CAVEAT in n for n in notes] == [True, True, False]


def test_a_version_or_id_is_text_and_an_unknown_backend_is_skipped(tmp_path):
    """Found by a review with odd files: read as numbers, backend_version 0.20 was vLLM 0.2 (scheduled
    synchronously, as before 0.14) and ids 001 and 1 were one; " 0.12.0" priced 0.12's tables beside
    0.14's asynchronous scheduling; and a backend of VLLM or tgi was simulated as the newest vLLM."""
    csv, ops, models = setup(tmp_path)
    rows = measured_rows()
    rows[0]["id"], rows[1]["id"], rows[2]["id"] = "001", "1", "1.50"
    rows[0]["backend_version"], rows[1]["backend_version"] = "0.20", " 0.12.0"
    pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
    out = tmp_path / "o"
    assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet",
                 "--jobs", "1"]) == 0
    done = pd.read_csv(out / "validate.csv", dtype={"id": str, "backend_version": str}, keep_default_na=False)
    assert done["id"].tolist() == ["001", "1", "1.50"]
    assert done["backend_version"].tolist()[:2] == ["0.20", "0.12.0"]
    assert done["async_scheduling"].tolist()[:2] == [True, False]  # 0.20 after 0.14; 0.12 before it
    for backend in ("VLLM", "tgi", ""):
        rows = measured_rows()
        rows[0]["backend"] = backend
        pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
        assert main(["validate", str(csv), "--ops", str(ops), "--models", str(models), "--out", str(out), "--quiet",
                     "--jobs", "1", "--overwrite"]) == 0
        skipped = json.loads((out / "validate.json").read_text())["skipped"]
        assert f"backend {backend!r}: servesim reads the rows of vllm, trtllm, sglang (written so: the rows of " \
            "TensorRT-LLM and SGLang as vLLM deployments)" in [s["reason"] for s in skipped]
