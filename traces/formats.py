"""The trace formats servesim reads: their names, their columns, how a file's first line tells
which one it is, and the limits every reader holds a row to.

| format    | first line                                                        | arrival          |
|-----------|-------------------------------------------------------------------|------------------|
| canonical | arrival_s,prompt_tokens,output_tokens[,request_id][,hash_ids,hash_block_tokens][,priority] | seconds |
| azure     | TIMESTAMP,ContextTokens,GeneratedTokens (Azure 2023 and 2024)     | date and time    |
| burstgpt  | Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type | seconds       |
| vidur     | arrived_at,num_prefill_tokens,num_decode_tokens (Vidur/Splitwise) | seconds          |
| mooncake  | JSON Lines: timestamp, input_length, output_length, hash_ids      | milliseconds     |
| vllm-bench | a JSON object: `vllm bench serve --save-detailed`'s result: start_times, input_lens, output_lens | seconds |
| aiperf    | JSON Lines: AIPerf's profile_export.jsonl, a record per request: metadata, metrics, error | nanoseconds |
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from sim.errors import ServesimError
from sim.jsonable import DuplicateKeyError, loads_unique

CHUNK_ROWS = 250_000
MOONCAKE_BLOCK_TOKENS = 512

CANONICAL = ("arrival_s", "prompt_tokens", "output_tokens")
# Every column a canonical trace's reader reads (traces/canonical.py): the three above and the optional ones
CANONICAL_READ = (*CANONICAL, "request_id", "priority", "hash_ids", "hash_block_tokens")
AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT = ("Timestamp", "Model", "Request tokens", "Response tokens")
VIDUR = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
MOONCAKE = ("timestamp", "input_length", "output_length")
VLLM_BENCH = ("start_times", "input_lens", "output_lens")
AIPERF = ("metadata", "metrics")  # an AIPerf record's fields (traces/aiperf.py)
# Keys of vllm/benchmarks/serve.py's result, with or without --save-detailed (no Mooncake line has them)
VLLM_BENCH_KEYS = (*VLLM_BENCH, "num_prompts", "request_throughput", "mean_ttft_ms", "max_concurrency")
CSV_COLUMNS = {"canonical": CANONICAL, "azure": AZURE, "burstgpt": BURSTGPT, "vidur": VIDUR}
FORMATS = ("canonical", "azure", "mooncake", "burstgpt", "vidur", "vllm-bench", "aiperf")
ALIASES = {"azure2023": "azure", "azure2024": "azure", "splitwise": "vidur", "jsonl": "mooncake",
           "vllm": "vllm-bench"}
# Columns kept as text (the others are left to pandas' fast numeric parsing).
TEXT_COLUMNS = ("request_id", "hash_ids", "TIMESTAMP", "Model", "Log Type")

# More tokens than any model's context holds (the longest are around 2**20): a larger count is a
# typo or an overflow upstream, and past 2**63 it would wrap around in int64 arithmetic.
MAX_TOKENS = 2**31
# A trace spanning more than this (about 31.7 years) holds a wrong arrival, not a workload.
MAX_SPAN_S = 1e9
# A span beyond a year is possible but worth a look: the line of the last arrival is named.
LONG_SPAN_S = 366 * 86400.0


def format_name(fmt: str) -> str:
    """A format named by the user, aliases resolved (azure2024 -> azure)."""
    name = ALIASES.get(fmt.lower(), fmt.lower())
    if name not in FORMATS:
        raise ServesimError(f"unknown trace format {name!r}; choose one of {', '.join(FORMATS)}")
    return name


def detect_format(path: Path, first: str) -> str:
    """The format of a file from its first non-blank line (a CSV header or a JSON object): one JSON
    document with vLLM's bench serve result fields (or an object opened on a line of its own, as a
    pretty-printed document is; a Mooncake line is never only "{") is vllm-bench; a JSON line with
    AIPerf's record fields is aiperf."""
    text = first.strip()
    if text.startswith("{") and all(f'"{key}"' in text for key in AIPERF) and _aiperf_record(text):
        return "aiperf"
    if text == "{" or (text.startswith("{") and any(f'"{key}"' in text for key in VLLM_BENCH_KEYS)
                       and _vllm_bench_result(text)):
        return "vllm-bench"  # (a result saved without --save-detailed too: its reader says what it lacks)
    if text.startswith("{") or suffix(path) in (".jsonl", ".json"):
        return "mooncake"
    names = set(header(first))
    overlap = {fmt: len(set(columns) & names) for fmt, columns in CSV_COLUMNS.items()}
    best = max(overlap, key=overlap.get)
    if overlap[best]:
        return best  # a missing column is named when the header is checked
    expected = "; ".join(f"{fmt}: {','.join(cols)}" for fmt, cols in CSV_COLUMNS.items())
    raise ServesimError(f"{path}:1: unknown trace format with columns {text[:200]!r}; expected {expected}, "
                        f"or JSON Lines with {','.join(MOONCAKE)} (or name one with --format)")


def _vllm_bench_result(text: str) -> bool:
    """Whether a one-line JSON object that names a vLLM bench result's fields is one: its own keys
    hold one of them and not all of a Mooncake line's. A result may carry a "timestamp" key of its own
    (`vllm bench serve --metadata timestamp=...`: found by a review with odd traces, it was read as
    Mooncake and refused for lacking input_length); a line that is not JSON is a result unless it
    names "timestamp" (its reader, or Mooncake's, says what is wrong with it). Only a line that names
    "timestamp" is parsed here: a result is one line of megabytes, which its reader parses anyway."""
    if '"timestamp"' not in text:
        return True
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return '"timestamp"' not in text
    return (isinstance(record, dict) and any(key in record for key in VLLM_BENCH_KEYS)
            and not all(key in record for key in MOONCAKE))


def _aiperf_record(text: str) -> bool:
    """Whether a line that names AIPerf's record fields is a record: a JSON object with them as its
    own keys and none of a vLLM bench result's or a Mooncake line's. A vLLM bench result may hold the
    words in its texts (generated_texts) or as keys of its own (`--metadata metrics=...`); a line
    that is not JSON is left to the AIPerf reader, which names what is wrong with it."""
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return '"timestamp"' not in text
    return (isinstance(record, dict) and all(key in record for key in AIPERF)
            and not any(key in record for key in (*VLLM_BENCH_KEYS, *MOONCAKE)))


def json_error(e: json.JSONDecodeError) -> str:
    """What is wrong with a JSON text and where on its line: "Expecting value at column 1",
    "Unterminated string starting at column 666" (Python's message may end in "at" itself)."""
    where = "column" if e.msg.endswith(" at") else "at column"
    return f"{e.msg} {where} {e.colno}"


def json_line(where: str, text: str):
    """One line of a JSON Lines trace (Mooncake, AIPerf) as its value; a key named twice, malformed JSON or
    JSON nested too deeply is refused naming `where` (file:line) and what is wrong."""
    try:
        return loads_unique(text)
    except DuplicateKeyError as e:
        raise ServesimError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise ServesimError(f"{where}: not valid JSON ({json_error(e)})") from None
    except RecursionError:
        raise ServesimError(f"{where}: JSON nested too deeply to read") from None


def suffix(path: Path) -> str:
    """The extension that tells the format: 't.jsonl.gz' -> '.jsonl'."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1].lower() if suffixes else ""


# Python's csv module refuses a field over 131,072 characters; canonical CSV's hash_ids field of a
# long prompt is longer. This is the most it takes on every platform (a C long).
csv.field_size_limit(2**31 - 1)


def csv_fields(line: str) -> list[str]:
    """The fields of one CSV row. A CR inside the line ends the row, as it does for pandas."""
    return next(csv.reader(io.StringIO(line, newline="")), [])


def header(line: str) -> list[str]:
    """The column names of a CSV header line."""
    return [name.strip() for name in csv_fields(line)]


MAX_JSON_INT = 10**300  # a whole number beyond this is no token count or time (and overflows a float near 1.8e308)


def json_number(where: str, name: str, value) -> float:
    """A JSON field that must be a finite, non-negative number (the JSON formats' readers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServesimError(f"{where}: {name} must be a number, got {json.dumps(value)[:40]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ServesimError(f"{where}: {name} must be finite, got {value}")
    if isinstance(value, int) and abs(value) > MAX_JSON_INT:  # past a float (and any count or time)
        raise ServesimError(f"{where}: {name} is a {len(str(abs(value)))}-digit number, too large to be one")
    if value < 0:
        raise ServesimError(f"{where}: {name} must not be negative, got {value}")
    return value


# A measured latency (a TTFT, an E2E) under half a nanosecond is a clock's 0 (clients count whole
# nanoseconds), and one over MAX_SPAN_S no request's: either would turn the comparison with the
# replay (reports/measured.py) into infinities.
MIN_LATENCY_S = 0.5e-9


def latency_s(where: str, name: str, seconds: float, shown: str) -> float:
    """A measured latency in seconds (`shown`: as the file wrote it, for messages), refused out of range."""
    if seconds < MIN_LATENCY_S:
        raise ServesimError(f"{where}: {name} {shown} is under half a nanosecond: no client's clock measures that")
    if seconds > MAX_SPAN_S:
        raise ServesimError(f"{where}: {name} {shown} is more than {MAX_SPAN_S:g} s, longer than any trace spans: "
                            "check the value and its unit")
    return seconds


def json_count(where: str, name: str, value) -> int:
    """A JSON field that must be a token count: a whole number up to MAX_TOKENS."""
    value = json_number(where, name, value)
    if value != int(value):
        raise ServesimError(f"{where}: {name} must be a whole number, got {value}")
    if value > MAX_TOKENS:
        raise ServesimError(f"{where}: {name} is {value}, more tokens than any model takes "
                            f"(at most 2**31 = {MAX_TOKENS:,})")
    return int(value)
