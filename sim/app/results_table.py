"""The table of a sweep (results.parquet) or a capacity search (probes.parquet): rows keyed by
point, rewritten whole after each new row, with the table's identity (the trace's content, the
grid, every fixed option) in its Parquet metadata.

A folder holds the tables of one trace and one grid: a sweep and a capacity search may share a
folder only when their requests, fixed options and axes (but the rate scale, which a capacity
search searches) agree, so that `sim report` never draws two workloads as one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from reports.tables import METADATA_KEY, RESULTS, read_rows, read_table
from sim.app.options import ReplayOptions
from sim.app.outputs import atomic_path
from sim.errors import ServesimError

PROBES = "probes.parquet"  # a capacity search's table (its capacities are in capacity.csv)
KINDS = {RESULTS: "sweep", PROBES: "capacity search"}
DERIVED = {PROBES: ("capacity.csv",)}  # files drawn from a table, removed with it


def identity(trace_sha256: str, axes: dict[str, tuple], options: ReplayOptions, sweep_axes) -> dict:
    """What makes two tables comparable: the trace's content, the grid, and every fixed option."""
    from reports.digest import flat_options

    described = asdict(options)
    del described["batch_defaults"]  # the command line's unset flags: a value, not an option (sim.app.plan)
    if options.cluster.is_single:  # as tables were before clusters, so they still resume
        del described["cluster"]
    fixed = {k: v for k, v in flat_options(described).items() if k not in sweep_axes}
    out = {"trace_sha256": trace_sha256, "axes": {k: list(v) for k, v in axes.items()}, "fixed": fixed}
    specs = [*axes.get("policy", ()), options.scheduler.policy, options.cluster.router]
    code = plugin_code(specs)
    if code:  # (a table of servesim's own policies and routers only keeps the identity it had)
        out["plugin_sha256"] = code
    return out


def plugin_code(specs) -> dict[str, str]:
    """The sha256 of the file of each user plugin among `specs` (`FILE.py:Class`, `module:Class`), by
    spec: a resumed table must be of the same code, as of the same trace (a plugin edited between two
    runs of a sweep mixed the two versions' rows). A file that cannot be read is left to the run to name."""
    import hashlib

    from sim.plugins import plugin_file

    code = {}
    for spec in dict.fromkeys(s for s in specs if isinstance(s, str)):
        path = plugin_file(spec)  # (None: a built-in's name)
        try:
            if path is not None:
                code[spec] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return code


def upgraded(stored: dict, rows: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """A table's identity and rows as a table written today would hold them, where it was written before
    some of the axes existed (reports.axes.LATER_AXES): each such axis at the one value its points ran at,
    in the identity's grid, in each row's column and in its point's key, so that `--resume` of the same
    command continues it (it was refused as 'grid max_num_active_seqs = not set there, [0] here', naming
    an option no one gave, or would have run every point again beside the old rows). An axis that the
    table states as a fixed option (--stream-interval 2 before it was an axis) is that axis at the fixed
    value, so that the same command resumes it and another value is named by `difference` as the grid's."""
    from reports.axes import LATER_AXES

    axes = stored.get("axes") if isinstance(stored, dict) else None
    fixed = stored.get("fixed") if isinstance(stored, dict) else None
    rows = list(rows or [])
    if not isinstance(axes, dict) or not axes or not isinstance(fixed, dict):
        return stored, rows
    added = {name: value for name, value in LATER_AXES.items() if name not in axes and name not in fixed}
    moved = {name: fixed[name] for name in LATER_AXES if name not in axes
             and isinstance(fixed.get(name), (int, float, str)) and not isinstance(fixed[name], bool)}
    added.update(moved)
    if not added:
        return stored, rows
    stored = dict(stored, axes={**axes, **{name: [value] for name, value in added.items()}},
                  fixed={k: v for k, v in fixed.items() if k not in moved})
    return stored, [_with_axes(row, added) for row in rows]


def _with_axes(row: dict, added: dict) -> dict:
    """A row of a table written before the axes `added` existed, with them (at their values) in its
    columns and in its point's key, each in its place among the axes (point_key's order)."""
    from reports.axes import AXES, axis_text

    row = dict(row)
    key = row.get("point")
    order = list(AXES)
    for name, value in added.items():
        row.setdefault(name, value)
        if not isinstance(key, str) or f",{name}=" in key or key.startswith(f"{name}="):
            continue
        following = order[order.index(name) + 1:]
        at = next((key.find(f",{after}=") for after in following if f",{after}=" in key), -1)
        if at >= 0:
            key = f"{key[:at]},{axis_text(name, value)}{key[at:]}"
    row["point"] = key
    return row


def difference(stored: dict, current: dict, skip_axes: tuple[str, ...] = ()) -> str | None:
    """How two identities differ, in words; None when they agree (on all but `skip_axes`)."""
    if stored.get("trace_sha256") != current["trace_sha256"]:
        return "a different trace (its requests differ)"
    old_code, new_code = stored.get("plugin_sha256") or {}, current.get("plugin_sha256") or {}
    changed = sorted(spec for spec in set(old_code) & set(new_code) if old_code[spec] != new_code[spec])
    if changed:
        return f"your plugin {changed[0]} changed since those rows ran (its file's contents differ)"
    for section, label in (("axes", "grid"), ("fixed", "option")):
        old, new = stored.get(section, {}), current[section]
        differ = [key for key in set(old) | set(new) if key not in skip_axes and old.get(key) != new.get(key)]
        if differ:
            # The telling key first: one both state, else one given a value (a cluster's replicas, not its
            # empty pool options, where one table is of a cluster and the other of one engine).
            key = min(differ, key=lambda k: (not (k in old and k in new), old.get(k) in EMPTY and new.get(k) in EMPTY,
                                             k))
            return f"{label} {key} = {_shown(old, key)} there, {_shown(new, key)} here"
    return None


def _shown(values: dict, key: str) -> str:
    return repr(values[key]) if key in values else "not set"


EMPTY = (None, "", 0, False, (), [])  # an option's value that says nothing was given


def check_folder(folder: Path, name: str, current: dict, trace_source: str, overwrite: bool) -> list[str]:
    """Refuse (or with `overwrite`, remove) the other kind of table in `folder` when it is of another
    trace or grid; returns warnings for what was removed."""
    removed = []
    for other, kind in KINDS.items():
        path = folder / other
        if other == name or not path.exists():
            continue
        frame, stored = read_table(path)
        differs = difference(upgraded(stored)[0], current, skip_axes=("rate_scale",))
        if differs is None:
            continue
        theirs = sorted(set(frame["trace"].dropna().astype(str))) if "trace" in frame else []
        described = f"{KINDS[name]} of {trace_source}"
        if not overwrite:
            rows = f"{len(frame)} row{'s' * (len(frame) != 1)}"
            raise ServesimError(f"{folder}: holds a {kind} ({other}, {rows} of {', '.join(theirs) or '?'}) "
                                f"that this {described} would be reported with, but it has {differs}; choose "
                                "another --out, or pass --overwrite to remove it")
        for stale in (other, *DERIVED.get(other, ())):
            (folder / stale).unlink(missing_ok=True)
            removed.append(f"{folder / stale}: removed (--overwrite): a {kind} with {differs}")
    return removed


class ResultsTable:
    """A Parquet table of rows keyed by point, rewritten whole after each new row.

    Parquet cannot be appended to in place, and a file killed mid-write has no footer: each
    rewrite goes to a temporary file of its own, renamed over the old table, so the table on
    disk is always whole (sim.app.outputs.atomic_path)."""

    def __init__(self, path: Path, identity: dict, resume: bool, order: Callable[[dict], tuple],
                 overwrite: bool = False):
        self.path = path
        self.identity = identity
        self.order = order
        self.rows: dict[str, dict] = {}
        if path.exists() and not overwrite:
            if not resume:
                raise ServesimError(f"{path} already exists: pass --resume to continue that run, "
                                    "--overwrite to start again, or choose another --out")
            rows, stored = read_rows(path)
            stored, rows = upgraded(stored, rows)
            differs = difference(stored, identity)
            if differs is not None:
                raise ServesimError(f"{path} holds results of other options ({differs}); resume with the same "
                                    "options, or choose another --out")
            self.rows = {row["point"]: row for row in rows}

    def is_done(self, key: str) -> bool:
        row = self.rows.get(key)
        return row is not None and row["status"] == "ok"

    def add(self, row: dict) -> None:
        self.rows[row["point"]] = row
        self.write()

    def sorted_rows(self) -> list[dict]:
        return sorted(self.rows.values(), key=self.order)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.sorted_rows())

    def write(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self.sorted_rows()
        columns: dict[str, None] = {}
        for row in sorted(rows, key=lambda r: r["status"] != "ok"):  # a full row decides the column order
            columns.update(dict.fromkeys(row))
        table = pa.table({name: [_plain(row.get(name)) for row in rows] for name in columns})
        metadata = {METADATA_KEY: json.dumps(self.identity, sort_keys=True).encode()}
        table = table.replace_schema_metadata(metadata)
        with atomic_path(self.path) as temporary:
            pq.write_table(table, temporary)


def _plain(value):
    """Parquet-friendly: numpy scalars and arrays to Python, NaN stays a float."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
