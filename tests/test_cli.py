"""The `sim` command end to end: the bundled Azure sample under each policy, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from reports.run_tables import read_run_table
from sim.app.cli import main
from sim.app.outputs import MANIFEST_NAME
from traces import AZURE_CONV_SAMPLE

SAMPLE = str(AZURE_CONV_SAMPLE)


def run_cli(*args):
    return main([str(a) for a in args])


@pytest.mark.parametrize("policy", ["chunked", "prefill-first", "decode-first"])
def test_replay_bundled_sample(policy, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli("replay", SAMPLE, "--policy", policy, "--out", out, "--slo", "ttft=2,tpot=0.1") == 0
    printed = capsys.readouterr().out
    assert "ttft" in printed and "p99" in printed
    summary = json.loads((out / "summary.json").read_text())
    requests = pd.read_csv(out / "requests.csv")
    steps = read_run_table(out, "steps")  # steps.parquet
    assert summary["completed"] == len(requests) == 1445 and summary["rejected"] == 0
    for name in ("ttft", "tpot", "itl", "e2e", "scheduling_delay"):
        s = summary[name]
        assert set(s) == {"mean", "p50", "p90", "p99"}
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"]
    # Throughput x duration = tokens.
    assert summary["output_throughput"] * summary["duration_s"] == pytest.approx(requests["output_tokens"].sum())
    assert summary["request_throughput"] * summary["duration_s"] == pytest.approx(1445)
    assert steps["num_decode_tokens"].sum() + 1445 == requests["output_tokens"].sum()
    assert steps["num_prefill_tokens"].sum() == requests["prompt_tokens"].sum()  # no preemption here
    assert np.allclose(steps["start_s"].to_numpy()[1:] >= (steps["start_s"] + steps["seconds"]).to_numpy()[:-1] - 1e-9, True)
    assert 0 <= summary["slo_attainment"] <= 1
    assert summary["options"]["scheduler"]["policy"] == policy


@pytest.mark.slow
def test_same_seed_gives_byte_identical_files(tmp_path):
    for name in ("a", "b"):
        assert run_cli("replay", SAMPLE, "--out", tmp_path / name, "--quiet", "--seed", 3) == 0
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"requests.csv", "steps.parquet", "summary.json", "digest.json", "report.html"} <= set(files)
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for f in files:
        if f != MANIFEST_NAME:  # (the folder's record of its files: their sizes, the same, and write times)
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    records = [json.loads((tmp_path / name / MANIFEST_NAME).read_text())["files"] for name in ("a", "b")]
    assert {k: v["size"] for k, v in records[0].items()} == {k: v["size"] for k, v in records[1].items()}


def test_no_fast_forward_gives_the_same_files(tmp_path):
    for name, extra in (("fast", []), ("slow", ["--no-fast-forward"])):
        assert run_cli("replay", SAMPLE, "--out", tmp_path / name, "--quiet", "--policy", "prefill-first", *extra) == 0
    for f in ("requests.csv", "steps.parquet", "summary.json", "digest.json"):
        assert (tmp_path / "fast" / f).read_bytes() == (tmp_path / "slow" / f).read_bytes(), f


def test_console_script_runs(tmp_path):
    sim = Path(sys.executable).parent / "sim"
    done = subprocess.run([str(sim), "replay", SAMPLE, "--out", str(tmp_path / "r"), "--num-blocks", "4000"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "completed" in done.stdout


def test_models_and_hardware_list(capsys):
    assert run_cli("models") == 0
    out = capsys.readouterr().out
    assert "Llama-3.1-8B" in out
    if "the tables package's model configs" in out:  # the tables extra: its configs, priced or why not
        scout = next(line for line in out.splitlines() if "meta-llama/Llama-4-Scout-17B-16E-Instruct" in line)
        assert "107.77B" in scout and "llama4_text" in scout
        step = next(line for line in out.splitlines() if line.strip().startswith("stepfun-ai/Step-3.7-Flash "))
        assert "not priced: model_type 'step3p7' is not supported" in step and "servesim prices" not in step
    assert run_cli("hardware") == 0
    out = capsys.readouterr().out
    assert "H200" in out and "node GB/s" in out
    h100 = next(line for line in out.splitlines() if line.startswith("H100-SXM"))
    assert "nvlink 450" in h100 and "8 x 50" in h100  # 8 GPUs a node, 50 GB/s each to other nodes


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        run_cli("replay", "--help")
    text = capsys.readouterr().out
    for option in ("--policy", "--model", "--hardware", "--max-num-batched-tokens", "--max-num-seqs",
                   "--max-model-len", "--block-size", "--num-blocks", "--gpu-memory-utilization", "--seed",
                   "--slo", "--out", "--no-prefix-caching", "--reserve-full-isl", "--no-reserve-full-isl",
                   "--long-prefill-token-threshold", "--scheduling-policy"):
        assert option in text


def write(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def expect_error(capsys, args, *fragments):
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


BAD_TRACES = [
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,,5\n", ["t.csv:3", "prompt_tokens is missing"]),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,-3,5\n", ["t.csv:3", "prompt_tokens", "-3"]),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,ten,5\n", ["t.csv:3", "not a number: 'ten'"]),
    ("arrival_s,prompt_tokens,output_tokens\n-1,10,5\n", ["t.csv:2", "arrival_s must not be negative"]),
    ("foo,bar\n1,2\n", ["unknown trace format", "foo,bar"]),
    ("arrival_s,prompt_tokens,output_tokens\n", ["no requests"]),
    ("", ["empty"]),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,10,5\r\nyesterday,3,4",
     ["t.csv:3", "TIMESTAMP 'yesterday'"]),
]


@pytest.mark.parametrize("text,fragments", BAD_TRACES)
def test_bad_trace_files(tmp_path, capsys, text, fragments):
    expect_error(capsys, ["replay", write(tmp_path, text), "--out", tmp_path / "o"], *fragments)


def test_unreadable_files(tmp_path, capsys):
    expect_error(capsys, ["replay", tmp_path / "nope.csv"], "nope.csv: no such file")
    expect_error(capsys, ["replay", tmp_path], "is a directory")


@pytest.mark.parametrize("args,fragment", [
    (["--policy", "fifo"], "unknown policy 'fifo'"),
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--hardware", "TPU"], "unknown hardware 'TPU'"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be a whole number from 1 to 16,777,216 tokens, got 0"),
    # (256 was a stand-in for the unset --max-num-seqs: vLLM's on an H100 is 1024)
    (["--max-num-batched-tokens", "100"], "--max-num-batched-tokens 100 is less than vLLM's default --max-num-seqs "
                                          "on H100-SXM (1024)"),
    (["--block-size", "3"], "--block-size must be a power of two, got 3"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be a number above 0 and at most 1, got 1.5"),
    (["--slo", "ttft=fast"], "--slo: ttft value 'fast' is not a number"),
    (["--slo", "latency=3"], "cannot read 'latency=3'"),
    (["--max-model-len", "999999999"], "--max-model-len must be a whole number from 2 to 16,777,216 tokens, got 999,999,999"),
    (["--max-model-len", "200000"], "more than Llama-3.1-8B's max_position_embeddings"),
    (["--model", "Llama-3.1-70B"], "do not fit"),
    (["--backend", "magic"], "unknown --backend 'magic'; choose costmodel or real"),
    (["--scheduling-policy", "lifo"], "unknown --scheduling-policy 'lifo'; choose fcfs or priority"),
    (["--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold must be a whole number from 0 to 16,777,216 tokens, got -1"),
])
def test_nonsense_options(tmp_path, capsys, args, fragment):
    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
    expect_error(capsys, ["replay", trace, "--out", tmp_path / "o", *args], fragment)


def test_out_of_order_arrivals_are_sorted_with_a_warning(tmp_path, capsys):
    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens,request_id\n0,10,5,a\n2,10,5,b\n1,10,5,c\n")
    assert run_cli("replay", trace, "--out", tmp_path / "o") == 0
    assert "t.csv:4: arrivals are out of order" in capsys.readouterr().err
    requests = pd.read_csv(tmp_path / "o" / "requests.csv")
    assert requests["request_id"].tolist() == ["a", "c", "b"]


def test_too_long_and_too_big_requests_are_rejected_not_stalled(tmp_path, capsys):
    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0,10,5\n0,500,100\n1,200,10\n2,10,5\n")
    out = tmp_path / "o"
    assert run_cli("replay", trace, "--out", out, "--max-model-len", "550", "--num-blocks", "10") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 2 and summary["rejected"] == 2
    requests = pd.read_csv(out / "requests.csv", keep_default_na=False)
    reasons = requests["reject_reason"].tolist()
    assert "more than --max-model-len 550" in reasons[1]
    assert "needs 14 KV blocks, the whole cache has 10" in reasons[2]


def test_numeric_csv_writer_matches_pandas(tmp_path):
    from reports.metrics import write_numeric_csv

    frame = pd.DataFrame({"step": np.arange(5), "start_s": [0.0, 0.1, 1e-17, 12345.678901234567, 3.0],
                          "n": np.array([1, -2, 3, 0, 7], dtype=np.int32), "x": [1.5, 2.0, 1e300, -0.0, 0.25]})
    write_numeric_csv(frame, tmp_path / "fast.csv", chunk_rows=2)
    frame.to_csv(tmp_path / "pandas.csv", index=False)
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()
    frame.loc[2, "x"] = np.nan  # missing values: pandas writes them
    write_numeric_csv(frame, tmp_path / "fast.csv")
    frame.to_csv(tmp_path / "pandas.csv", index=False)
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "pandas.csv").read_bytes()


def test_models_hardware_and_deployments_from_files(tmp_path, capsys):
    from tests.test_model_config import LLAMA_31_8B, transformers5

    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0.0,300,20\n0.1,200,30\n")
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(transformers5(LLAMA_31_8B)))
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"peak_bf16_flops": 989.4e12, "peak_fp8_flops": 1978.9e12, "memory_bandwidth": 3.35e12,
                               "memory_bytes": 81082 * 2**20, "nvlink_bandwidth": 450e9}))
    runs = {}
    for name, extra in (("preset", []), ("files", ["--model", str(folder), "--hardware", str(gpu)]),
                        ("tp2", ["--tp", "2"]), ("fp8", ["--dtype", "fp8", "--kv-cache-dtype", "fp8"])):
        assert run_cli("replay", trace, "--out", tmp_path / name, "--quiet", "--profile", "roofline", *extra) == 0
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert runs["files"]["ttft"] == runs["preset"]["ttft"] and runs["files"]["e2e"] == runs["preset"]["e2e"]
    # (vLLM's API server's budget on an 80 GB GPU, 8192 tokens, sizes the activations the cache leaves room for)
    assert runs["files"]["kv_cache"]["num_gpu_blocks"] == runs["preset"]["kv_cache"]["num_gpu_blocks"] == 26003
    assert runs["tp2"]["kv_cache"]["num_gpu_blocks"] > 2 * 26003  # half the KV heads and weights per GPU
    assert runs["fp8"]["kv_cache"]["block_bytes"] * 2 == runs["preset"]["kv_cache"]["block_bytes"]
    assert runs["tp2"]["tpot"]["mean"] < runs["preset"]["tpot"]["mean"]
    assert run_cli("replay", trace, "--out", tmp_path / "o", "--quiet", "--num-gpu-blocks", "500") == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["kv_cache"]["num_gpu_blocks"] == 500 and summary["kv_cache"]["source"] == "--num-gpu-blocks"
    # (the committed operator-table profile priced its steps; the GPU's figures are recorded all the same)
    assert summary["options"]["profile"] is not None and summary["hardware"]["name"] == "H100-SXM"


@pytest.mark.parametrize("change,fragment", [
    ({"num_local_experts": 8}, "num_local_experts = 8: mixture-of-experts models are not supported"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True},
     "sliding_window = 4096: sliding-window attention is not supported"),
    ({"kv_lora_rank": 512}, "kv_lora_rank = 512: multi-head latent attention is not supported"),
])
def test_an_unsupported_config_is_exit_2(tmp_path, capsys, change, fragment):
    from tests.test_model_config import MISTRAL_7B_V03

    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0.0,10,2\n")
    (tmp_path / "config.json").write_text(json.dumps({**MISTRAL_7B_V03, **change}))
    expect_error(capsys, ["replay", trace, "--model", str(tmp_path), "--out", tmp_path / "o"], fragment,
                 str(tmp_path / "config.json"))
    expect_error(capsys, ["bench", "--concurrency", "1", "--input-len", "8", "--output-len", "2", "--num-prompts",
                          "1", "--model", str(tmp_path / "config.json"), "--out", tmp_path / "b"], fragment)


def test_deployment_options_are_checked(tmp_path, capsys):
    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n0.0,10,2\n")
    expect_error(capsys, ["replay", trace, "--tp", "3"], "--tp 3 does not split model Llama-3.1-8B")
    expect_error(capsys, ["replay", trace, "--tp", "0"], "--tp must be a whole number from 1 to 1,024 GPUs, got 0")
    expect_error(capsys, ["replay", trace, "--hardware", str(tmp_path / "nope.json")], "nope.json")
    expect_error(capsys, ["replay", trace, "--model", "Llama-3.1-70B", "--tp", "2", "--max-model-len", "131072",
                          "--max-num-batched-tokens", "2048", "--max-num-seqs", "256"],
                 "cannot hold one request of --max-model-len 131072")
    # With vLLM's API server's budget on an H100 (8192 tokens) the activations leave no room at all.
    expect_error(capsys, ["replay", trace, "--model", "Llama-3.1-70B", "--tp", "2"],
                 "Llama-3.1-70B on NVIDIA H100 SXM5 80GB x 2 do not fit in 90% of 79.18 GiB")
    expect_error(capsys, ["replay", trace, "--model", "tiny", "--backend", "real", "--tp", "2"],
                 "the real backend runs one device")


def test_vllm_scheduler_options_reach_the_run(tmp_path):
    # A priority column read from the trace; the options recorded in summary.json as the run used them.
    trace = write(tmp_path, "arrival_s,prompt_tokens,output_tokens,priority\n0,100,5,1\n0,100,5,0\n")
    out = tmp_path / "o"
    assert run_cli("replay", trace, "--out", out, "--scheduling-policy", "priority", "--max-num-seqs", "1",
                   "--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "32",
                   "--no-reserve-full-isl", "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    scheduler = summary["options"]["scheduler"]
    assert (scheduler["scheduling_policy"], scheduler["long_prefill_token_threshold"], scheduler["reserve_full_isl"]) \
        == ("priority", 32, False)
    rows = pd.read_csv(out / "requests.csv").set_index("request_id")
    # One at a time: request 1 (priority 0) first, though both arrived at 0.
    assert rows.loc[1, "ttft_s"] < rows.loc[0, "ttft_s"]


def test_the_cyclic_collector_runs_less_often_during_a_command_only(monkeypatch):
    import gc

    import sim.app.cli as cli

    seen = []
    monkeypatch.setattr(cli, "cmd_models", lambda args: seen.append(gc.get_threshold()) or 0)
    before = gc.get_threshold()
    assert cli.main(["models"]) == 0
    assert seen == [(cli.GC_FIRST_THRESHOLD, *before[1:])]
    assert gc.get_threshold() == before  # restored for whoever called main in-process


def test_a_run_the_roofline_prices_says_so_on_the_terminal_and_in_its_summary(tmp_path, capsys):
    """No committed profile matches Llama-3.1-8B on the A100 preset: the roofline prices it, and the run
    says so (its profile alone, null, left a reader to guess); a table-priced run says nothing of it."""
    assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "5", "--hardware", "A100-80GB", "--out", str(tmp_path / "a")]) == 0
    assert "A100-80GB (costmodel, bf16), roofline (no operator-table profile matches" in capsys.readouterr().out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["options"]["profile"] is None and summary["options"]["cost_model"].startswith("roofline")
    assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "5", "--out", str(tmp_path / "h")]) == 0
    out = capsys.readouterr().out
    assert "), roofline (" not in out, out
    assert "cost_model" not in json.loads((tmp_path / "h" / "summary.json").read_text())["options"]
