"""Plain JSON values from numpy, pandas and path values (NaN becomes null)."""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from sim.errors import ServesimError


def jsonable(value):
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if np.isnan(value) else float(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "isoformat"):  # datetimes, pandas timestamps
        return value.isoformat()
    return value


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice. Python's json (and most readers) keep the last value
    silently; a file a user wrote by hand that does so most likely meant something else."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} is given twice in one object (a JSON reader keeps only the last value; "
                         "give it once)")
        self.key = key


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return data


def loads_unique(text: str):
    """json.loads, refusing an object that names a key twice (DuplicateKeyError). A whole number
    longer than Python reads (sys.get_int_max_str_digits(), 4,300 digits) is malformed JSON like any
    other (json.JSONDecodeError, at the number), not a ValueError that no reader's message names."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except ValueError as e:
        if isinstance(e, (json.JSONDecodeError, DuplicateKeyError)) or "integer string conversion" not in str(e):
            raise
        digits = sys.get_int_max_str_digits()
        number = re.search(rf"(?<![\d.])\d{{{digits + 1},}}(?![\d.eE])", text)
        raise json.JSONDecodeError(f"a whole number of more than {digits:,} digits", text,
                                   number.start() if number else 0) from None


def read_json_file(path: str | Path, what: str, missing_hint: str = "") -> dict:
    """The JSON object in the file at `path`, `what` (e.g. "profile", "hardware file") naming it
    in the one-line errors every reader of a servesim JSON file gives: no such file (with
    `missing_hint`, how to make one), unreadable, not JSON (with its line), a key given twice, not
    one object."""
    p = Path(path)
    try:
        data = loads_unique(p.read_text(encoding="utf-8-sig"))  # (a byte-order mark, as some editors write, is read past)
    except DuplicateKeyError as e:
        raise ServesimError(f"{p}: {e}") from None
    except FileNotFoundError:
        raise ServesimError(f"{p}: no such {what}{f' ({missing_hint})' if missing_hint else ''}") from None
    except json.JSONDecodeError as e:
        raise ServesimError(f"{p}: cannot read it as JSON: not a {what} (invalid JSON at line {e.lineno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ServesimError(f"{p}: cannot read the {what}: {getattr(e, 'strerror', None) or e}") from None
    except RecursionError:  # (json's parser recurses per nesting level: tens of thousands of `[` overflow it)
        raise ServesimError(f"{p}: cannot read it as JSON: not a {what} (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ServesimError(f"{p}: not a {what}: a {what} is one JSON object")
    return data


@contextmanager
def fields_of(path: str | Path, what: str = "profile"):
    """Reading a parsed file's fields: a missing field, a value of the wrong type or a refusal
    raised while building from them becomes one line naming the file."""
    try:
        yield
    except KeyError as e:
        raise ServesimError(f"{path}: the {what} has no field {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: int() of an infinity (1e999 in JSON)
        raise ServesimError(f"{path}: a {what} field has the wrong type ({e})") from None
    except ServesimError as e:
        raise ServesimError(f"{path}: {e}") from None
