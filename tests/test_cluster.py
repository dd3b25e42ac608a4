"""Hand-computed cluster timelines (every step 1 s), and one replica through the cluster giving
exactly a lone engine's files.

    R0 arrives at 0.0 with a 4-token prompt and 3 output tokens
    R1 arrives at 0.5 with a 6-token prompt and 2 output tokens (4-token prompt in the 1P:1D case)
    R2 arrives at 0.5 with a 3-token prompt and 1 output token
Chunked, token budget 8, block size 4.
"""

from __future__ import annotations

import filecmp
import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from backends.model_config import ModelConfig
from sim.app.cluster_options import ClusterOptions
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import make_cluster, make_requests, replay, write_run
from sim.batch import Batch
from sim.config import CacheConfig, SchedulerConfig
from sim.errors import ServesimError
from tests.helpers import ConstantBackend, make_trace

MODEL = "Qwen3-0.6B"
BLOCK_BYTES = 4 * ModelConfig.from_preset(MODEL).kv_bytes_per_token()  # one 4-token block: 458,752 bytes


def options(cluster: ClusterOptions, num_blocks: int = 64) -> ReplayOptions:
    # The worked examples below are synchronous vLLM's (each step scheduled once the one before ends).
    return ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=8, max_num_seqs=4,
                                                   async_scheduling=False, host_time=False),
                         cache=CacheConfig(block_size=4, num_blocks=num_blocks), cluster=cluster, model=MODEL)


def tokens(result) -> dict[str, list[float]]:
    return {r.request_id: result.tokens_of(i).tolist() for i, r in enumerate(result.requests)}


def steps(result) -> list[tuple]:
    s = result.steps
    return list(zip(s.replica.tolist(), s.start_s.tolist(), s.num_prefill_tokens.tolist(), s.num_decode_tokens.tolist()))


def test_two_round_robin_replicas():
    # Round robin: R0 -> replica 0, R1 -> replica 1, R2 -> replica 0.
    # Replica 0: t=0 R0's prompt; t=1 R0 decodes and R2's prompt (R2 done at 2); t=2 R0 decodes.
    # Replica 1 sleeps until R1 arrives at 0.5: its prompt, then one decode.
    result = replay(make_trace([(0.0, 4, 3), (0.5, 6, 2), (0.5, 3, 1)]),
                    resolve(options(ClusterOptions(num_replicas=2)), backend=ConstantBackend(1.0)))
    assert steps(result) == [(0, 0.0, 4, 0), (1, 0.5, 6, 0), (0, 1.0, 3, 1), (1, 1.5, 0, 1), (0, 2.0, 0, 1)]
    assert tokens(result) == {"0": [1.0, 2.0, 3.0], "1": [1.5, 2.5], "2": [2.0]}
    assert result.replica_of.tolist() == [0, 1, 0]
    assert [r.num_requests for r in result.replicas] == [2, 1]
    assert result.end_s == 3.0


def test_one_prefill_one_decode_replica():
    # The link moves one 4-token block in 0.25 + 0.25 s. The decode replica has 2 blocks: a request
    # needs 2 (its 4-token context and the next token's slot) before it decodes there.
    #   prefill: t=0 R0's prompt (first token at 1); t=1 R1's prompt (first token at 2)
    #   R0's blocks cross 1 -> 1.5, R1's 2 -> 2.5; the prefill replica frees each at its end
    #   decode:  t=1.5 R0 decodes (token 2 at 2.5; it now holds both blocks)
    #            t=2.5 R1 has arrived but waits for blocks; R0 decodes (token 3 at 3.5, finished)
    #            t=3.5 R1 decodes (token 2 at 4.5)
    cluster = ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1, kv_transfer_latency_s=0.25,
                             kv_transfer_bandwidth_gb_s=BLOCK_BYTES / 0.25 / 1e9, decode_options="num-blocks=2")
    result = replay(make_trace([(0.0, 4, 3), (0.5, 4, 2)]), resolve(options(cluster), backend=ConstantBackend(1.0)))
    # (0.25 + 458752 / (1835008.0000000002 B/s) rounds to 0.5 exactly: these times are exact.)
    assert steps(result) == [(0, 0.0, 4, 0), (0, 1.0, 4, 0), (1, 1.5, 0, 1), (1, 2.5, 0, 1), (1, 3.5, 0, 1)]
    assert tokens(result) == {"0": [1.0, 2.5, 3.5], "1": [2.0, 4.5]}
    t = result.transfers
    assert t["start_s"].tolist() == [1.0, 2.0]
    assert t["end_s"].tolist() == [1.5, 2.5]
    assert t["bytes"].tolist() == [BLOCK_BYTES, BLOCK_BYTES]
    assert t["decode_replica"].tolist() == [1, 1]
    prefill, decode = result.replicas
    # R0 holds its block on the prefill replica until its transfer ends at 1.5.
    assert prefill.steps.num_kv_blocks_used.tolist() == [1, 2]
    assert decode.steps.num_kv_blocks_used.tolist() == [2, 2, 2]
    assert [r.first_token_s for r in result.requests] == [1.0, 2.0]  # TTFT ends on the prefill replica
    assert (prefill.role, decode.role) == ("prefill", "decode")


def test_a_request_with_one_output_token_finishes_on_its_prefill_replica():
    cluster = ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1)
    result = replay(make_trace([(0.0, 4, 1)]), resolve(options(cluster), backend=ConstantBackend(1.0)))
    assert tokens(result) == {"0": [1.0]}
    assert np.isnan(result.transfers["start_s"]).all() and len(result.replicas[1].steps) == 0


def test_a_request_the_decode_replica_can_never_hold_is_rejected_when_it_arrives():
    cluster = ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1, decode_options="num-blocks=1")
    result = replay(make_trace([(0.0, 4, 3), (0.0, 2, 2)]), resolve(options(cluster), backend=ConstantBackend(1.0)))
    rejected, kept = result.requests
    assert rejected.reject_reason == "needs 2 KV blocks, the decode replica's whole cache has 1"
    assert tokens(result)["1"] == pytest.approx([1.0, 2.0], abs=1e-3)
    assert len(result.replicas[0].steps) == 1  # the rejected request never reached the prefill replica


def test_pools_take_their_own_options():
    cluster = ClusterOptions(num_prefill_replicas=2, num_decode_replicas=3,
                             prefill_options="policy=prefill-first,max-num-batched-tokens=4096",
                             decode_options="max-num-seqs=2,hardware=H200")
    plan = resolve(options(cluster))
    prefill, decode = plan.pools
    assert (prefill.options.scheduler.policy, prefill.options.scheduler.max_num_batched_tokens) == ("prefill-first", 4096)
    assert (decode.options.scheduler.max_num_seqs, decode.options.hardware, decode.options.cache.enable_prefix_caching) \
        == (2, "H200", False)
    recorded = plan.as_dict()["cluster"]
    assert recorded["prefill"]["scheduler"]["policy"] == "prefill-first" and recorded["decode"]["hardware"] == "H200"
    # Flags left unset on the command line: each pool takes vLLM's defaults for its own GPU, but never over a
    # value the pool sets (the prefill pool's budget, the decode pool's --max-num-seqs).
    unset = ("max_num_batched_tokens", "max_num_seqs")
    prefill, decode = resolve(replace(options(cluster), batch_defaults=unset)).pools
    assert (prefill.options.scheduler.max_num_batched_tokens, prefill.options.scheduler.max_num_seqs) == (4096, 1024)
    assert (decode.options.scheduler.max_num_batched_tokens, decode.options.scheduler.max_num_seqs) == (8192, 2)


def test_each_pool_is_priced_on_its_own_hardware_tp_and_dtype():
    """A pool's hardware, TP or dtype prices its steps (its own backend), not the top level's."""
    base = resolve(options(ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1)))
    batch = Batch()
    batch.add("r", 0, 2048, list(range(2048)), needs_logits=True, is_decode=False, token_source=list(range(2048)))
    seconds = {name: plan.backend.execute(batch).seconds for name, plan in zip(("prefill", "decode"), base.pools)}
    assert seconds["prefill"] == seconds["decode"]
    for pool_options, faster in (("hardware=A100-80GB", False), ("tp=2", True)):
        plan = resolve(options(ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1,
                                              prefill_options=pool_options)))
        prefill, decode = plan.pools
        assert decode.backend.execute(batch).seconds == seconds["decode"]
        assert (prefill.backend.execute(batch).seconds < seconds["prefill"]) is faster, pool_options
        assert prefill.backend.execute(batch).seconds != seconds["prefill"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_prefill_replicas=2), "disaggregation needs both pools"),
    (dict(num_replicas=0), "--replicas must be a whole number from 1 to 1,024 replicas, got 0"),
    (dict(num_replicas=2, num_prefill_replicas=1, num_decode_replicas=1), "counts colocated replicas"),
    (dict(num_replicas=2, kv_transfer_latency_s=0.1), "apply only with --prefill-replicas"),
    (dict(num_prefill_replicas=1, num_decode_replicas=1, kv_transfer_bandwidth_gb_s=0.0),
     "--kv-transfer-bandwidth must be a number from 0.001 to 100000 GB/s, got 0 "),
    (dict(num_prefill_replicas=1, num_decode_replicas=1, decode_options="colour=red"), "cannot read 'colour=red'"),
    (dict(num_prefill_replicas=1, num_decode_replicas=1, prefill_options="num-blocks=many"), "not a whole number"),
    (dict(num_prefill_replicas=1, num_decode_replicas=1, prefill_options="num-blocks=100,num-gpu-blocks=200"),
     r"num-gpu-blocks is given twice \(as num-blocks\)"),
])
def test_cluster_options_are_checked(kwargs, message):
    with pytest.raises(ServesimError, match=message):
        ClusterOptions(**kwargs)


def test_kv_link_defaults_by_where_the_pools_sit():
    inside = ClusterOptions(num_prefill_replicas=2, num_decode_replicas=6).kv_link()
    across = ClusterOptions(num_prefill_replicas=4, num_decode_replicas=12).kv_link()
    assert (inside.bandwidth_gb_s, inside.latency_s) == (450.0, 5e-6)
    assert (across.bandwidth_gb_s, across.latency_s) == (50.0, 2e-5)
    assert across.seconds(50 * 10**9) == pytest.approx(1.0 + 2e-5)
    with_tp = resolve(options(ClusterOptions(num_prefill_replicas=2, num_decode_replicas=2,
                                             decode_options="tp=4"))).kv_link()  # 2 + 2 x 4 GPUs: two nodes
    assert (with_tp.bandwidth_gb_s, with_tp.latency_s) == (50.0, 2e-5)


@pytest.mark.parametrize("with_prefixes", [False, True])
def test_one_replica_through_the_cluster_writes_a_lone_engines_files_byte_for_byte(tmp_path, with_prefixes):
    from traces import AZURE_CONV_SAMPLE, read_trace
    from traces.trace import Trace

    full = read_trace(AZURE_CONV_SAMPLE)
    n = 200
    hash_ids = None
    if with_prefixes:  # every third request shares the first 512-token block of its predecessor
        hash_ids = [np.arange(-(-p // 512)) + (i - i % 3) * 1000 for i, p in enumerate(full.prompt_tokens[:n].tolist())]
    trace = Trace(full.arrival_s[:n] * 0.25, full.prompt_tokens[:n], full.output_tokens[:n], hash_ids=hash_ids,
                  source="sample")
    plan = resolve(ReplayOptions(cache=CacheConfig(num_blocks=4000)))
    lone = replay(trace, plan)
    requests = sorted(make_requests(trace), key=lambda r: (r.arrival_s, r.index))
    through_cluster = make_cluster(plan, requests).run()
    assert len(through_cluster.replicas) == 1
    for name, result in (("lone", lone), ("cluster", through_cluster)):
        write_run(tmp_path / name, result, plan, trace)
    for file in ("requests.csv", "steps.parquet", "summary.json", "digest.json", "report.html"):
        assert filecmp.cmp(tmp_path / "lone" / file, tmp_path / "cluster" / file, shallow=False), file
    assert "cluster" not in json.loads((tmp_path / "lone" / "summary.json").read_text())["options"]


def test_sim_replay_of_a_disaggregated_cluster_writes_which_replica_did_what(tmp_path, capsys):
    from sim.app.cli import main
    from traces import AZURE_CONV_SAMPLE

    out = tmp_path / "run"
    assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "100", "--prefill-replicas", "1", "--decode-replicas", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 prefill + 2 decode replicas (round-robin), KV link 450 GB/s + 5e-06 s" in printed
    assert "KV transfers 100" in printed
    # each pool's own policy and engine, on a line of its own (a pool may differ from the top level)
    assert "\n  prefill pool: chunked, Llama-3.1-8B on H100-SXM" in printed
    assert "\n  decode pool: chunked, Llama-3.1-8B on H100-SXM" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert [r["role"] for r in summary["replicas"]] == ["prefill", "decode", "decode"]
    assert [r["requests"] for r in summary["replicas"]] == [100, 50, 50]  # 100 requests, all with 2+ tokens
    assert summary["num_kv_transfers"] == 100 and summary["kv_transfer_s"]["p99"] > 5e-6
    steps = pd.read_parquet(out / "steps.parquet")
    assert list(steps.columns[:2]) == ["step", "replica"] and set(steps["replica"]) == {0, 1, 2}
    assert (steps[steps["replica"] == 0]["num_decode_tokens"] == 0).all()
    requests = pd.read_csv(out / "requests.csv")
    assert (requests["kv_transfer_start_s"] == requests["first_token_s"]).all()
    assert requests["kv_transfer_bytes"].sum() == summary["kv_transfer_bytes"]
    assert "Load per replica" in (out / "report.html").read_text()


def test_a_sweep_row_carries_the_load_per_replica(tmp_path):
    from sim.app.sweep import make_point, run_point
    from traces import AZURE_CONV_SAMPLE, read_trace
    from traces.trace import Trace

    full = read_trace(AZURE_CONV_SAMPLE)
    trace = Trace(full.arrival_s[:60], full.prompt_tokens[:60], full.output_tokens[:60], source="sample")
    point = make_point({"policy": "chunked", "model": "Llama-3.1-8B", "hardware": "H100-SXM",
                        "max_num_batched_tokens": 2048, "max_num_seqs": 256, "max_num_active_seqs": 0,
                        "long_prefill_token_threshold": 0, "scheduling_policy": "fcfs", "prefill_schedule_interval": 1,
                        "watermark": 0.0, "cache_aware_admission_window": 0, "stream_interval": 1, "rate_scale": 1.0,
                        "seed": 0},
                       lambda v: ReplayOptions(cluster=ClusterOptions(num_replicas=3)))
    row = run_point(trace, point)
    assert row["status"] == "ok", row["error"]
    assert row["replica_requests"] == [20, 20, 20] and row["cluster_num_replicas"] == 3


@pytest.mark.parametrize("args, fragment", [
    (["--prefill-replicas", "2"], "disaggregation needs both pools"),
    (["--replicas", "2", "--backend", "real"], "a cluster replays with the cost model"),
    (["--replicas", "2", "--router", "nearest"], "unknown router 'nearest'"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-options", "policy=fifo"], "unknown policy 'fifo'"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-options", "tp=0"],
     "--decode-options: tp must be a whole number from 1 to 1,024 GPUs, got 0"),
])
def test_nonsense_cluster_options_are_one_line_errors(tmp_path, capsys, args, fragment):
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
    assert main(["replay", str(trace), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and err.count("\n") == 1 and fragment in err, err


def test_sim_bench_refuses_a_cluster(tmp_path, capsys):
    from sim.app.cli import main

    assert main(["bench", "--replicas", "2", "--num-prompts", "4", "--concurrency", "2", "--input-len", "16",
                 "--output-len", "4", "--out", str(tmp_path / "b")]) == 2
    assert "sim bench's closed loop drives one engine" in capsys.readouterr().err


def test_kv_link_defaults_follow_the_hardwares_node():
    """The presets' node (8 GPUs, NVLink 450 GB/s, 50 GB/s network on H100/H200) gives the figures
    of before; another node gives its own: A100's 300 and 25 GB/s, a 4-GPU node's boundary."""
    import dataclasses

    from backends.hardware import HARDWARE

    cluster = ClusterOptions(num_prefill_replicas=2, num_decode_replicas=6)
    assert cluster.kv_link(8, HARDWARE["H100-SXM"]) == cluster.kv_link(8)
    assert cluster.kv_link(16, HARDWARE["H200"]) == cluster.kv_link(16)
    a100 = HARDWARE["A100-80GB"]
    assert (cluster.kv_link(8, a100).bandwidth_gb_s, cluster.kv_link(16, a100).bandwidth_gb_s) == (300.0, 25.0)
    four = dataclasses.replace(HARDWARE["H100-SXM"], gpus_per_node=4, inter_node_bandwidth=100e9)
    assert (cluster.kv_link(4, four).bandwidth_gb_s, cluster.kv_link(5, four).bandwidth_gb_s) == (450.0, 100.0)
    assert cluster.kv_link(5, four).latency_s == 2e-5
    given = ClusterOptions(num_prefill_replicas=2, num_decode_replicas=6, kv_transfer_bandwidth_gb_s=7.0)
    assert given.kv_link(16, a100).bandwidth_gb_s == 7.0


def test_pools_on_two_kinds_of_gpu_meet_over_the_network():
    """A prefill pool on H200s and a decode pool on A100s are two nodes, however few their GPUs:
    the A100's 25 GB/s network (the slower), RDMA's setup time."""
    import dataclasses

    two = options(ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1, decode_options="hardware=A100-80GB"))
    link = resolve(dataclasses.replace(two, hardware="H200")).kv_link()
    assert (link.bandwidth_gb_s, link.latency_s) == (25.0, 2e-5)
    one = options(ClusterOptions(num_prefill_replicas=1, num_decode_replicas=1))
    same = resolve(dataclasses.replace(one, hardware="H200")).kv_link()
    assert (same.bandwidth_gb_s, same.latency_s) == (450.0, 5e-6)
