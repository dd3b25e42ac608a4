"""NVIDIA's DeciLM models (model_type nemotron-nas: Llama-3.3-Nemotron-Super-49B and its Nano and
Ultra siblings) as vLLM builds them (vllm/model_executor/models/nemotron_nas.py,
DeciLMDecoderLayer): layers without attention or MLP, each MLP of its own width. The figures of
Super-49B are worked by hand from its block_configs: 80 layers, 49 with attention (8 KV heads of
128, n_heads_in_group 8 of 64 heads), MLPs of ffn_mult 5.25 (49 layers), 2.625 (6), 3.28125 (1),
1.3125 (10), 1.0 (8) and 0.5 (6) at hidden 8192."""

from __future__ import annotations

import copy

import pytest

from backends.costmodel.roofline import MoERooflineCostModel
from backends.costmodel.tensor_parallel import ALLREDUCE_LATENCY_S, tp_allreduce_seconds
from backends.hardware import HARDWARE
from backends.kv_capacity import kv_cache_groups, vllm_kv_cache
from backends.model_config import ModelConfig, ffn_mult_to_intermediate_size
from sim.errors import ServesimError
from tests.package_configs import package, raw, write

SUPER = "nvidia--Llama-3_3-Nemotron-Super-49B-v1"
# Super-49B's MLP widths by hand: int(2 x ffn_mult x 8192 / 3), up to a multiple of 256.
WIDTHS = {28672: 49,  # 5.25: 28672 exactly
          14336: 6,  # 2.625: 14336 exactly
          17920: 1,  # 3.28125: 17920 exactly
          7168: 10,  # 1.3125: 7168 exactly
          5632: 8,  # 1.0: int(5461.33) = 5461, up to 5632
          2816: 6}  # 0.5: int(2730.67) = 2730, up to 2816


def test_ffn_mult_rounds_as_vllm():
    """`_ffn_mult_to_intermediate_size`: truncate, then up to a multiple of 256 (a multiple stays)."""
    assert ffn_mult_to_intermediate_size(5.25, 8192) == 28672
    assert ffn_mult_to_intermediate_size(1.0, 8192) == 5632
    assert ffn_mult_to_intermediate_size(0.5, 8192) == 2816
    assert ffn_mult_to_intermediate_size(3.5, 4096) == 9728  # int(9557.33) = 9557 -> 38 x 256
    assert ffn_mult_to_intermediate_size(0.09375, 4096) == 256  # exactly 256


def test_super_49b_layers_as_vllm_builds_them():
    m = package(SUPER)
    assert (m.model_type, m.architecture) == ("nemotron-nas", "DeciLMForCausalLM")
    assert m.num_attention_layers == 49 and len(m.attention_layers) == 80
    first = raw(SUPER)["block_configs"]
    assert [not b["attention"]["no_op"] for b in first] == list(m.attention_layers)
    assert m.attention_layers[:3] == (True, True, True)
    assert m.num_key_value_heads == 8 and m.head_dim == 128  # 64 // 8; the top-level nulls are not read
    assert m.dense_mlp_widths == {14336: 6, 28672: 49, 17920: 1, 7168: 10, 5632: 8, 2816: 6}
    assert m.dense_mlp_widths == WIDTHS
    assert m.intermediate_size == 28672 and m.num_dense_mlp_layers == 80
    assert m.num_sublayers == 49 + 80


def test_super_49b_parameters_by_hand():
    m = package(SUPER)
    h = 8192
    attention = h * (64 + 2 * 8) * 128 + 64 * 128 * h  # qkv 83,886,080 + o 67,108,864 per attention layer
    mlp = sum(n * 3 * h * w for w, n in WIDTHS.items())  # gate, up, down: 3 x 8192 x 1,642,496
    embeddings = 2 * 128256 * h  # embedding and LM head, untied
    norms = (49 + 80) * h + h  # one per sublayer (input_layernorm with attention, post_ with the MLP), the final
    assert attention * 49 == 7_398_752_256 and mlp == 40_365_981_696
    assert m.num_parameters == 49 * attention + mlp + embeddings + norms == 49_867_145_216


def test_super_49b_weights_per_gpu_by_hand():
    m = package(SUPER)
    h, tp = 8192, 2
    parts = m.weight_bytes_by_part(tp)
    assert parts["attention"] == 49 * 2 * (h * (32 + 2 * 4) * 128 + 32 * 128 * h)
    assert parts["dense_mlp"] == sum(n * 2 * 3 * h * (w // tp) for w, n in WIDTHS.items()) == 40_365_981_696
    assert parts["norms"] == 2 * 130 * h
    assert parts["embeddings"] == 2 * 2 * (128256 // tp) * h  # 128256 is a multiple of 64: no padding
    assert parts["rope_cache"] == 2 * 131072 * 128
    assert m.weight_bytes_per_gpu(tp) == sum(parts.values()) == 49_901_764_608


def test_super_49b_kv_bytes_per_token_by_hand():
    """Only the 49 attention layers cache, K and V of 128 in bf16 per KV head on the GPU: 8 at TP 1,
    4 at TP 2, and at TP 16 one each (8 KV heads replicated, vLLM's max(1, 8 // 16))."""
    m = package(SUPER)
    assert m.kv_bytes_per_token(1) == 49 * 2 * 8 * 128 * 2 == 200_704
    assert m.kv_bytes_per_token(2) == 100_352
    assert m.kv_bytes_per_token(16) == 49 * 2 * 1 * 128 * 2 == 25_088
    assert m.kv_bytes_per_token(2, "fp8") == 50_176


def test_super_49b_kv_blocks_by_hand():
    """One full-attention group of the 49 attention layers; 30 GiB at TP 2 in blocks of 16 tokens:
    a block 16 x 100,352 = 1,605,632 bytes, 32,212,254,720 // 1,605,632 = 20,062 blocks."""
    m = package(SUPER)
    groups = kv_cache_groups(m)
    assert [(g.kind, g.num_layers) for g in groups] == [("full_attention", 49)]
    kv = vllm_kv_cache(m, 30 * 2**30, block_size=16, max_model_len=131072, max_in_flight_tokens=16384, tp=2)
    assert kv["bytes_per_block"] == 1_605_632 and kv["page_bytes_per_layer"] == 16 * 2 * 4 * 128 * 2
    assert kv["num_blocks"] == 20_062
    assert kv["tokens"] == int(20_062 / 8192 * 131072)  # 8192 blocks a request of 131072 tokens


def tiny(tmp_path, blocks: list, **top) -> ModelConfig:
    """A two-to-four-layer DeciLM config of hidden 1536 and 12 heads of 128."""
    config = {"model_type": "nemotron-nas", "architectures": ["DeciLMForCausalLM"], "hidden_size": 1536,
              "num_attention_heads": 12, "num_hidden_layers": len(blocks), "vocab_size": 1024,
              "max_position_embeddings": 4096, "intermediate_size": None, "num_key_value_heads": None,
              "hidden_act": "silu", "block_configs": blocks, **top}
    return ModelConfig.from_hf(write(tmp_path, config))


def block(group=4, mult=2.0, attention_no_op=False, ffn_no_op=False) -> dict:
    return {"attention": {"n_heads_in_group": None if attention_no_op else group, "no_op": attention_no_op,
                          "replace_with_linear": False, "sparsify": None, "window_length": None,
                          "num_sink_tokens": None, "unshifted_sink": False,
                          "use_prefill_window_in_sink_attention": False},
            "ffn": {"ffn_mult": None if ffn_no_op else mult, "no_op": ffn_no_op, "replace_with_linear": False,
                    "sparsify": None}}


def test_a_roofline_step_prices_each_layers_own_gemms_and_attention(tmp_path):
    """Layer 0: attention (4 KV heads) and an MLP of ffn_mult 2 (2048); layer 1: no attention, an MLP
    of ffn_mult 1 (1024); layer 2: attention, no MLP. At TP 2: two attention layers' projections,
    one gate_up/down pair per MLP width, attention in two layers, four all-reduces (one per attention or MLP)."""
    m = tiny(tmp_path, [block(3, 2.0), block(mult=1.0, attention_no_op=True), block(3, ffn_no_op=True)])
    assert m.mlp_widths == (2048, 1024, 0) and m.attention_layers == (True, False, True)
    hw = HARDWARE["H100-SXM"]
    cm = MoERooflineCostModel(m, hw, tp=2)
    t, h = 64, 1536
    linear, *_ = cm.dense_tokens(t)
    qkv_o = cm._gemm(t, h, (6 + 2 * 2) * 128, "bf16") + cm._gemm(t, 6 * 128, h, "bf16")
    mlps = sum(cm._gemm(t, h, 2 * i, "bf16") + cm._gemm(t, i, h, "bf16") for i in (1024, 512))
    assert linear == pytest.approx(2 * qkv_o + mlps, rel=1e-12)
    assert cm.request_seconds(1, 1000) == pytest.approx(2 * cm._attention_one_layer(1, 1000, None), rel=1e-12)
    one = 2 * (2 - 1) / 2 * t * h * 2 / hw.group_link(2)[1] + ALLREDUCE_LATENCY_S
    assert tp_allreduce_seconds(m, t, 2, hw) == pytest.approx(4 * one, rel=1e-12)  # 2 + 1 + 1 sublayers
    assert m.kv_bytes_per_token(2) == 2 * 2 * 2 * 128 * 2  # two attention layers, 2 of their 4 KV heads a GPU
    assert m.num_parameters == (2 * (h * (12 + 8) * 128 + 12 * 128 * h) + 3 * h * (2048 + 1024)
                                + 2 * 1024 * h + (2 + 2) * h + h)


def test_super_49b_tables_price_each_width_and_only_attention_layers():
    from backends.costmodel.frame import batch_aggregates
    from backends.costmodel.optables.moe import moe_table_model
    from backends.costmodel.optables.systems import require_package

    m = package(SUPER)
    cm = moe_table_model(m, HARDWARE["H100-SXM"], "h100_sxm", require_package() / "data", tp=2)
    assert [n for _, n in cm._linear_curves] == [49, 49] + [n for n in m.dense_mlp_widths.values() for _ in (0, 1)]
    assert cm.sources["linear"].startswith("gemm_perf") and cm.sources["attention"].startswith("attention tables")
    agg, chunks = batch_aggregates([1, 1], [999, 2999], 2)
    parts = cm.parts(agg, chunks, cm._dense(agg.num_tokens, agg.num_logits))
    one, _ = cm._attention[0, "generation"].at(2, 2000.0)
    assert parts["attention"] == pytest.approx(49 * one, rel=1e-12)
    assert cm._small_kernels_per_step(False) == 129 + 49 * 1 + 80 + 2  # norms, RoPE, SiLU-and-mul, embedding+norm
    ops = cm.cost_model_summary()["operators"]
    assert "router" not in ops and ops["lm_head"].startswith("gemm_perf")  # a dense model routes nothing


def test_the_real_backend_refuses_it_naming_the_cost_model():
    pytest.importorskip("torch")
    from backends.real.moe import check_runnable_moe

    with pytest.raises(ServesimError, match=r"nemotron-nas.*not in the real backend; run it with --backend costmodel"):
        check_runnable_moe(package(SUPER))


def broken(change):
    blocks = [block(4, 2.0), block(4, 1.0, attention_no_op=True)]
    top: dict = {}
    change(blocks, top)
    return blocks, top


@pytest.mark.parametrize("change,message", [
    (lambda b, t: t.update(block_configs=None), r"block_configs = None: a nemotron-nas \(DeciLM\) config needs"),
    (lambda b, t: t.update(num_hidden_layers=3), r"block_configs has 2 entries for num_hidden_layers = 3"),
    (lambda b, t: b.__setitem__(1, "layer"), r"block_configs\[1\] = 'layer', expected an object"),
    (lambda b, t: b[0]["ffn"].update(ffn_mult=0), r"block_configs\[0\].ffn.ffn_mult = 0, expected a number above 0"),
    (lambda b, t: b[0]["ffn"].update(ffn_mult="2.0"), r"ffn_mult = '2.0', expected a number above 0"),
    (lambda b, t: b[0]["ffn"].update(ffn_mult=True), r"ffn_mult = True, expected a number above 0"),
    (lambda b, t: b[0]["attention"].update(n_heads_in_group=5), r"n_heads_in_group = 5 does not divide "
                                                                r"num_attention_heads \(12\)"),
    (lambda b, t: b[0]["attention"].update(n_heads_in_group=None), r"n_heads_in_group = None, expected a whole"),
    (lambda b, t: b[0]["attention"].update(no_op=True), r"every block_configs entry has attention.no_op = true"),
    (lambda b, t: b.reverse(), r"block_configs\[0\] has an MLP before the first layer with attention "
                               r"\(block_configs\[1\]\)"),
    (lambda b, t: b[0]["attention"].update(replace_with_linear=True),
     r"attention.replace_with_linear = true: vLLM's DeciLMDecoderLayer does not read it"),
    (lambda b, t: b[1]["ffn"].update(replace_with_linear=True), r"block_configs\[1\].ffn.replace_with_linear = true"),
    (lambda b, t: b[0]["attention"].update(window_length=1024), r"attention.window_length = 1024: vLLM's "
                                                                r"DeciLMDecoderLayer ignores it"),
    (lambda b, t: b[0]["attention"].update(num_sink_tokens=4), r"attention.num_sink_tokens = 4"),
    (lambda b, t: b[0]["attention"].update(sparsify=["q"]), r"attention.sparsify = \['q'\]"),
    (lambda b, t: b[0]["ffn"].update(sparsify=["up"]), r"ffn.sparsify = \['up'\]"),
    (lambda b, t: b[0]["attention"].update(unshifted_sink=True), r"attention.unshifted_sink = true"),
    (lambda b, t: b[0]["attention"].update(use_prefill_window_in_sink_attention="yes"),
     r"use_prefill_window_in_sink_attention = 'yes', expected true or false"),
    (lambda b, t: b.__setitem__(1, block(6, 1.0)), r"different KV heads \(3 in layer 0, 2 in layer 1\)"),
    (lambda b, t: [x.__setitem__("ffn", {"no_op": True}) for x in b], r"every block_configs entry has ffn.no_op"),
    (lambda b, t: t.update(hidden_act="gelu"), r"config.json: hidden_act = 'gelu': vLLM's LlamaMLP runs silu only"),
    (lambda b, t: t.update(hidden_act=None), r"config.json: hidden_act = None: vLLM's LlamaMLP runs silu only"),
    (lambda b, t: b[0]["ffn"].update(hidden_act="relu"), r"block_configs\[0\].ffn.hidden_act = 'relu': vLLM's LlamaMLP"),
    (lambda b, t: t.update(mlp_bias=True), r"mlp_bias = true: servesim prices nemotron-nas"),
    (lambda b, t: t.update(sliding_window=4096), r"sliding_window = 4096: sliding windows in a nemotron-nas"),
])
def test_an_odd_block_config_is_refused_in_one_line(tmp_path, change, message):
    blocks, top = broken(change)
    blocks = copy.deepcopy(blocks)
    with pytest.raises(ServesimError, match=message) as e:
        tiny(tmp_path, blocks, **top)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_an_ffn_mult_that_rounds_to_an_mlp_of_width_0_is_refused(tmp_path):
    """At hidden 1536, ffn_mult 0.0009 gives int(2 x 0.0009 x 1536 / 3) = int(0.9216) = 0, a multiple
    of 256 already, so vLLM's `_ffn_mult_to_intermediate_size` builds an MLP 0 wide: a LlamaMLP with
    its post_attention_layernorm and all-reduce, not the no-op that width 0 means in `mlp_widths`.
    It was read as a no-op, a norm and an all-reduce short; it is refused. ffn_mult 0.001 gives
    int(1.024) = 1, up to 256, and is read."""
    blocks = [block(4, 2.0), block(4, 0.0009)]
    with pytest.raises(ServesimError, match=r"block_configs\[1\].ffn.ffn_mult = 0.0009 gives an MLP of "
                                            r"intermediate size 0 \(int\(2 x ffn_mult x 1536 / 3\) = 0\)") as e:
        tiny(tmp_path, blocks)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)
    assert tiny(tmp_path, [block(4, 2.0), block(4, 0.001)]).mlp_widths == (2048, 256)


def test_an_mlp_before_the_first_attention_layer_is_refused_whichever_layer(tmp_path):
    """DeciModel.forward starts with residual None, and only an attention layer's input_layernorm sets it;
    an MLP before that hands post_attention_layernorm no residual, and DeciLMDecoderLayer.forward's
    `hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)` fails. Layer 0
    with neither attention nor MLP, then layer 1 with an MLP only, is refused as layer 0 with an MLP
    only is (it was read); a layer of neither before the first attention is served."""
    nothing = block(attention_no_op=True, ffn_no_op=True)
    with pytest.raises(ServesimError, match=r"block_configs\[1\] has an MLP before the first layer with attention "
                                            r"\(block_configs\[2\]\)"):
        tiny(tmp_path, [nothing, block(mult=1.0, attention_no_op=True), block(4, 2.0)])
    m = tiny(tmp_path, [nothing, block(4, 2.0), block(mult=1.0, attention_no_op=True)])
    assert m.attention_layers == (False, True, False) and m.mlp_widths == (0, 2048, 1024)


def test_ffn_mult_is_rounded_to_6_places_as_the_checkpoints_config_reads_it(tmp_path):
    """vLLM reads block_configs through the checkpoint's own DeciLMConfig (trust_remote_code), whose
    block_config.py FFNConfig.__post_init__ sets ffn_mult = round(ffn_mult, 6). At hidden 1536,
    ffn_mult 0.25097655 unrounded gives int(256.9999872) = 256, a multiple already; rounded to
    0.250977 it gives int(257.000448) = 257, up to 512, the MLP vLLM builds."""
    m = tiny(tmp_path, [block(4, 2.0), block(4, 0.25097655)])
    assert m.mlp_widths == (2048, 512)
    assert ffn_mult_to_intermediate_size(0.25097655, 1536) == 256  # (the unrounded figure, once read)


def test_a_no_op_blocks_other_settings_are_not_read(tmp_path):
    """The remote DeciLM config clears a no-op attention's heads, window and sinks; vLLM reads none."""
    b = block(4, 1.0, attention_no_op=True)
    b["attention"].update(window_length=1024, n_heads_in_group=5)
    m = tiny(tmp_path, [block(4, 2.0), b])
    assert m.attention_layers == (True, False) and m.mlp_widths == (2048, 1024)


def test_a_block_with_its_own_intermediate_size(tmp_path):
    """vLLM's other branch: an ffn without ffn_mult takes its own intermediate_size."""
    b = block(4, 2.0)
    del b["ffn"]["ffn_mult"]
    b["ffn"]["intermediate_size"] = 3000
    m = tiny(tmp_path, [block(4, 2.0), b])
    assert m.mlp_widths == (2048, 3000) and m.intermediate_size == 3000
    with pytest.raises(ServesimError, match=r"cannot be divided among 16 GPUs"):
        m.check_parallel(16)


def test_the_parity_suites_copy_is_the_packages_file():
    """tests/moe_configs.py's NEMOTRON_SUPER_49B (for the parity suite) reads as the package's file does."""
    from backends.model_config import extended_from_hf
    from tests.moe_configs import NEMOTRON_SUPER_49B

    ours = extended_from_hf(NEMOTRON_SUPER_49B, "x/config.json")
    theirs = package(SUPER)
    assert ours.attention_layers == theirs.attention_layers and ours.mlp_widths == theirs.mlp_widths
    assert ours.num_parameters == theirs.num_parameters
