"""Every servesim JSON file (profiles, hardware files, model configs, host-time profiles) is read
by one function, with the same one-line errors naming the file and what it should be."""

from __future__ import annotations

import pytest

from backends.costmodel.optables.profile import load_op_profile
from backends.hardware import Hardware
from backends.host_time import HostTime
from backends.model_config import ModelConfig
from backends.profile import load_profile
from sim.errors import ServesimError
from sim.jsonable import read_json_file


@pytest.mark.parametrize("content,message", [
    (None, "no such profile (make one)"),
    ("", "cannot read it as JSON: not a profile (invalid JSON at line 1"),
    ("{", "cannot read it as JSON: not a profile (invalid JSON at line 1"),
    ("[1, 2]", "not a profile: a profile is one JSON object"),
    ('"text"', "not a profile: a profile is one JSON object"),
    (b"\xff\xfe", "cannot read the profile"),
    # Python's json keeps the last of two values of one key: a hand-written file saying a key twice is refused.
    ('{"a": 1, "b": {"c": 2, "c": 3}}', "the key 'c' is given twice in one object (a JSON reader keeps only the last "
                                        "value; give it once)"),
])
def test_read_json_file_names_the_file_and_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "p.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ServesimError) as e:
        read_json_file(path, "profile", "make one")
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_a_folder_is_refused_too(tmp_path):
    with pytest.raises(ServesimError, match="cannot read the profile"):
        read_json_file(tmp_path, "profile")


@pytest.mark.parametrize("load,what", [
    (load_profile, "profile"), (load_op_profile, "profile"), (Hardware.from_json, "hardware file"),
    (HostTime.load, "host time profile"), (ModelConfig.from_hf, "model config"),
])
def test_every_reader_gives_the_same_errors(tmp_path, load, what):
    path = tmp_path / "x.json"
    path.write_text("[]")
    with pytest.raises(ServesimError, match=f"not a {what}: a {what} is one JSON object"):
        load(path)


def test_a_profile_given_to_replay_names_no_key_twice(tmp_path, capsys):
    """`--profile FILE.json` is read by sim.app.plan (read_profile_json) before it knows the kind of profile:
    an operator-table profile naming a key twice was taken, the last value kept, where every other reader
    of servesim's JSON files refuses it."""
    import json
    from pathlib import Path

    from sim.app.cli import main

    committed = Path(__file__).parent.parent / "profiles" / "ops" / "H100-SXM__Llama-3.1-8B__tp1__bf16__kv-bf16.json"
    text = committed.read_text()
    assert json.loads(text)["kind"] == "operator-tables"
    profile = tmp_path / "dup.json"
    profile.write_text(text.replace('"kind": "operator-tables"', '"kind": "operator-tables", "kind": "operator-tables"', 1))
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n")
    assert main(["replay", str(trace), "--profile", str(profile), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert "the key 'kind' is given twice" in capsys.readouterr().err


def test_a_file_nested_too_deeply_is_one_line(tmp_path):
    # json's parser recurses per level: a config.json of 200,000 `[` was an internal error (RecursionError).
    path = tmp_path / "config.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ServesimError, match="nested too deeply"):
        read_json_file(path, "model config")
    with pytest.raises(ServesimError, match="config.json: cannot read it as JSON"):
        ModelConfig.from_hf(path)
