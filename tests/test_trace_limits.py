"""Issue 13's trace cases: absurd token counts and arrivals, time zones, 0-token rows, extra
hash ids, a field too many, `sim trace synth|convert` on bad options and over their input.
Each runs the reproduction and asserts the exact outcome (nothing lost, exit 2, one line)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from sim.app.cli import main
from sim.errors import ServesimError
from traces import AZURE_CONV_SAMPLE, read_trace
from traces.synth import SynthConfig

HEADERS = {
    "canonical": "arrival_s,prompt_tokens,output_tokens",
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
    "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens",
}
PROMPT = {"canonical": "prompt_tokens", "azure": "ContextTokens", "burstgpt": "Request tokens",
          "vidur": "num_prefill_tokens", "mooncake": "input_length"}


def row(fmt: str, arrival_s: float, prompt, output) -> str:
    if fmt == "azure":
        return f"2023-11-16 18:15:{arrival_s:09.6f},{prompt},{output}"
    if fmt == "burstgpt":  # Total tokens the sum, as BurstGPT's files have it (else a warning says so)
        total = prompt + output if isinstance(prompt, int) and isinstance(output, int) else 0
        return f"{arrival_s},ChatGPT,{prompt},{output},{total},API log"
    if fmt == "mooncake":
        return json.dumps({"timestamp": arrival_s * 1000, "input_length": prompt, "output_length": output})
    return f"{arrival_s},{prompt},{output}"


def write(tmp_path, fmt: str, rows: list[str]):
    path = tmp_path / ("t.jsonl" if fmt == "mooncake" else "t.csv")
    path.write_text("\n".join(([] if fmt == "mooncake" else [HEADERS[fmt]]) + rows) + "\n")
    return path


def run(*args):
    return main([str(a) for a in args])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and err.count("\n") == 1, err
    return err


# Token counts beyond any model: refused where read, naming file:line (never an int64 overflow).

@pytest.mark.parametrize("fmt", list(PROMPT))
@pytest.mark.parametrize("value,shown", [("1e30", "1e+30"), (2**31 + 1, "2147483649")])
def test_token_counts_above_2_31_are_refused_naming_the_line(tmp_path, fmt, value, shown):
    if fmt == "mooncake":
        value = 1e30 if value == "1e30" else value
        shown = "1e+30" if value == 1e30 else shown
    path = write(tmp_path, fmt, [row(fmt, 1, 10, 2), row(fmt, 2, value, 2)])
    with pytest.raises(ServesimError) as e:
        read_trace(path)
    line = 2 if fmt == "mooncake" else 3
    assert str(e.value) == (f"{path}:{line}: {PROMPT[fmt]} is {shown}, more tokens than any model takes "
                            f"(at most 2**31 = 2,147,483,648)")


def test_2_31_tokens_are_read_exactly(tmp_path):
    path = write(tmp_path, "canonical", [row("canonical", 0, 2**31, 2**31)])
    t = read_trace(path)
    assert t.prompt_tokens.tolist() == [2**31] and t.output_tokens.tolist() == [2**31]


def test_stats_and_convert_of_1e30_tokens_exit_2_and_write_nothing(tmp_path, capsys):
    path = write(tmp_path, "canonical", [row("canonical", 0, "1e30", 2), row("canonical", 1, 10, 2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from a cast either
        assert run("trace", "stats", path) == 2
        assert f"{path}:2: prompt_tokens is 1e+30" in one_error_line(capsys)
        assert run("trace", "convert", path, tmp_path / "out.csv") == 2
    assert f"{path}:2: prompt_tokens is 1e+30" in one_error_line(capsys)
    assert not (tmp_path / "out.csv").exists()


# Arrivals absurdly far: refused beyond 1e9 s, warned beyond a year, the value named.

def test_arrival_at_1e300_s_is_refused(tmp_path):
    path = write(tmp_path, "canonical", [row("canonical", 0, 10, 2), row("canonical", 1e300, 10, 2)])
    with pytest.raises(ServesimError) as e:
        read_trace(path)
    assert str(e.value) == (f"{path}:3: arrival_s 1e+300 is 1e+300 s (3.17e+292 years) after the first arrival "
                            "(arrival_s 0, line 2); a trace cannot span more than 1e+09 s: check the value")


def test_azure_date_in_2099_is_refused_and_one_in_2030_warned(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADERS['azure']}\n2023-11-16 18:15:46.68,10,2\n2099-11-16 18:15:50.68,10,2\n")
    with pytest.raises(ServesimError, match=r":3: TIMESTAMP 2099-11-16 18:15:50.680000 is 2.398e\+09 s \(76 years\) "
                                            r"after the first arrival \(TIMESTAMP 2023-11-16 18:15:46.680000, line 2\)"):
        read_trace(path)
    path.write_text(f"{HEADERS['azure']}\n2023-11-16 18:15:46.68,10,2\n2030-11-16 18:15:46.68,10,2\n")
    t = read_trace(path)
    assert t.arrival_s.tolist() == [0.0, 2557 * 86400.0]  # 2024 and 2028 are leap years
    assert t.warnings == [(f"{path}:3: TIMESTAMP 2030-11-16 18:15:46.680000 is 2.209e+08 s (7 years) after the "
                          "first arrival (TIMESTAMP 2023-11-16 18:15:46.680000, line 2); more than a year: check "
                          "the value")]


# Time zones: never shifted silently.

def test_azure_stamps_with_and_without_a_zone_are_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADERS['azure']}\n2023-11-16 18:15:46.68,10,2\n2023-11-16 18:15:50.68+02:00,10,2\n"
                    "2023-11-16 18:16:00.68,10,2\n")
    with pytest.raises(ServesimError) as e:
        read_trace(path, chunk_rows=1)  # the first row's chunk decides, the second's is held to it
    assert str(e.value) == (f"{path}:3: TIMESTAMP '2023-11-16 18:15:50.68+02:00' has a time zone, but line 2's "
                            "'2023-11-16 18:15:46.68' has none; a stamp without a zone could be in any zone: give "
                            "every stamp a zone (e.g. +00:00), or none")


def test_azure_offsets_that_differ_are_converted_to_utc_with_a_warning(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADERS['azure']}\n2023-11-16 18:15:46.5+00:00,10,2\n2023-11-16 20:15:50.5+02:00,10,2\n"
                    "2023-11-16 18:16:00.5Z,10,2\n2023-11-16 13:16:00.5-0500,10,2\n")
    for chunk_rows in (1, 2, 10):
        t = read_trace(path, chunk_rows=chunk_rows)
        assert t.arrival_s.tolist() == [0.0, 4.0, 14.0, 14.0]  # 18:15:46.5, 18:15:50.5, 18:16:00.5 twice UTC
        assert t.warnings == [(f"{path}:3: TIMESTAMP '2023-11-16 20:15:50.5+02:00' has UTC offset +02:00, line 2 "
                              "('2023-11-16 18:15:46.5+00:00') has +00:00; converted every stamp to UTC")]


def test_azure_one_offset_throughout_gives_no_warning(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(f"{HEADERS['azure']}\n2023-11-16 20:15:46+02:00,10,2\n2023-11-16 20:15:50+02:00,10,2\n")
    t = read_trace(path, chunk_rows=1)
    assert t.arrival_s.tolist() == [0.0, 4.0] and t.warnings == []


# A 0-token prompt: dropped with a warning and counted, in every format.

@pytest.mark.parametrize("fmt", list(PROMPT))
def test_a_0_token_prompt_is_dropped_and_counted_in_every_format(tmp_path, fmt):
    path = write(tmp_path, fmt, [row(fmt, 1, 10, 2), row(fmt, 2, 0, 3), row(fmt, 3, 30, 4)])
    t = read_trace(path)
    line = 2 if fmt == "mooncake" else 3
    assert t.prompt_tokens.tolist() == [10, 30] and t.output_tokens.tolist() == [2, 4]
    assert t.arrival_s.tolist() == [0.0, 2.0]
    assert t.dropped == {f"0 {PROMPT[fmt]}": 1}
    assert t.warnings == [f"{path}:{line}: dropped 1 request with 0 {PROMPT[fmt]}"]


def test_canonical_drops_keep_request_ids_and_hash_ids_aligned(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,request_id,hash_ids,hash_block_tokens\n"
                    "0,20,1,a,1 2,16\n1,0,1,b,,16\n2,5,0,c,7,16\n3,16,2,d,9,16\n")
    t = read_trace(path, chunk_rows=2)
    assert t.request_ids == ["a", "d"] and [h.tolist() for h in t.hash_ids] == [[1, 2], [9]]
    assert t.dropped == {"0 prompt_tokens": 1, "0 output_tokens": 1}


# Hash ids: as many as the prompt needs, no more.

def test_mooncake_row_with_more_hash_ids_than_its_length_needs_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [0, 1, 2]}\n')
    with pytest.raises(ServesimError) as e:
        read_trace(path)
    assert str(e.value) == f"{path}:2: 3 hash_ids are more than input_length 5: it needs 1, one per 512 tokens"


def test_canonical_row_with_more_hash_ids_than_needed_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens\n0,16,1,1 2,16\n")
    with pytest.raises(ServesimError, match=r":2: 2 hash_ids are more than prompt_tokens 16: it needs 1"):
        read_trace(path)


def test_mooncake_hash_id_beyond_int64_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [{2**63 + 5}]}}\n')
    with pytest.raises(ServesimError, match=r":1: hash_ids must be below 2\*\*63, got 9223372036854775813"):
        read_trace(path)


# pandas' ParserWarning: a field too many in the first row is an error naming it, never a warning.

@pytest.mark.parametrize("rows,line", [(["0,10,2,5", "1,10,2"], 2), (["", "0,10,2,5"], 3), (["0,10,2", "1,10,2,5"], 3)])
def test_a_field_too_many_is_named_not_warned(tmp_path, capfd, rows, line):
    path = write(tmp_path, "canonical", rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ServesimError) as e:
            read_trace(path)
    assert str(e.value) == f"{path}:{line}: expected 3 fields as in the header, saw 4"
    assert run("trace", "stats", path) == 2
    err = capfd.readouterr().err
    assert err == f"sim: error: {path}:{line}: expected 3 fields as in the header, saw 4\n"


# sim trace synth and convert.

def test_synth_hash_block_tokens_0_exits_2(tmp_path, capsys):
    assert run("trace", "synth", tmp_path / "s.csv", "--hash-block-tokens", 0) == 2
    assert one_error_line(capsys).startswith("sim: error: --hash-block-tokens must be a whole number from 1 to 65,536 "
                                             "tokens, got 0 (")
    assert not (tmp_path / "s.csv").exists()


@pytest.mark.parametrize("kwargs,message", [
    ({"rate": 1e-300}, "the trace would span 1.02e+303 s, more than 1e+09 s"),
    ({"prompt": "fixed:1e30"}, "--prompt-len: 'fixed:1e30': more tokens than any model takes"),
    ({"num_requests": 10**11}, "--num-requests must be at most 100,000,000"),
    ({"turns": "fixed:1000", "prompt": "fixed:2000000000", "num_requests": 10},
     "session 0's turn 2 has 4,000,000,128 prompt tokens"),
])
def test_synth_values_that_would_overflow_are_refused(kwargs, message):
    from traces.synth import Lengths, synthesize

    with pytest.raises(ServesimError) as e:
        config = {k: Lengths.parse(v, "--prompt-len") if k in ("prompt", "turns") else v for k, v in kwargs.items()}
        synthesize(SynthConfig(**config))
    assert message in str(e.value)


@pytest.mark.parametrize("how", ["same", "dot", "symlink", "hardlink"])
def test_convert_refuses_to_write_over_its_input(tmp_path, capsys, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    original = AZURE_CONV_SAMPLE.read_bytes()
    (tmp_path / "t.csv").write_bytes(original)
    out = {"same": "t.csv", "dot": f"../{tmp_path.name}/./t.csv", "symlink": "link.csv", "hardlink": "hard.csv"}[how]
    if how == "symlink":
        os.symlink("t.csv", "link.csv")
    if how == "hardlink":
        os.link("t.csv", "hard.csv")
    assert run("trace", "convert", "t.csv", out, "--limit", 10) == 2
    assert one_error_line(capsys) == f"sim: error: {Path(out)}: is the input t.csv; writing it would destroy it: name " \
                                     "another output\n"
    assert (tmp_path / "t.csv").read_bytes() == original


def test_convert_checks_its_destination_before_reading(tmp_path, capsys):
    missing = tmp_path / "no-such-trace.csv"  # the destination is named first, so the trace is never read
    assert run("trace", "convert", missing, tmp_path / "nodir" / "x.csv") == 2
    assert one_error_line(capsys) == f"sim: error: {tmp_path / 'nodir'}: no such folder (for {tmp_path / 'nodir' / 'x.csv'})\n"
    (tmp_path / "f").write_text("")
    assert run("trace", "convert", missing, tmp_path / "f" / "x.csv") == 2
    assert one_error_line(capsys) == f"sim: error: {tmp_path / 'f'}: is a file, so {tmp_path / 'f' / 'x.csv'} cannot be written\n"


def test_convert_writes_gzip_through_a_temporary_file(tmp_path, capsys):
    out = tmp_path / "w.csv.gz"
    assert run("trace", "convert", AZURE_CONV_SAMPLE, out, "--limit", 3) == 0
    assert read_trace(out).prompt_tokens.tolist() == [374, 396, 879]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.csv.gz"]  # no temporary file left
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_rate_scale_that_would_overflow_the_span_is_refused(capsys):
    assert run("trace", "stats", AZURE_CONV_SAMPLE, "--rate-scale", "1e-300") == 2
    assert one_error_line(capsys).startswith("sim: error: --rate-scale must be a number from 1e-06 to 1e+06, got "
                                             "1e-300 (")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_stats_mean_has_no_overflow_at_the_limit(tmp_path):
    from traces.stats import trace_stats

    path = write(tmp_path, "canonical", [row("canonical", i, 2**31, 1) for i in range(4)])
    stats = trace_stats(read_trace(path))
    assert stats["prompt_tokens"]["mean"] == 2.0**31 and stats["prompt_tokens"]["max"] == 2**31
    assert np.int64(2**31) * 4 == 2**33
