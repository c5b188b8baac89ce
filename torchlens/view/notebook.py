"""A run or a comparison shown in a notebook cell (`_repr_html_`): the page `to_html` writes, as
an element of the notebook's document.

The data, stylesheet and scripts are the page's own (`page.fragment`), cut to `MAX_ROWS` rows
(`cut.py`) so that a run of any length keeps the notebook file and the browser light; the view
then says how many rows it left out and that `to_html(path)` writes them all.
"""

from __future__ import annotations

from .cut import cut_sections, cut_tables
from .page import fragment
from .recording_page import SCRIPTS as RUN_SCRIPTS
from .recording_page import recording_data
from .report_page import SCRIPTS as REPORT_SCRIPTS
from .report_page import report_data

__all__ = ["MAX_ROWS", "recording_view", "report_view"]

# Rows a notebook view holds, over all its parts: a GPT-2 124M forward and its backward (1,375
# rows, with statistics 275 KB) fit whole; a longer run's view is cut to that many rows.
MAX_ROWS = 2000

_NO_SCRIPT = ("the interactive view is drawn by JavaScript, which did not run here (an untrusted notebook, or a "
              "viewer that leaves scripts out): to_html(path) writes it as a page to open in a browser.")


def _note(left_out: int, total: int, around) -> str:
    """The view's first line when it left rows out: how many, which it kept, how to see them all."""
    kept = "the first rows of each part" + (", and those around " + " and ".join(around) if around else "")
    return (f"{left_out:,} of {total:,} rows are left out of this notebook view, which holds at most {MAX_ROWS:,} "
            f"({kept}); to_html(path) writes the whole page.")


def _fallback(lines) -> str:
    """What shows where no script runs: the view's summary lines, then why there is no more."""
    return " ".join(line if line.endswith((".", ":")) else line + "." for line in lines) + " " + _NO_SCRIPT


def _led_to(sections) -> list:
    """What the run's view leads to, whose neighbouring rows it kept."""
    failed = any((section.get("failure") or {}).get("at") is not None for section in sections)
    first = any(section.get("first") is not None for section in sections)
    return [what for what, found in (("the failed call", failed), ("the first non-finite row", first)) if found]


def recording_view(recording) -> str:
    """The notebook view of a `Recording`, `Trace` or `PartialTrace`."""
    title, data = recording_data(recording)
    summary = [line["text"] for line in data["sections"][0]["lines"][:3]]
    left_out, total = cut_sections(data["sections"], MAX_ROWS)
    if left_out:
        data["cut"] = _note(left_out, total, _led_to(data["sections"]))
        summary.append(data["cut"])
    return fragment(title, data, RUN_SCRIPTS, _fallback(summary))


def report_view(report) -> str:
    """The notebook view of a `CompareReport`."""
    title, data = report_data(report)
    summary = [table["summary"] for table in data["tables"]]
    left_out, total = cut_tables(data["tables"], MAX_ROWS)
    if left_out:
        led_to = any(table["first"] is not None for table in data["tables"])
        real = any(table.get("real") is not None for table in data["tables"])
        data["cut"] = _note(left_out, total, (["the first real divergence"] if real else []) +
                            (["the first divergence"] if led_to else []))
        summary.append(data["cut"])
    return fragment(title, data, REPORT_SCRIPTS, _fallback(summary))
