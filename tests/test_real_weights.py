"""Weights from a local safetensors folder, and the real backend's one-line errors."""

import json

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from backends.real import RealBackend  # noqa: E402
from backends.real.weights import hf_state_dict  # noqa: E402
from sim.app.cli import main  # noqa: E402
from sim.batch import Batch  # noqa: E402
from sim.errors import ServesimError  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


@pytest.fixture(scope="module")
def source():
    return RealBackend("tiny", block_size=16, num_blocks=8, seed=7)


def save(folder, tensors, config=TINY, shards=2):
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    for i in range(shards):  # a sharded checkpoint, as Hugging Face writes big models
        part = {n: tensors[n] for n in names[i::shards]}
        safetensors_torch.save_file(part, str(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def step_logits(backend):
    b = Batch()
    b.add("a", 0, 12, [0], True, token_source=list(range(100, 112)))
    return backend.runner.logits(b.flatten(backend.block_size))


def test_loaded_weights_reproduce_the_saved_model(source, tmp_path):
    tensors = hf_state_dict(source.model)
    assert "model.layers.1.self_attn.k_proj.weight" in tensors and tensors["lm_head.weight"].shape == (512, 64)
    folder = save(tmp_path / "ckpt", tensors)
    loaded = RealBackend("tiny", block_size=16, num_blocks=8, seed=99, weights=str(folder))
    assert torch.equal(step_logits(loaded), step_logits(source))
    assert not torch.equal(step_logits(RealBackend("tiny", block_size=16, num_blocks=8, seed=99)),
                           step_logits(source))


@pytest.mark.parametrize("break_it,message", [
    (lambda t, c: t.pop("model.layers.0.mlp.up_proj.weight"), "lacks model.layers.0.mlp.up_proj.weight"),
    (lambda t, c: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
     "has a tensor the model does not use, model.layers.0.self_attn.q_proj.bias"),
    (lambda t, c: t.update({"model.norm.weight": torch.ones(32)}), "model.norm.weight has shape [32]"),
    (lambda t, c: c.update({"num_hidden_layers": 28}), "num_hidden_layers = 28"),
    (lambda t, c: c.update({"rope_theta": 500000.0}), "rope_theta = 500000.0"),
    (lambda t, c: c.update({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "rope_scaling = "),
    # Found by a review: fields the computation reads besides the shapes were not compared.
    (lambda t, c: c.update({"rms_norm_eps": 0.5}), "rms_norm_eps = 0.5, the model 1e-06"),
    (lambda t, c: c.update({"tie_word_embeddings": True}), "tie_word_embeddings = true, the model false"),
])
def test_a_folder_of_another_model_is_refused(source, tmp_path, break_it, message):
    tensors, config = hf_state_dict(source.model), dict(TINY)
    break_it(tensors, config)
    folder = save(tmp_path / "ckpt", tensors, config)
    with pytest.raises(ServesimError, match="does not match model tiny") as e:
        RealBackend("tiny", num_blocks=8, weights=str(folder))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "its config.json has hidden_act = 'gelu'; the real backend's MLPs run SiLU"),
    ({"mlp_bias": True}, "its config.json has mlp_bias = true; the real backend's projections have no biases"),
])
def test_a_folder_computing_otherwise_is_refused(source, tmp_path, change, message):
    """Found by a review: a config.json of GELU MLPs (its weights the same shapes) loaded, and the
    decoder ran SiLU: its greedy tokens could not be the checkpoint's."""
    folder = save(tmp_path / "ckpt", hf_state_dict(source.model), {**TINY, **change})
    with pytest.raises(ServesimError, match=message):
        RealBackend("tiny", num_blocks=8, weights=str(folder))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_a_tensor_that_is_not_float_weights_is_refused_naming_it(source, tmp_path, dtype):
    """Found by a review: an fp8 tensor ended in an internal error ("isfinite" not implemented), and
    integers, booleans and complex numbers were cast into the model without a word."""
    tensors = hf_state_dict(source.model)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    folder = save(tmp_path / "ckpt", tensors)
    with pytest.raises(ServesimError, match=f"tensor {name} is {str(dtype).removeprefix('torch.')}: the real backend "
                                            r"loads unquantized weights \(bf16, fp16 or fp32\)"):
        RealBackend("tiny", num_blocks=8, weights=str(folder))


def test_a_tensor_in_two_shards_is_refused_naming_both(source, tmp_path):
    """Found by a review: the later file's copy replaced the other silently (a stale extra shard)."""
    folder = save(tmp_path / "ckpt", hf_state_dict(source.model))
    safetensors_torch.save_file({"model.norm.weight": torch.full((64,), 7.0)}, str(folder / "zz-stale.safetensors"))
    with pytest.raises(ServesimError, match=r"tensor model.norm.weight is in both model-0000\d-of-00002.safetensors "
                                            r"and zz-stale.safetensors; a checkpoint holds each tensor once"):
        RealBackend("tiny", num_blocks=8, weights=str(folder))


def test_gemma_or_attention_biases_are_refused_by_the_real_backend():
    """Found by a review: a Gemma whose layers are all full attention, or attention with biases, ran as
    a plain Llama decoder."""
    import dataclasses

    from backends.model_config import ModelConfig

    tiny = ModelConfig.from_preset("tiny")
    for change, message in (({"sandwich_norms": True}, "Gemma's decoder"),
                            ({"attention_bias": True}, "attention projections with biases")):
        with pytest.raises(ServesimError, match=message):
            RealBackend(dataclasses.replace(tiny, **change), num_blocks=8)


def test_a_nan_weight_is_refused_naming_the_tensor(source, tmp_path):
    """A NaN or infinite weight was loaded as it was: every logit NaN, nonsense sampled, no word said."""
    tensors = hf_state_dict(source.model)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, :3] = float("nan")
    folder = save(tmp_path / "ckpt", tensors)
    with pytest.raises(ServesimError, match=f"tensor {name} holds 3 NaN or infinite values of "):
        RealBackend("tiny", num_blocks=8, weights=str(folder))


def test_missing_or_empty_folder(tmp_path):
    with pytest.raises(ServesimError, match="not a folder"):
        RealBackend("tiny", num_blocks=8, weights=str(tmp_path / "nowhere"))
    with pytest.raises(ServesimError, match="no \\*.safetensors files"):
        RealBackend("tiny", num_blocks=8, weights=str(tmp_path))


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,2\n")
    cases = [
        (["--model", "Llama-3.1-70B"], "too large for this machine's memory"),
        (["--model", "tiny", "--weights", str(tmp_path / "nowhere")], "not a folder"),
        (["--model", "tiny", "--num-blocks", str(2**25)], "--num-blocks 33554432 needs"),  # in range, too big here
        (["--model", "tiny", "--num-blocks", str(10**9)], "--num-gpu-blocks must be a whole number from 1 to "
                                                          "33,554,432 blocks, got 1,000,000,000"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--model", "tiny", "--device", "cuda"], "sees no CUDA GPU"))
    for extra, message in cases:
        rc = main(["replay", str(trace), "--backend", "real", "--out", str(tmp_path / "out"), "--quiet", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and err.count("\n") == 1, (extra, err)
    # --weights belongs to the real backend.
    rc = main(["replay", str(trace), "--weights", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2 and "does not apply to --backend costmodel" in capsys.readouterr().err


def test_config_check_reads_both_rope_layouts(tmp_path):
    from backends.model_config import ModelConfig
    from backends.real.weights import _check_config
    from tests.test_model_config import LLAMA_31_8B, transformers5

    llama = ModelConfig.from_preset("Llama-3.1-8B")
    for name, config in (("hub", LLAMA_31_8B), ("t5", transformers5(LLAMA_31_8B))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        _check_config(tmp_path / name, llama)  # a correct Llama-3.1-8B folder, either layout
    wrong = transformers5(LLAMA_31_8B)
    wrong["rope_parameters"]["rope_theta"] = 10000.0
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(ServesimError, match="rope_theta = 10000.0, the model 500000.0"):
        _check_config(tmp_path / "wrong", llama)


def test_compare_runs_the_real_backend_on_given_weights(source, tmp_path, capsys):
    """sim compare lists --weights, and refused it ("--weights ... does not apply to --backend costmodel"),
    and --backend real then refused its --profile: a comparison on real weights could not be run."""
    from pathlib import Path

    folder = save(tmp_path / "w", hf_state_dict(source.runner.model))
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,12,3\n0.01,20,2\n")
    profile = str(Path(__file__).resolve().parents[1] / "profiles" / "tiny-cpu.json")
    args = ["compare", str(trace), "--model", "tiny", "--device", "cpu", "--profile", profile, "--quiet"]
    assert main([*args, "--weights", str(folder), "--out", str(tmp_path / "c")]) == 0
    measured = json.loads((tmp_path / "c" / "measured" / "summary.json").read_text())
    assert measured["options"]["weights"] == str(folder) and measured["completed"] == 2
    # Neither run adds vLLM's host-time model (found by a review: the prediction did, on top of a profile
    # fitted to steps that hold the real backend's own CPU time, and the measured run's summary said so too).
    predicted = json.loads((tmp_path / "c" / "predicted" / "summary.json").read_text())
    assert measured["options"]["engine_clock"]["host_time"] is False
    assert predicted["options"]["engine_clock"]["host_time"] is False
    assert main([*args, "--backend", "real", "--out", str(tmp_path / "d")]) == 2
    assert "sim compare runs both backends itself" in capsys.readouterr().err
    # Found by a review: --backend costmodel (replay's default) was taken silently, and --profile roofline was
    # read as a missing file named roofline.
    assert main([*args, "--backend", "costmodel", "--out", str(tmp_path / "e")]) == 2
    assert "--backend costmodel: sim compare runs both backends itself" in capsys.readouterr().err
    roofline = [a if a != profile else "roofline" for a in args]
    assert main([*roofline, "--out", str(tmp_path / "f")]) == 2
    assert "--profile roofline: sim compare checks a calibrated cost model against the real backend" in \
        capsys.readouterr().err


def test_the_cost_models_cuda_graph_size_is_refused_by_the_real_backend(tmp_path, capsys):
    """Found by a review: --max-cudagraph-capture-size with --backend real was ignored, with a warning
    about pricing that never happens."""
    assert main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--limit", "3", "--backend", "real",
                 "--model", "tiny", "--max-cudagraph-capture-size", "8", "--out", str(tmp_path / "r")]) == 2
    assert "--max-cudagraph-capture-size prices the cost model's CUDA graphs; the real backend captures its own" in \
        capsys.readouterr().err
