"""The real backend's mixture-of-experts layers (Qwen3-MoE, Mixtral) on the CPU in fp32.

1. The MoE layer against a plain per-token reference written here (no transformers needed).
2. Whole tiny MoE models in mixed paged batches (prefill + decode, chunked prefill) against each
   sequence computed alone.
3. Against Hugging Face transformers (its own modeling_qwen3_moe.py and modeling_mixtral.py, the
   weights loaded by its from_pretrained from the hub's tensor names): logits and greedy tokens;
   and the dense decoder (Qwen3 with QK-norm, Llama with Llama 3.1's RoPE scaling) the same way.
   Skipped where transformers is not installed (CI's main venv); run with .venv-parity's python (.ci/run does).
4. What the real backend refuses (MLA, sliding windows, shared experts, other MoE families): one
   line naming the cost model.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backends.real import RealBackend  # noqa: E402
from backends.real.backend import num_parameters  # noqa: E402
from backends.real.model import check_runnable  # noqa: E402
from backends.real.moe import MoeSpec, moe_forward, moe_spec, tiny_moe  # noqa: E402
from backends.real.ops import TORCH_OPS  # noqa: E402
from backends.real.reference import dense_logits  # noqa: E402
from backends.real.weights import hf_state_dict  # noqa: E402
from sim.batch import Batch  # noqa: E402
from sim.errors import ServesimError  # noqa: E402
from tests.helpers import run, tokens  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral")


# 1. The layer against a per-token reference.


def per_token_moe(x, router, w13, w2, top_k, renormalize):
    """Token by token, expert by expert, in float64: the router's softmax over all experts, the k
    largest probabilities (ties to the lower expert id), renormalised if asked, each chosen expert's
    SwiGLU MLP weighted by its probability."""
    x, router, w13, w2 = (t.double() for t in (x, router, w13, w2))
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], dim=0).tolist()
        chosen = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            hidden = gate / (1 + torch.exp(-gate)) * up
            out[t] += probs[e] / total * (w2[e] @ hidden)
    return out


def margin(x, router, top_k):
    """The smallest gap, over tokens, between the k-th and (k+1)-th router probability: a routing
    decision closer than float32 rounding could go either way in two correct implementations."""
    probs = torch.softmax((x.double() @ router.double().T), dim=-1).sort(dim=-1, descending=True).values
    if top_k == probs.shape[1]:
        return 1.0
    return (probs[:, top_k - 1] - probs[:, top_k]).min().item()


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(0, 40), num_experts=st.integers(1, 9), k=st.integers(1, 4),
       hidden=st.sampled_from([8, 16, 24]), inter=st.sampled_from([4, 8, 20]), renormalize=st.booleans(),
       seed=st.integers(0, 2**16))
def test_moe_layer_matches_a_per_token_reference(num_tokens, num_experts, k, hidden, inter, renormalize, seed):
    k = min(k, num_experts)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    if num_tokens and margin(x, router, k) < 1e-5:
        return  # a near-tie: either choice is right
    spec = MoeSpec(num_experts, k, inter, renormalize, frozenset())
    got = moe_forward(TORCH_OPS, x, router, w13, w2, spec)
    want = per_token_moe(x, router, w13, w2, k, renormalize)
    assert got.shape == (num_tokens, hidden) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (got.double() - want).abs().max()


def test_worked_example_two_experts_top1_and_renormalised():
    # Hidden 1, intermediate 1: expert e computes w2[e] * silu(g_e x) * (u_e x).
    x = torch.tensor([[1.0], [-2.0]])
    router = torch.tensor([[1.0], [0.0]])  # logits (x, 0): token 0 prefers expert 0, token 1 expert 1
    w13 = torch.tensor([[[1.0], [2.0]], [[3.0], [1.0]]])  # expert 0: g=1, u=2; expert 1: g=3, u=1
    w2 = torch.tensor([[[1.0]], [[-1.0]]])
    silu = torch.nn.functional.silu
    p0 = torch.softmax(torch.tensor([1.0, 0.0]), 0)[0]  # token 0's probability of expert 0
    p1 = torch.softmax(torch.tensor([-2.0, 0.0]), 0)[1]  # token 1's probability of expert 1
    raw = moe_forward(TORCH_OPS, x, router, w13, w2, MoeSpec(2, 1, 1, False, frozenset()))
    assert torch.allclose(raw[:, 0], torch.stack([p0 * silu(torch.tensor(1.0)) * 2,
                                                  p1 * -(silu(torch.tensor(-6.0)) * -2)]))
    renormalised = moe_forward(TORCH_OPS, x, router, w13, w2, MoeSpec(2, 1, 1, True, frozenset()))
    assert torch.allclose(renormalised[:, 0], torch.stack([silu(torch.tensor(1.0)) * 2,
                                                           -(silu(torch.tensor(-6.0)) * -2)]))


def test_sparse_layers_follow_each_family():
    assert moe_spec(tiny_moe("qwen3_moe")).sparse_layers == {0, 1}
    assert moe_spec(tiny_moe("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
                    ).sparse_layers == {1, 5}
    assert moe_spec(tiny_moe("qwen3_moe", num_hidden_layers=4, first_k_dense_replace=1)).sparse_layers == {1, 2, 3}
    spec = moe_spec(tiny_moe("mixtral", norm_topk_prob=False))
    assert spec.renormalize  # Mixtral always renormalises its top-k
    assert moe_spec(tiny_moe("qwen3_moe", norm_topk_prob=False)).renormalize is False
    # Parameters worked by hand: Qwen3-MoE tiny: per layer q,k,v,o 64*(64+32+32) + 64*64, norms 2*64 + 2*16,
    # router 8*64, experts 8 * 3 * 32 * 64; embeddings and LM head 2 * 512 * 64; final norm 64.
    per_layer = 64 * 128 + 64 * 64 + 2 * 64 + 2 * 16 + 8 * 64 + 8 * 3 * 32 * 64
    assert num_parameters(tiny_moe("qwen3_moe")) == 2 * per_layer + 2 * 512 * 64 + 64
    dense_one = tiny_moe("qwen3_moe", mlp_only_layers=(0,))  # layer 0's MLP has intermediate_size 96
    assert num_parameters(dense_one) == (per_layer + per_layer - 8 * 64 - 8 * 3 * 32 * 64 + 3 * 96 * 64
                                         + 2 * 512 * 64 + 64)


# 2. Whole models in mixed paged batches against each sequence alone.


_BACKENDS: dict = {}


def backend_for(family, block_size=4, seed=3):
    key = (family, block_size, seed)
    if key not in _BACKENDS:
        _BACKENDS[key] = RealBackend(tiny_moe(family), device="cpu", block_size=block_size, num_blocks=96, seed=seed)
    return _BACKENDS[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_step_matches_each_request_alone(family):
    be = backend_for(family)
    a, b, c = tokens(11, 7), tokens(12, 5), tokens(13, 22)
    perm = np.random.default_rng(0).permutation(np.arange(96)).tolist()
    tables = [perm[0:3], perm[3:5], perm[5:12]]
    step1 = run(be, [(a, 0, 7, tables[0], True), (b, 0, 5, tables[1], True), (c, 0, 10, tables[2], False)])
    next_a, next_b = step1.argmax(-1).tolist()
    a2, b2 = a + [next_a], b + [next_b]
    step2 = run(be, [(a2, 7, 1, tables[0], True), (b2, 5, 1, tables[1], True), (c, 10, 12, tables[2], True)])
    for got, ids in ((step1[0], a), (step1[1], b), (step2[0], a2), (step2[1], b2), (step2[2], c)):
        err = (got - dense_logits(be.model, ids)[-1]).abs().max().item()
        assert err <= 1e-4, err


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), block_size=st.sampled_from([1, 4, 16]),
       lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), chunk=st.integers(1, 12),
       data=st.data())
def test_any_chunked_mixed_batch_matches_dense_reference(family, block_size, lengths, chunk, data):
    be = backend_for(family, block_size)
    cached = [data.draw(st.integers(0, n - 1)) for n in lengths]
    seqs = [tokens(100 + 7 * i + n, n) for i, n in enumerate(lengths)]
    need = [-(-n // block_size) for n in lengths]
    perm = data.draw(st.permutations(range(96)))
    if sum(need) > 96:
        return
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    done = [0] * len(seqs)
    while any(d < c for d, c in zip(done, cached)):
        b = Batch()
        for i, (ids, table, d, c) in enumerate(zip(seqs, tables, done, cached)):
            if d < c:
                b.add(str(i), d, min(chunk, c - d), table, False, token_source=ids)
        be.runner.logits(b.flatten(block_size))
        done = [min(c, d + chunk) for d, c in zip(done, cached)]
    logits = run(be, [(ids, c, n - c, table, True) for ids, c, n, table in zip(seqs, cached, lengths, tables)])
    for row, ids in enumerate(seqs):
        err = (logits[row] - dense_logits(be.model, ids)[-1]).abs().max().item()
        assert err <= 1e-4, (row, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_weights_round_trip_through_hub_names(family, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    source = backend_for(family)
    tensors = hf_state_dict(source.model)
    if family == "mixtral":
        assert tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 48)
        assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 64)
    else:
        assert tensors["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (32, 64)
        assert tensors["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = RealBackend(tiny_moe(family), block_size=4, num_blocks=96, seed=99, weights=str(tmp_path))
    ids = tokens(5, 9)
    assert torch.equal(dense_logits(loaded.model, ids), dense_logits(source.model, ids))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(family) | {"num_experts_per_tok": 3}))
    with pytest.raises(ServesimError, match="num_experts_per_tok = 3, the model 2"):
        RealBackend(tiny_moe(family), block_size=4, num_blocks=96, weights=str(tmp_path))


# 3. Against Hugging Face transformers.


def hf_config(family):
    """The tiny model's config.json as the hub writes one for the family."""
    cfg = tiny_moe(family)
    common = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
              "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
              "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False, "hidden_act": "silu",
              "num_experts_per_tok": cfg.num_experts_per_tok, "torch_dtype": "float32"}
    if family == "mixtral":
        return common | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                         "intermediate_size": cfg.moe_intermediate_size, "num_local_experts": cfg.num_experts,
                         "sliding_window": None, "router_jitter_noise": 0.0}
    return common | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                     "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
                     "num_experts": cfg.num_experts, "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
                     "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
                     "attention_bias": False}


def hugging_face_model(family, backend, folder):
    """transformers' own model of the family, its weights read by from_pretrained from our tensors
    saved under the hub's names (transformers fuses the experts itself, conversion_mapping.py)."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(hf_state_dict(backend.model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(family)))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager")
    assert type(model).__name__ == hf_config(family)["architectures"][0]
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hugging_face_transformers(family, tmp_path):
    pytest.importorskip("transformers")
    be = RealBackend(tiny_moe(family), device="cpu", block_size=4, num_blocks=96, seed=21)
    hf = hugging_face_model(family, be, tmp_path)
    seqs = [tokens(31, 9), tokens(32, 4), tokens(33, 23)]

    def hf_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()

    # Every position of a whole sequence, computed alone by both.
    for ids in seqs:
        want = hf_logits(ids)
        assert (dense_logits(be.model, ids) - want).abs().max().item() <= 1e-4
    # A mixed paged batch: step 1 prefills A and B and the first 10 tokens of C; step 2 decodes A and B
    # beside C's second chunk; then decode steps, each request fed its greedy token, against
    # transformers' greedy generate.
    perm = np.random.default_rng(1).permutation(np.arange(96)).tolist()
    tables = [perm[0:4], perm[4:7], perm[7:16]]
    a, b, c = seqs
    step1 = run(be, [(a, 0, 9, tables[0], True), (b, 0, 4, tables[1], True), (c, 0, 10, tables[2], False)])
    for got, ids in ((step1[0], a), (step1[1], b)):
        assert (got - hf_logits(ids)[-1]).abs().max().item() <= 1e-4
    a, b = a + [int(step1[0].argmax())], b + [int(step1[1].argmax())]
    step2 = run(be, [(a, 9, 1, tables[0], True), (b, 4, 1, tables[1], True), (c, 10, 13, tables[2], True)])
    for got, ids in zip(step2, (a, b, c)):
        assert (got - hf_logits(ids)[-1]).abs().max().item() <= 1e-4
    a, b, c = (s + [int(row.argmax())] for s, row in zip((a, b, c), step2))
    for _ in range(4):  # decode-only steps
        rows = run(be, [(s, len(s) - 1, 1, t, True) for s, t in zip((a, b, c), tables)])
        a, b, c = (s + [int(row.argmax())] for s, row in zip((a, b, c), rows))
    for ours, prompt in zip((a, b, c), seqs):
        new = len(ours) - len(prompt)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                 pad_token_id=0)[0].tolist()
        assert ours == theirs


DENSE = {
    # The tiny preset is Qwen3-style (QK-norm); the Llama one has Llama 3.1's RoPE scaling.
    "qwen3": ("tiny", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                       "use_sliding_window": False, "sliding_window": None}),
    "llama": (None, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                     "mlp_bias": False, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}}),
}


@pytest.mark.parametrize("family", sorted(DENSE))
def test_dense_models_match_hugging_face_transformers(family, tmp_path):
    """The dense decoder too, so that the MoE comparison above stands on a checked attention path."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from backends.model_config import ModelConfig

    preset, extra = DENSE[family]
    if preset is not None:
        cfg = ModelConfig.from_preset(preset)
    else:
        cfg = ModelConfig(name="tiny-llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                          max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=False, qk_norm=False, rope_scaling=extra["rope_scaling"])
    be = RealBackend(cfg, device="cpu", block_size=4, num_blocks=96, seed=5)
    safetensors_torch.save_file(hf_state_dict(be.model), str(tmp_path / "model.safetensors"))
    config = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
              "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
              "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False, "hidden_act": "silu"} | extra
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    a, c = tokens(41, 9), tokens(42, 150)  # c reaches past the llama3 scaling's original context
    perm = np.random.default_rng(2).permutation(np.arange(96)).tolist()
    run(be, [(c, 0, 100, perm[:38], False)])
    logits = run(be, [(a, 0, 9, perm[38:41], True), (c, 100, 50, perm[:38], True)])
    with torch.no_grad():
        for row, ids in zip(logits, (a, c)):
            assert (row - hf(torch.tensor([ids])).logits[0, -1].float()).abs().max().item() <= 1e-4


# 4. Refusals.


@pytest.mark.parametrize("overrides,message", [
    ({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128},
     "multi-head latent attention (kv_lora_rank = 512)"),
    ({"sliding_window": 4096}, "sliding-window attention (sliding_window = 4096)"),
    ({"sliding_window": 128, "layer_types": ("sliding_attention", "full_attention")}, "sliding_window = 128"),
    ({"shared_expert_intermediate_size": 256}, "shared experts (shared_expert_intermediate_size = 256)"),
    ({"model_type": "gpt_oss"}, "not model_type 'gpt_oss'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_refused_in_one_line_naming_the_cost_model(overrides, message):
    with pytest.raises(ServesimError) as e:  # a bad top-k may already be refused by ModelConfig itself
        check_runnable(tiny_moe("qwen3_moe", **overrides))
    assert message in str(e.value) and "\n" not in str(e.value)
    if "num_experts_per_tok" in overrides:
        return
    assert "--backend costmodel" in str(e.value)
    with pytest.raises(ServesimError, match="--backend costmodel"):
        RealBackend(tiny_moe("qwen3_moe", **overrides), num_blocks=8)
    # A window that no layer uses is no window.
    check_runnable(tiny_moe("qwen3_moe", sliding_window=4096, layer_types=("full_attention",) * 2))


def test_cli_real_backend_refuses_an_mla_model_with_exit_2(tmp_path, capsys, monkeypatch):
    import sim.app.plan as plan
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,2\n")
    monkeypatch.setattr(plan, "resolve_model", lambda name: tiny_moe("qwen3_moe", name=name, kv_lora_rank=512,
                                                                     qk_rope_head_dim=64, qk_nope_head_dim=128,
                                                                     v_head_dim=128))
    rc = main(["replay", str(trace), "--backend", "real", "--model", "DeepSeek-V3", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert "kv_lora_rank = 512" in err and "--backend costmodel" in err


def test_cli_real_backend_runs_a_tiny_moe_model(tmp_path, capsys, monkeypatch):
    import pandas as pd

    import sim.app.plan as plan
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,30,4\n0.0,12,6\n0.0,50,3\n")
    monkeypatch.setattr(plan, "resolve_model", lambda name: tiny_moe("mixtral"))
    rc = main(["replay", str(trace), "--backend", "real", "--model", "tiny-mixtral", "--max-num-batched-tokens", "32",
               "--max-num-seqs", "4", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    requests = pd.read_csv(tmp_path / "o" / "requests.csv")
    assert (requests["status"] == "finished").all() and requests["output_tokens"].tolist() == [4, 6, 3]
