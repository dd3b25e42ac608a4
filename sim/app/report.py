"""`sim report DIR`: the HTML report of a run, a folder of runs, a sweep or a capacity search,
written whole (sim.app.outputs) after the folder is checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sim.app.outputs import atomic_write_text, check_folder_destination, record_file
from sim.errors import ServesimError


def write_report(directory: str | Path) -> Path:
    """DIR/report.html for what DIR holds (reports.html draws it), recorded in DIR's manifest
    where it has one (sim.app.outputs.record_file)."""
    from reports.html import folder_report_html

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ServesimError(f"{d}: a file, not a folder; sim report takes the folder of a run, a folder of runs, a "
                            "sweep or a capacity search")
    if not d.is_dir():
        raise ServesimError(f"{d}: no such folder")
    check_folder_destination(d)  # a read-only folder is named before the report is drawn
    out = d / "report.html"
    page = folder_report_html(d)
    missing = missing_points(d)
    if missing:
        page = _with_warning(page, f"This sweep is incomplete: {len(missing)} of its points have no result "
                                   f"(the sweep was stopped before them): {', '.join(missing)}. Every figure "
                                   "below shows only the finished points; finish it with the same `sim sweep` "
                                   "command and --resume.")
    atomic_write_text(out, page)
    record_file(d, out.name)  # a folder servesim wrote stays servesim's (an --overwrite may replace it)
    return out


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


def _with_warning(page: str, text: str) -> str:
    """The page with a warning box under its title."""
    import html

    box = (f'<div class="warning" role="alert" style="border:2px solid #b00;background:#fff4f4;color:#700;'
           f'padding:8px 12px;margin:8px 0"><b>Incomplete:</b> {html.escape(text)}</div>')
    at = page.find('<div class="sub">')
    end = page.find("</div>", at) + len("</div>") if at >= 0 else page.find("<body>") + len("<body>")
    return page[:end] + box + page[end:]


def register(sub) -> None:
    p = sub.add_parser("report", help="write DIR/report.html for a run, a folder of runs, a sweep or a capacity search",
                       description="Write a self-contained HTML report (plotly inline, opens offline) for what DIR "
                                   "holds: a sweep (results.parquet), a capacity search (capacity.csv), one run "
                                   "(summary.json), or a folder of run folders (compared).")
    p.add_argument("dir", metavar="DIR", help="the folder to report on")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    out = write_report(args.dir)
    missing = missing_points(Path(args.dir))
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        print(f"sim: warning: {args.dir}: the sweep is incomplete, {len(missing)} points have no result ({shown}); "
              "the report shows the finished points only and says so", file=sys.stderr)
    print(f"wrote {out}")
    return 0
