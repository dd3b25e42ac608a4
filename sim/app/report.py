"""`sim report DIR`: the HTML report of a run, a folder of runs, a sweep or a capacity search,
written whole (sim.app.outputs) after the folder is checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sim.app.outputs import atomic_write_text, check_folder_destination, check_ours_to_replace, record_file
from sim.errors import ServesimError


def write_report(directory: str | Path, check_owner: bool = False) -> Path:
    """DIR/report.html for what DIR holds (reports.html draws it), recorded in DIR's manifest
    (sim.app.outputs.record_file); `check_owner`: as write_report_warning's (a resumed sweep's folder)."""
    return write_report_warning(directory, check_owner)[0]


def write_report_warning(directory: str | Path, check_owner: bool = False) -> tuple[Path, list[str]]:
    """write_report's, and the warnings its page shows in boxes under the title (an incomplete sweep, runs
    of different traces), each a sentence for the terminal. `check_owner` (`sim report`, outside a
    claimed folder): a report.html that servesim did not record writing is refused, not replaced."""
    from reports.html import folder_report

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ServesimError(f"{d}: a file, not a folder; sim report takes the folder of a run, a folder of runs, a "
                            "sweep or a capacity search")
    if not d.is_dir():
        raise ServesimError(f"{d}: no such folder")
    check_folder_destination(d)  # a read-only folder is named before the report is drawn
    out = d / "report.html"
    page, warnings = folder_report(d)
    if check_owner:
        check_ours_to_replace(out, "sim report")
    missing = missing_points(d)
    if missing:
        page = _with_warnings(page, [("Incomplete", f"This sweep is incomplete: {len(missing)} of its points have no "
                                                    f"result (the sweep was stopped before them): {', '.join(missing)}. "
                                                    "Every figure below shows only the finished points; finish it "
                                                    "with the same `sim sweep` command and --resume.")])
    page = _with_warnings(page, [(label, text[:1].upper() + text[1:]) for label, text in warnings])
    atomic_write_text(out, page)
    record_file(d, out.name)  # a folder servesim wrote stays servesim's (an --overwrite may replace it)
    return out, [text for _, text in warnings]


def missing_points(d: Path) -> list[str]:
    """The grid points of DIR's sweep table (results.parquet) that have no row (a sweep killed or
    stopped before them), by their keys; [] for a complete sweep or no sweep. The grid is the one
    the table's identity stores."""
    import itertools

    from reports.axes import AXES
    from reports.tables import RESULTS, read_table
    from sim.app.sweep import point_key

    if not (d / RESULTS).exists():
        return []
    rows, identity = read_table(d / RESULTS)
    axes = identity.get("axes") if isinstance(identity, dict) else None
    if not isinstance(axes, dict) or not axes:
        return []
    present = set(rows["point"]) if "point" in rows else set()
    expected_count = 1
    for values in axes.values():
        expected_count *= len(values)
    if set(axes) == set(AXES):
        combos = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
        keys = [point_key(combo) for combo in combos]
        varying = [name for name, values in axes.items() if len(values) > 1] or list(axes)
        if present <= set(keys):  # each missing point by the axes that vary, e.g. "policy=decode-first"
            return [",".join(f"{name}={combo[name]}" for name in varying)
                    for key, combo in zip(keys, combos) if key not in present]
    if len(present) < expected_count:  # the keys are spelled another way: say how many
        return [f"{expected_count - len(present)} of {expected_count} points"]
    return []


def _with_warnings(page: str, warnings: list[tuple[str, str]]) -> str:
    """The page with a warning box under its title (below those it has) for each (label, text)."""
    import html

    boxes = "".join(f'<div class="warning" role="alert" style="border:2px solid #b00;background:#fff4f4;color:#700;'
                    f'padding:8px 12px;margin:8px 0"><b>{html.escape(label)}:</b> {html.escape(text)}</div>'
                    for label, text in warnings)
    at = page.find('<div class="sub">')
    end = page.find("</div>", at) + len("</div>") if at >= 0 else page.find("<body>") + len("<body>")
    while page.startswith('<div class="warning"', end):  # after the boxes already there
        end = page.find("</div>", end) + len("</div>")
    return page[:end] + boxes + page[end:]


def register(sub) -> None:
    p = sub.add_parser("report", help="write DIR/report.html for a run, a folder of runs, a sweep or a capacity search",
                       description="Write a self-contained HTML report (plotly inline, opens offline) for what DIR "
                                   "holds: a sweep (results.parquet), a capacity search (capacity.csv), one run "
                                   "(summary.json), or a folder of run folders (compared).")
    p.add_argument("dir", metavar="DIR", help="the folder to report on")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    out, warnings = write_report_warning(args.dir, check_owner=True)
    for text in warnings:
        print(f"sim: warning: {args.dir}: {text}", file=sys.stderr)
    missing = missing_points(Path(args.dir))
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        print(f"sim: warning: {args.dir}: the sweep is incomplete, {len(missing)} points have no result ({shown}); "
              "the report shows the finished points only and says so", file=sys.stderr)
    print(f"wrote {out}")
    return 0
