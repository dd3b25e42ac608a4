"""Options from one source (sim.config.option, sim.app.options.add_flags) and physical ranges
(sim.config.Range): every numeric flag of every command and every hardware field at 0, negative,
NaN, inf, 1e300 and 1e-300 is either in its declared range or refused with exit code 2, one line
naming the flag or field, the value and the range. The cases are generated from the parsers and
the dataclasses, so a new flag or field is covered without a new test."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from backends.hardware import HARDWARE, Hardware, resolve_hardware
from sim.app.cli import build_parser, main
from sim.app.cluster_options import ClusterOptions
from sim.app.options import ReplayOptions, add_flags, flag_fields, from_args, options_from_args
from sim.config import MAX_NUM_BLOCKS, SLO, CacheConfig, Range, SchedulerConfig, option, option_of, show_number
from sim.errors import ServesimError

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = str(ROOT / "traces" / "samples" / "azure_conv_2023_first5min.csv")
ABSURD_TEXT = ("0", "-1", "-5", "nan", "inf", "-inf", "1e300", "1e-300")
ABSURD = (0, -1, -5, math.nan, math.inf, -math.inf, 1e300, 1e-300, 10**300, True)
CONFIGS = (SchedulerConfig, CacheConfig, ReplayOptions, ClusterOptions)
# The flags of d2bbc18, every command's (tests/data: dumped from that tree's parser).
FLAGS_BEFORE = json.loads((ROOT / "tests" / "data" / "flags_d2bbc18.json").read_text())


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, action) of every optional flag of every command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, path + (name,))
        elif action.option_strings and action.dest != "help":
            yield path, action


ACTIONS = list(walk(build_parser()))
NUMERIC = [(path, action) for path, action in ACTIONS if hasattr(action.type, "bounds")]


def flag_id(case) -> str:
    path, action = case
    return f"{' '.join(path)} {action.option_strings[0]}"


# The flags: today's, generated.

# Defaults changed on purpose, with why: the old default is what the new one gives where nothing else
# is known, and the help says so.
CHANGED_DEFAULTS = {
    ("validate", ("--max-num-batched-tokens",)): (
        None, "the row's launch script's where servesim knows it, else 8192",
        "2026-12-06: a row whose launch script sets another budget (InferenceX's MiniMax-M2.5 on B300: "
        "2 x ISL) takes it; every other row keeps 8192"),
    **{(command, (flag,)): (None, said, "2026-12-06: unset, vLLM's API server's default for the GPU "
                                        "(EngineArgs.get_batch_defaults): 8192 and 1024 on H100, H200 and B200")
       for command in ("replay", "bench", "compare")
       for flag, said in (("--max-num-batched-tokens", "8192 on a GPU of 70 GiB or more that is not an A100"),
                          ("--max-num-seqs", "1024 on a GPU of 70 GiB or more that is not an A100"))},
    ("compare", ("--backend",)): (None, "runs both backends itself", "2026-12-07: unset, so that --backend costmodel, "
                                                                    "replay's default, is refused too"),
    ("bench", ("--ready-check-timeout-sec",)): (0, "default: 0, as vLLM's since vllm-project/vllm#30975",
                                                "2026-12-07: vllm bench serve skips its test request by default"),
    **{("trace synth", (flag,)): (None, said, "2026-12-07: unset (the same default, taken where the flag applies), "
                                              "so that the flag given where it changes nothing is refused")
       for flag, said in (("--prompt-len", "default: fixed:512"), ("--output-len", "default: fixed:128"),
                          ("--think-time", "default: 10"), ("--diurnal-period", "default: 86400"))},
}


def test_every_flag_of_before_is_there_with_its_name_dest_and_default():
    now = {(" ".join(path), tuple(sorted(a.option_strings))): a for path, a in ACTIONS}
    for old in FLAGS_BEFORE:
        key = (old["command"], tuple(old["flags"]))
        assert key in now, f"sim {old['command']} lost {old['flags']}"
        action = now[key]
        default = "inf" if isinstance(action.default, float) and math.isinf(action.default) else action.default
        if old["flags"] == ["--slo"] and old["command"] != "capacity":
            assert default is None and old["default"] is None  # parsed by SLO.parse after argparse
            continue
        if key in CHANGED_DEFAULTS:
            new_default, said, _why = CHANGED_DEFAULTS[key]
            assert action.dest == old["dest"] and default == new_default and said in " ".join(action.help.split())
            continue
        assert action.dest == old["dest"] and default == old["default"], (old, action.dest, default)
        assert action.help, f"sim {old['command']} {old['flags']} has no help"


def test_no_numeric_flag_without_a_range():
    """A flag parsed as a number must be declared with a Range (sim.config), so it is checked."""
    from traces.cli import number, whole_number

    plain = [flag_id((p, a)) for p, a in ACTIONS if a.type in (int, float, number, whole_number)]
    assert plain == []
    assert len(NUMERIC) > 40


def test_the_default_flags_build_the_default_options():
    """Defaults are written once, in the dataclasses: the flags' defaults build them back."""
    args = build_parser().parse_args(["replay", SAMPLE])
    # The budget and --max-num-seqs left unset: vLLM's for the GPU, resolved with the hardware.
    assert options_from_args(args) == ReplayOptions(batch_defaults=("max_num_batched_tokens", "max_num_seqs"))


@pytest.mark.parametrize("hardware, budget, seqs", [("H100-SXM", 8192, 1024), ("H200", 8192, 1024),
                                                    ("A100-80GB", 2048, 256)])
def test_an_unset_budget_and_max_num_seqs_are_vllms_api_servers_for_the_gpu(hardware, budget, seqs):
    """vLLM's EngineArgs.get_batch_defaults (OPENAI_API_SERVER): 8192 tokens and 1024 sequences on a GPU
    of 70 GiB or more that is not an A100, else 2048 and 256; a flag given is kept, the other resolved."""
    from sim.app.plan import resolve

    def plan(*flags):
        args = build_parser().parse_args(["replay", SAMPLE, "--hardware", hardware, *flags])
        return resolve(options_from_args(args), build_backend=False).options.scheduler

    scheduler = plan()
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (budget, seqs)
    scheduler = plan("--max-num-batched-tokens", "4096")
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (4096, seqs)
    scheduler = plan("--max-num-seqs", "64")
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (budget, 64)
    if seqs > 512:  # a budget under vLLM's default --max-num-seqs: refused as vLLM refuses it, saying what to give
        with pytest.raises(ServesimError, match=rf"--max-num-batched-tokens 512 is less than vLLM's default "
                                                rf"--max-num-seqs on {hardware} \({seqs}\).*give both flags"):
            plan("--max-num-batched-tokens", "512")
    # The real backend runs on --device, and keeps servesim's own defaults.
    args = build_parser().parse_args(["replay", SAMPLE, "--hardware", hardware, "--backend", "real", "--model", "tiny"])
    real = resolve(options_from_args(args), build_backend=False).options.scheduler
    assert (real.max_num_batched_tokens, real.max_num_seqs) == (2048, 256)


def test_options_are_built_by_keyword_from_the_flags():
    args = build_parser().parse_args(["replay", SAMPLE, "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                                      "--num-blocks", "99", "--no-prefix-caching", "--no-reserve-full-isl",
                                      "--slo", "ttft=2", "--replicas", "3", "--tp", "2", "--seed", "7"])
    options = options_from_args(args)
    assert options.scheduler == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, reserve_full_isl=False)
    assert options.cache == CacheConfig(num_blocks=99, enable_prefix_caching=False)
    assert options.cluster == ClusterOptions(num_replicas=3)
    assert (options.tp, options.seed, options.slo) == (2, 7, SLO(ttft=2.0))


def test_a_field_declared_once_is_a_flag_with_its_default_help_and_range():
    @dataclasses.dataclass(frozen=True)
    class Toy:
        budget: int = option(12, flag="--budget", range=Range(1, 100, "tokens", "a toy", whole=True), metavar="N",
                             help="a budget (default: {default})")
        name: str = option("x", flag="--toy-name", help="a name")

    p = argparse.ArgumentParser()
    add_flags(p, Toy)
    assert "(default: 12)" in p.format_help()
    assert from_args(Toy, p.parse_args([])) == Toy()
    assert from_args(Toy, p.parse_args(["--budget", "40", "--toy-name", "y"])) == Toy(40, "y")
    with pytest.raises(ServesimError, match="--budget must be a whole number from 1 to 100 tokens, got 101"):
        p.parse_args(["--budget", "101"])


# Every numeric flag at absurd values.

@pytest.mark.parametrize("case", NUMERIC, ids=flag_id)
def test_every_numeric_flag_refuses_values_outside_its_range(case):
    path, action = case
    bounds: Range = action.type.bounds
    flag = action.option_strings[0]
    for text in ABSURD_TEXT:
        try:
            value = int(text) if bounds.whole else float(text)
        except ValueError:  # "nan" as a whole number: argparse's own "invalid whole number value", exit 2
            with pytest.raises(ValueError):
                action.type(text)
            continue
        if bounds.contains(value):
            assert action.type(text) == value or math.isnan(value)
            continue
        with pytest.raises(ServesimError) as e:
            action.type(text)
        message = str(e.value)
        assert message.startswith(f"{flag} must be {bounds.describe()}, got {show_number(value)} ("), message
        assert "\n" not in message


@pytest.mark.parametrize("case", NUMERIC, ids=flag_id)
def test_an_out_of_range_flag_is_exit_2_with_one_line(case, capsys):
    path, action = case
    flag = action.option_strings[0]
    text = next(t for t in ("1e300", "-5", "0") if not action.type.bounds.contains(
        int(float(t)) if action.type.bounds.whole else float(t)))
    text = str(int(float(text))) if action.type.bounds.whole and text == "1e300" else text
    assert main([*path, flag, text]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sim: error: {flag} must be ") and err.count("\n") == 1, err


# The config dataclasses: every declared range checked when built, from Python too.

FIELDS = [(cls, f) for cls in CONFIGS for f, opt in flag_fields(cls) if opt.range is not None]


@pytest.mark.parametrize("cls,field", FIELDS, ids=lambda x: getattr(x, "__name__", None) or getattr(x, "name", ""))
def test_every_ranged_field_is_checked_when_built(cls, field):
    opt = option_of(field)
    for value in ABSURD:
        if opt.range.contains(value):
            try:
                cls(**{field.name: value})
            except ServesimError as e:  # another rule may refuse it (e.g. budget >= max-num-seqs), not the range
                assert f"{opt.flag} must be a" not in str(e)
            continue
        with pytest.raises(ServesimError, match=f"^{opt.flag} must be a"):
            cls(**{field.name: value})


# Hardware files.

HARDWARE_FIELDS = ("peak_bf16_flops", "peak_fp8_flops", "memory_bandwidth", "memory_bytes", "nvlink_bandwidth")
H100 = HARDWARE["H100-SXM"]


@pytest.mark.parametrize("field", HARDWARE_FIELDS)
@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, 1e300, 1e-300, "fast"])
def test_hardware_fields_out_of_range_are_refused_naming_the_file_field_value_and_range(tmp_path, field, value):
    spec = {**{k: v for k, v in H100.as_dict().items() if k != "name"}, field: value}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ServesimError) as e:
        resolve_hardware(str(path))
    message = str(e.value)
    shown = repr(value) if isinstance(value, str) else show_number(value)
    assert message.startswith(f"{path}: hardware gpu: {field} must be a ") and f"got {shown} (" in message, message


def test_the_presets_are_in_range():
    for hardware in HARDWARE.values():
        dataclasses.replace(hardware)  # checked again when built


def test_hardware_memory_1e300_is_exit_2_not_a_294_digit_cache(tmp_path, capsys):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**{k: v for k, v in H100.as_dict().items() if k != "name"}, "memory_bytes": 1e300}))
    assert main(["replay", SAMPLE, "--limit", "3", "--hardware", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "memory_bytes must be a whole number from 134,217,728 to 17,592,186,044,416 bytes, got 1e+300" in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_hardware_flops_1e_300_is_refused():
    with pytest.raises(ServesimError, match="peak_bf16_flops must be a number from 1e.09 to 1e.18 FLOP/s, got 1e-300"):
        Hardware("slow", 1e-300, None, 3e12, 80 * 2**30, None)


# No silent cap.

@pytest.mark.slow
def test_a_capped_kv_cache_is_reported_as_capped(tmp_path, capsys):
    # Qwen-sized "tiny" on an H200 with 1-token blocks derives ~5e8 blocks: capped to 2**25, and said so.
    out = tmp_path / "o"
    assert main(["replay", SAMPLE, "--limit", "3", "--model", "tiny", "--hardware", "H200", "--block-size", "1",
                 "--out", str(out)]) == 0
    err = capsys.readouterr()
    assert "sim: warning: the KV cache derived for this GPU holds 524,582,763 blocks; servesim simulates at most " \
           "33,554,432" in err.err
    kv = json.loads((out / "summary.json").read_text())["kv_cache"]
    assert kv["num_gpu_blocks"] == MAX_NUM_BLOCKS
    assert kv["capped"] == {"derived_num_gpu_blocks": 524582763, "cap": MAX_NUM_BLOCKS,
                            "why": "each KV block takes about 60 bytes of host memory"}
    assert f"{MAX_NUM_BLOCKS} KV blocks (capped from 524582763)" in err.out


def test_an_uncapped_kv_cache_says_nothing_of_a_cap(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["replay", SAMPLE, "--limit", "3", "--out", str(out), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert "capped" not in json.loads((out / "summary.json").read_text())["kv_cache"]


# Clusters and links.

def test_every_pool_option_is_a_declared_field():
    from sim.app.cluster_options import POOL_OPTIONS, pool_fields

    assert sorted(pool_fields()) == sorted(POOL_OPTIONS)


@pytest.mark.parametrize("args,fragment", [
    (["--replicas", "100000"], "--replicas must be a whole number from 1 to 1,024 replicas, got 100,000"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-bandwidth", "1e-300"],
     "--kv-transfer-bandwidth must be a number from 0.001 to 100000 GB/s, got 1e-300"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-latency", "1e12"],
     "--kv-transfer-latency must be a number from 0 to 10 s, got 1e+12"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-latency", "inf"],
     "--kv-transfer-latency must be a number from 0 to 10 s, got inf"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-options", "max-num-seqs=0"],
     "--decode-options: max-num-seqs must be a whole number from 1 to 1,048,576 requests, got 0"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-options", "gpu-memory-utilization=nan"],
     "--prefill-options: gpu-memory-utilization must be a number above 0 and at most 1, got nan"),
    (["--replicas", "8", "--num-gpu-blocks", str(MAX_NUM_BLOCKS)], "servesim simulates at most 134,217,728"),
    (["--slo", "tbt=1e-300"], "--slo tbt must be a number from 1e-06 to 1e+09 s, got 1e-300"),
    (["--slo", "ttft=inf"], "--slo ttft must be a number from 1e-06 to 1e+09 s, got inf"),
])
def test_absurd_cluster_values_are_exit_2(tmp_path, capsys, args, fragment):
    assert main(["replay", SAMPLE, "--limit", "3", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args,fragment", [
    (["bench", "--concurrency", "4", "--input-len", "16", "--output-len", "4", "--num-prompts", "8",
      "--request-rate", "1e-300"], "--request-rate must be a number from 1e-06 to 1e+09 requests/s, or inf, got 1e-300"),
    (["validate", "x.csv", "--ops", "x", "--out", "o", "--max-num-batched-tokens", "0"],
     "--max-num-batched-tokens must be a whole number from 1 to 16,777,216 tokens, got 0"),
    (["validate", "x.csv", "--ops", "x", "--out", "o", "--max-num-batched-tokens", "-5"],
     "--max-num-batched-tokens must be a whole number from 1 to 16,777,216 tokens, got -5"),
    (["capacity", SAMPLE, "--slo", "tbt=0.1", "--max-rate-scale", "1e300"],
     "--max-rate-scale must be a number from 1e-06 to 1e+06, got 1e+300"),
    (["trace", "synth", "t.csv", "--rate", "nan"], "--rate must be a number from 1e-06 to 1e+09 requests/s, got nan"),
])
def test_absurd_values_of_other_commands_are_exit_2(tmp_path, capsys, args, fragment):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args,fragment", [
    (["--rate-scale", "1,1e300"], "--rate-scale must be a number from 1e-06 to 1e+06, got 1e+300"),
    (["--max-num-seqs", "1,99999999"], "--max-num-seqs must be a whole number from 1 to 1,048,576 requests, got "
                                       "99,999,999"),
    (["--max-num-batched-tokens", "0,2048"], "--max-num-batched-tokens must be a whole number from 1 to 16,777,216"),
])
def test_sweep_axes_are_checked_against_the_flags_ranges(tmp_path, capsys, args, fragment):
    assert main(["sweep", SAMPLE, "--limit", "3", "--out", str(tmp_path / "s"), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "s" / "results.csv").exists()


def test_bench_request_rate_inf_is_all_at_once():
    args = build_parser().parse_args(["bench", "--concurrency", "1", "--input-len", "1", "--output-len", "1",
                                      "--num-prompts", "1", "--request-rate", "inf"])
    assert args.request_rate == math.inf


def test_every_range_is_in_the_docs():
    import sim.config

    text = (ROOT / "docs" / "options.md").read_text()
    for name, value in vars(sim.config).items():
        if isinstance(value, Range):
            assert f"| `{name}` | {value.describe()} |" in text, name


@pytest.mark.parametrize("version", ["abc", "", "1", "0.12", "0.12.0", "0.10.1.1", "0.12.0rc1", "0.11.0.post1",
                                     "v0.12.0", "0.12.0 ", "latest"])
def test_vllm_version_is_a_release_number(version):
    """--vllm-version names a vLLM release; a word or a bare number is refused naming the value
    (before, 'abc' was read as 0.0.0 and "the nearest" tables were taken)."""
    accepted = version in ("0.12", "0.12.0", "0.10.1.1", "0.12.0rc1", "0.11.0.post1")
    if accepted:
        assert ReplayOptions(vllm_version=version).vllm_version == version
    else:
        with pytest.raises(ServesimError, match=f"--vllm-version takes a vLLM release .*got {version!r}"):
            ReplayOptions(vllm_version=version)


@pytest.mark.parametrize("argv, asynchronous", [([], True), (["--vllm-version", "0.14.0"], True),
                                                (["--vllm-version", "0.12.0"], False),
                                                (["--vllm-version", "0.12.0", "--async-scheduling"], True),
                                                (["--no-async-scheduling"], False)])
def test_async_scheduling_follows_the_vllm_version_unless_given(argv, asynchronous):
    """vLLM schedules asynchronously by default from 0.14: a run priced as an older server schedules
    synchronously unless the flag says otherwise."""
    from sim.app.cli import options_from_args

    args = build_parser().parse_args(["replay", "trace.csv", *argv])
    assert options_from_args(args).scheduler.async_scheduling is asynchronous


def test_a_whole_number_out_of_range_is_shown_as_given_not_rounded():
    from sim.config import SEED

    with pytest.raises(ServesimError, match="got 99,999,999,999,999,999,999,999 "):
        SEED.check("--seed", 99999999999999999999999)  # (shown as 1e+23 before: another number)


def test_a_hardware_file_with_a_byte_order_mark_is_read(tmp_path):
    """As trace and measured CSVs are: some editors write a UTF-8 byte-order mark."""
    path = tmp_path / "h100-bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({k: v for k, v in H100.as_dict().items() if k != "name"}).encode())
    assert resolve_hardware(str(path)).memory_bytes == H100.memory_bytes
