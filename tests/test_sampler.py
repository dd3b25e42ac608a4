"""The sampler's kernels by the requests' sampling parameters and the vLLM version (backends/sampler.py),
--sampling in sim replay and sim validate's per-row choice."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.sampler import (
    CAST_AND_ARGMAX,
    GREEDY,
    Sampling,
    generation_config_sampling,
    parse_sampling,
    resolve_sampling,
    sampler_kernels,
    sampler_seconds,
)
from sim.errors import ServesimError

QWEN3 = Sampling(0.6, 0.95, 20, "given")
FLOOR, BANDWIDTH = 2.45e-6, 2.98e12  # the H100 tables' kernel floor and bandwidth (derive_memory)


def test_parse_sampling_values():
    assert parse_sampling("greedy") is GREEDY and parse_sampling("model") == "model"
    assert parse_sampling("temperature=0.6,top_p=0.95,top_k=20") == QWEN3
    assert parse_sampling(" temperature = 1 ") == Sampling(1.0, 1.0, 0, "given")
    assert parse_sampling("temperature=0.7,top_k=-1") == Sampling(0.7, 1.0, 0, "given")  # -1: off, as vLLM's


@pytest.mark.parametrize("text, words", [
    ("top_p=0.9", "give the temperature too"),
    ("temperature=0.6,top_q=0.9", "takes greedy, model or"),
    ("temperature=0.6,temperature=0.7", "gives temperature twice"),
    ("temperature=-1", "temperature must be a number of 0 or more"),
    ("temperature=nan", "temperature must be a number of 0 or more"),
    ("temperature=1e9", "past 10,000"),
    ("temperature=0.6,top_p=0", "top_p must be in (0, 1]"),
    ("temperature=0.6,top_p=1.5", "top_p must be in (0, 1]"),
    ("temperature=0.6,top_k=2.5", "top_k must be a whole number"),
    ("temperature=0.6,top_k=-2", "top_k must be a whole number"),
    ("temperature=abc", "must be numbers"),
    ("fast", "takes greedy, model or"),
])
def test_parse_sampling_refuses_naming_the_value(text, words):
    with pytest.raises(ServesimError, match="--sampling") as e:
        parse_sampling(text)
    assert words in str(e.value)


def test_the_path_follows_vllms_sampling_metadata():
    vocab = 151936
    assert Sampling(0.0, 0.9, 20).path(vocab) == "greedy"  # temperature 0 ignores top-p and top-k
    assert Sampling(1e-6, 0.9, 20).path(vocab) == "greedy"  # below vLLM's _SAMPLING_EPS
    assert Sampling(0.6).path(vocab) == "random"
    assert Sampling(0.6, 1.0, 20).path(vocab) == "top-k"
    assert Sampling(0.6, 1.0, vocab).path(vocab) == "random"  # a top-k of the whole vocabulary is none
    assert Sampling(0.6, 0.95, 0).path(vocab) == "top-p"
    assert QWEN3.path(vocab) == "top-p"


def test_which_kernels_each_version_runs():
    # vLLM up to 0.16: PyTorch's sort for a top-p at every batch; 0.17-0.21: Triton from 8 rows; 0.22 on:
    # FlashInfer's rejection sampling (VLLM_USE_FLASHINFER_SAMPLER on by default); None: the newest.
    sort = sampler_kernels("top-p", 4, "0.12.0")
    assert sort == sampler_kernels("top-p", 512, "0.16.0") == sampler_kernels("top-p", 7, "0.21.0")
    assert (sort.kernels, sort.bytes_per_element) == (29, 274.0)
    triton = sampler_kernels("top-p", 8, "0.17.0")
    assert (triton.kernels, triton.bytes_per_element) == (8, 66.0) and triton == sampler_kernels("top-k", 100, "0.21.0")
    assert sampler_kernels("top-p", 4, "0.22.0").bytes_per_element == 62.0 == sampler_kernels("top-p", 4, None).bytes_per_element
    assert sampler_kernels("top-k", 4, "0.34.0").bytes_per_element == 42.0
    assert sampler_kernels("top-k", 64, "0.12.0").bytes_per_element == 76.0  # torch.topk, no sort
    assert sampler_kernels("random", 64, "0.12.0").bytes_per_element == 46.0
    assert sampler_kernels("greedy", 64, "0.12.0") == CAST_AND_ARGMAX


def test_a_step_of_128_rows_of_qwen3_on_vllm_0_12_by_hand():
    # 29 kernels at the floor, 274 bytes for each of 128 x 151,936 logits at the H100 tables' bandwidth.
    expected = 29 * FLOOR + 128 * 151936 * 274.0 / BANDWIDTH
    got = sampler_seconds(QWEN3, "0.12.0", [0, 128], 151936, FLOOR, BANDWIDTH)
    assert got[0] == 0.0 and got[1] == pytest.approx(expected, rel=1e-12)
    assert 1.8e-3 < got[1] < 1.9e-3
    # Greedy is the three 4-byte passes every step was priced with before sampling was modelled.
    greedy = sampler_seconds(GREEDY, "0.12.0", [128], 151936, FLOOR, BANDWIDTH)[0]
    assert greedy == pytest.approx(3 * (FLOOR + 128 * 151936 * 4 / BANDWIDTH), rel=1e-12)


@given(rows=st.lists(st.integers(0, 4096), min_size=1, max_size=20),
       version=st.sampled_from(["0.11.2", "0.12.0", "0.16.0", "0.17.0", "0.21.0", "0.22.0", "0.34.0", None]),
       sampling=st.sampled_from([GREEDY, Sampling(0.8), Sampling(0.8, 1.0, 50), Sampling(0.8, 0.9), QWEN3]))
def test_sampler_seconds_are_each_rows_own_and_monotone_within_a_kernel_choice(rows, version, sampling):
    vocab = 32000
    all_at_once = sampler_seconds(sampling, version, rows, vocab, FLOOR, BANDWIDTH)
    one_by_one = [float(sampler_seconds(sampling, version, [r], vocab, FLOOR, BANDWIDTH)[0]) for r in rows]
    assert all_at_once.tolist() == one_by_one  # vectorised exactly as single steps (the fast-forward relies on it)
    assert all((s == 0.0) == (r == 0) for s, r in zip(one_by_one, rows))
    for r, s in zip(rows, one_by_one):
        more = float(sampler_seconds(sampling, version, [r + 1], vocab, FLOOR, BANDWIDTH)[0])
        same_kernels = sampler_kernels(sampling.path(vocab), r, version) == sampler_kernels(sampling.path(vocab), r + 1, version)
        if r > 0 and same_kernels:
            assert more > s
    # A non-greedy sampler never costs less than greedy's.
    greedy = sampler_seconds(GREEDY, version, rows, vocab, FLOOR, BANDWIDTH)
    assert np.all(all_at_once >= greedy)


def test_generation_config_defaults(tmp_path):
    assert generation_config_sampling("Qwen/Qwen3-32B", None) == Sampling(0.6, 0.95, 20, "generation_config.json of Qwen/Qwen3-32B")
    assert generation_config_sampling("Qwen/Qwen3-235B-A22B-FP8", None).path(151936) == "top-p"
    assert generation_config_sampling("nvidia/Llama-3.1-8B-Instruct-FP8", None).top_p == 0.9
    assert generation_config_sampling("Llama-3.1-8B", None) is None  # the base model's is not known here
    assert generation_config_sampling("Qwen/Qwen3-Coder-480B-A35B-Instruct", None) is None
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    path = str(folder / "generation_config.json")
    assert generation_config_sampling("anything", folder) == Sampling(0.7, 0.8, 20, path)  # the file read, named
    # vLLM reads it through transformers' to_diff_dict, which drops a value equal to GenerationConfig's default:
    # a top_k of 50 is then no top-k (vLLM's default), a temperature of 1 or top_p of 1 vLLM's own anyway.
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 1.0, "top_k": 50}))
    assert generation_config_sampling("anything", folder) == Sampling(0.7, 1.0, 0, path)
    assert generation_config_sampling("anything", folder).path(32000) == "random"
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert generation_config_sampling("anything", folder).path(1000) == "random"  # vLLM's temperature 1
    for bad, words in (("[1]", "JSON object"), ('{"top_p": 2}', "top_p must be in"), ("{", "cannot read it"),
                       ('{"top_k": true}', "top_k = True, expected a number")):
        (folder / "generation_config.json").write_text(bad)
        with pytest.raises(ServesimError, match="generation_config.json") as e:
            generation_config_sampling("anything", folder)
        assert words in str(e.value)


def test_resolve_sampling_model_needs_a_known_config(tmp_path):
    assert resolve_sampling("model", "Qwen3-8B", "Qwen3-8B") == Sampling(0.6, 0.95, 20, "generation_config.json of Qwen3-8B")
    with pytest.raises(ServesimError, match="no generation config is known for Llama-3.1-8B"):
        resolve_sampling("model", "Llama-3.1-8B", "Llama-3.1-8B")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert resolve_sampling("model", "mine", str(tmp_path / "config.json")).temperature == 0.3


def _sim(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "sim.app.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_replay_prices_the_sort_of_vllm_0_12_and_says_so(tmp_path):
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.config import SchedulerConfig

    def step(sampling: str, version: str | None) -> float:
        plan = resolve(ReplayOptions(scheduler=SchedulerConfig("chunked"), model="Qwen3-8B", hardware="H100-SXM",
                                     sampling=sampling, vllm_version=version))
        ops = plan.backend.ops
        return ops.dense_parts_at(64, 64)["elementwise"], plan

    greedy, _ = step("greedy", "0.12.0")
    sorted_, plan = step("model", "0.12.0")
    flashinfer, _ = step("model", None)
    vocab = plan.backend.ops.vocab_per_gpu
    floor, bw = plan.backend.ops.kernel_floor_s, plan.backend.ops.bandwidth
    assert sorted_ - greedy == pytest.approx(26 * floor + 64 * vocab * 262.0 / bw, rel=1e-9)
    assert greedy < flashinfer < sorted_
    summary = plan.as_dict()["sampling"]
    assert summary == {"given": "model", "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                       "source": "generation_config.json of Qwen3-8B", "path": "top-p"}
    greedy_plan = resolve(ReplayOptions(scheduler=SchedulerConfig("chunked"), model="Qwen3-8B", hardware="H100-SXM"))
    assert "sampling" not in greedy_plan.as_dict()  # greedy runs keep the summary they had


def test_replay_refuses_sampling_it_would_not_price(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,4\n0.01,300,20\n")
    out = _sim("replay", str(trace), "--model", "Qwen3-8B", "--profile", "roofline", "--sampling",
               "temperature=1,top_k=5", "--out", str(tmp_path / "r"))
    assert out.returncode == 2 and "prices no sampler" in out.stderr and "Traceback" not in out.stderr
    out = _sim("replay", str(trace), "--model", "Llama-3.1-8B", "--sampling", "model", "--out", str(tmp_path / "r"))
    assert out.returncode == 2 and "no generation config is known for Llama-3.1-8B" in out.stderr
    out = _sim("replay", str(trace), "--sampling", "top_p=0.9", "--out", str(tmp_path / "r"))
    assert out.returncode == 2 and "give the temperature too" in out.stderr
    out = _sim("replay", str(trace), "--model", "Qwen3-8B", "--sampling", "model", "--vllm-version", "0.12.0",
               "--out", str(tmp_path / "ok"))
    assert out.returncode == 0, out.stderr
    assert "sampling: temperature=0.6,top_p=0.95,top_k=20 (generation_config.json of Qwen3-8B), vLLM's top-p" in out.stdout
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["options"]["sampling"]["path"] == "top-p"


def test_validate_takes_each_rows_clients_sampling():
    from sim.app.validate import Protocol

    gap = {"backend": "vllm", "model_path": "Qwen/Qwen3-32B", "model_source": "Qwen3-8B",
           "silicon_data_source": "source_file=/Users/x/aic-auto-gap-analysis/data/h100_sxm/vllm/0.12.0/Qwen_Qwen3-32B.csv"}
    inferencemax = {**gap, "silicon_data_source": "source_file=2026-04-06.csv; model=Qwen3"}
    sglang = {**gap, "backend": "sglang"}
    unknown = {**gap, "model_path": "someone/Model-7B"}
    auto = Protocol()
    assert auto.sampling_for(gap)[0] == Sampling(0.6, 0.95, 20, "generation_config.json of Qwen/Qwen3-32B")
    assert "genai-perf" in auto.sampling_for(gap)[1]
    assert auto.sampling_for(inferencemax) == (GREEDY, "InferenceMAX's client sends temperature 0")
    assert auto.sampling_for(sglang)[0] is GREEDY
    assert auto.sampling_for(unknown)[0] is GREEDY and "no generation config is known" in auto.sampling_for(unknown)[1]
    assert Protocol(sampling="greedy").sampling_for(gap) == (GREEDY, "--sampling greedy")
    assert Protocol(sampling="model").sampling_for(inferencemax)[0].top_k == 20
    with pytest.raises(ServesimError, match="unknown --sampling"):
        Protocol(sampling="top")
    assert math.isfinite(QWEN3.temperature)


def test_a_sampler_set_after_use_reprices_every_cached_step():
    # The operator model keeps tables by logits rows and decode runs: a sampling set later must not read them.
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.config import SchedulerConfig

    def ops(sampling: str):
        return resolve(ReplayOptions(scheduler=SchedulerConfig("chunked"), model="Qwen3-8B", hardware="H100-SXM",
                                     sampling=sampling, vllm_version="0.12.0")).backend.ops

    used = ops("greedy")
    before = (used.dense_parts_at(64, 64)["elementwise"], used.decode_run_of(64, 64 * 700, 50)[0].tolist())
    used.sampling = Sampling(0.6, 0.95, 20, "generation_config.json of Qwen3-8B")
    fresh = ops("model")
    after = (used.dense_parts_at(64, 64)["elementwise"], used.decode_run_of(64, 64 * 700, 50)[0].tolist())
    assert after == (fresh.dense_parts_at(64, 64)["elementwise"], fresh.decode_run_of(64, 64 * 700, 50)[0].tolist())
    assert after[0] > before[0] and all(a > b for a, b in zip(after[1], before[1]))


def test_a_sampler_set_after_use_reprices_the_moe_models_kept_steps():
    # sim validate keeps one MoE model for the rows of a deployment and sets each row's sampling on it: the steps,
    # dense parts and decode runs it kept for the row before must not carry that row's sampler.
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.batch import Batch
    from sim.config import SchedulerConfig

    def model(sampling: str):
        return resolve(ReplayOptions(scheduler=SchedulerConfig("chunked"), model="Qwen3-30B-A3B", hardware="H100-SXM",
                                     tp=2, sampling=sampling, vllm_version="0.12.0")).backend.inner

    def priced(m):
        batch = Batch()
        batch.add_decodes([object()] * 64, [700] * 64)
        return m.execute(batch).seconds, m.decode_run([700] * 64, 20)[0].tolist()

    used = model("greedy")
    before = priced(used)
    used.sampling = Sampling(0.6, 0.95, 20, "generation_config.json of Qwen3-30B-A3B")
    after = priced(used)
    assert after == priced(model("model"))
    assert after[0] > before[0] and all(a > b for a, b in zip(after[1], before[1]))


def test_generation_config_values_are_read_as_vllm_reads_them(tmp_path):
    # null is unset (vLLM's get_diff_sampling_param skips None): vLLM's default, not a refusal; a string or true
    # for a number is refused naming the field (true was read as 1.0); a folder of that name, or JSON nested past
    # Python's recursion limit, is one line naming the file, not the known repo's defaults or an internal error.
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": None, "top_k": None}))
    assert generation_config_sampling("Qwen3-8B", tmp_path) == Sampling(0.7, 1.0, 0, str(tmp_path / "generation_config.json"))
    for bad in ({"temperature": True}, {"top_p": True}, {"temperature": "0.6"}, {"top_k": "20"}):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        key, value = next(iter(bad.items()))
        with pytest.raises(ServesimError, match=f"generation_config.json: {key} = {value!r}, expected a number"):
            generation_config_sampling("Qwen3-8B", tmp_path)
    (tmp_path / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ServesimError, match="generation_config.json: cannot read it"):
        generation_config_sampling("Qwen3-8B", tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").mkdir()
    with pytest.raises(ServesimError, match="generation_config.json: cannot read it: not a file"):
        generation_config_sampling("Qwen3-8B", tmp_path)


def test_a_moe_model_whose_tables_give_no_small_kernels_refuses_a_sampler_it_would_not_price():
    # Without a bf16 GEMM at m = 1 (derive_memory) the MoE model's small kernels stay the roofline's, which price
    # greedy's sampler whatever was set: refused as the roofline's is, not recorded in summary.json and not priced.
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve, set_sampler
    from sim.config import SchedulerConfig

    moe = resolve(ReplayOptions(scheduler=SchedulerConfig("chunked"), model="Qwen3-30B-A3B", hardware="H100-SXM",
                                tp=2)).backend.inner
    moe._small = None
    model, hardware = resolve_model("Qwen3-30B-A3B"), resolve_hardware("H100-SXM")
    with pytest.raises(ServesimError, match="prices no sampler"):
        set_sampler(moe, QWEN3, "0.12.0", model, hardware)
    set_sampler(moe, GREEDY, "0.12.0", model, hardware)  # greedy: what it prices


def test_the_real_backend_is_refused_a_sampling_in_its_own_words(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,4\n")
    out = _sim("replay", str(trace), "--model", "tiny", "--backend", "real", "--sampling", "temperature=1",
               "--out", str(tmp_path / "r"))
    assert out.returncode == 2 and "the real backend measures its own steps" in out.stderr
    assert "H100" not in out.stderr  # (it said "on H100-SXM": the real backend runs on --device)
    assert parse_sampling("temperature=-0") is not None and str(parse_sampling("temperature=-0").temperature) == "0.0"
