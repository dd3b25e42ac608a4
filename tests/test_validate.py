"""`sim validate`: measured deployments in AIConfigurator's silicon format against simulated benchmarks.

The first tests run anywhere, on synthetic operator tables (tests/optables_fixture.py) named as an
H100's and a tiny Llama config; the last one runs a 5-row cut of the shared measured file when
../shared/gpu-data is there."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from sim.app.cli import main
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
        {"id": "e", "reason": "precision fp4: no operator tables for it"}]
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


def test_validate_refuses_a_file_without_its_columns(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("id,system\nx,h100_sxm\n")
    ops = tmp_path / "ops"
    ops.mkdir()
    write_tables(ops, system="h100_sxm")
    assert main(["validate", str(bad), "--ops", str(ops), "--out", str(tmp_path / "o")]) == 2
    assert "bad.csv: lacks column(s) backend, backend_version" in capsys.readouterr().err


def test_an_unknown_model_is_skipped_not_guessed(tmp_path):
    csv, ops, _ = setup(tmp_path)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--ops", str(ops), "--out", str(out), "--quiet"]) == 0
    skipped = json.loads((out / "validate.json").read_text())["skipped"]
    assert skipped[0] == {"id": "a", "reason": "no config for org/toy: give --models DIR holding org/toy/config.json"}


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
    assert summary["skipped"] == [{"id": ids[3], "reason": "precision fp4: no operator tables for it"}]
    rows = pd.read_csv(out / "validate.csv")
    vllm = rows[rows["backend"] == "vllm"]
    assert (vllm["tpot_error_pct"].abs() < 10).all() and (vllm["ttft_error_pct"].abs() < 30).all()


@pytest.mark.parametrize("async_scheduling,ttft", [(False, 1.0), (True, 2.0)])
def test_async_scheduling_makes_a_new_request_wait_one_step_more(async_scheduling, ttft):
    """Steps of 1 s, two clients. a (3 tokens) and b (5 tokens) prefill in [0, 1]; a's third token
    ends it at 3 and c is sent then. Synchronously c joins the step starting at 3 (first token at
    4); asynchronously the step [3, 4] was scheduled at 2, so c first runs in [4, 5]."""
    from backends.opprofile import ClientOverhead
    from policies import load_policy
    from sim.app.validate import ThroughApiServer
    from sim.arrivals import simulate
    from sim.block_manager import BlockManager
    from sim.config import SchedulerConfig
    from sim.engine import Engine, TokenTimes
    from sim.request import Request
    from tests.helpers import ConstantBackend

    requests = [Request(0, "a", 0.0, 4, 3), Request(1, "b", 0.0, 4, 5), Request(2, "c", 0.0, 4, 2)]
    engine = Engine(load_policy("chunked")(SchedulerConfig()), ConstantBackend(1.0), BlockManager(64, 16, False),
                    TokenTimes(requests), 100)
    workload = ThroughApiServer(requests, [0.0] * 3, 2, engine, ClientOverhead(0.0, 0.0), async_scheduling)
    simulate(engine, workload)
    assert [r.first_token_s for r in requests[:2]] == [1.0, 1.0] and requests[0].finish_s == 3.0
    assert workload.sent_s[2] == 3.0 and requests[2].first_token_s - workload.sent_s[2] == ttft
