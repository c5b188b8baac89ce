"""A view's data cut to a number of rows, each run of rows left out replaced by one row saying how many.

A notebook keeps every cell's output in its file and draws it in its own document, so a view
embedded there must stay small however long the run was. What stays, in each part of the view (a
run's forward and each backward, a comparison's tables), is what the page leads to — the call that
failed, the first non-finite row, each finding's row, the first divergence — with the rows just
before it (what led there, as a crash tail shows) and after it, then the part's first rows in order
until its share of the rows is spent. Parts share the rows evenly; a part that needs less leaves
the rest to the others.

A row's place in a tree is its path of child indices, which the page follows to open the modules
above it; cutting moves rows, so every path the data holds is moved with them (a link whose row
was left out stays as text). Module calls keep their counts: they describe the run, not the view.

A run of rows left out is one row in their place: `{"t": "cut", "o": "... 409 rows left out here"}`
in a tree, `{"cut": 409, "o": ...}` in a table. A cut part also says how many of its rows the
page's totals count it holds (`shown`), and the data how many rows were left out (`cut`, set by
`notebook.py`).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Set, Tuple

__all__ = ["cut_sections", "cut_tables", "shares"]

BEFORE = 10  # rows kept before a row the page leads to
AFTER = 5  # and after it
MAX_TARGETS = 8  # rows led to per part that get their neighbours kept (a failure, a first row, findings)

Path = Tuple[int, ...]


def shares(sizes: Sequence[int], limit: int) -> List[int]:
    """How many of its `sizes[i]` rows each part keeps: `limit` split evenly, what a small part
    does not need going to the larger ones."""
    out = [0] * len(sizes)
    left = limit
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    for done, i in enumerate(order):
        out[i] = min(sizes[i], left // (len(sizes) - done))
        left -= out[i]
    return out


def _kept(count: int, targets: Sequence[int], share: int) -> Set[int]:
    """The positions kept of `count` rows: each target with its neighbours, then the first rows."""
    keep: Set[int] = set()
    for target in targets[:MAX_TARGETS]:
        keep.update(range(max(0, target - BEFORE), min(count, target + AFTER + 1)))
    position = 0
    while len(keep) < share and position < count:
        keep.add(position)
        position += 1
    return keep


def _left_out(count: int) -> str:
    return f"... {count:,} {'row' if count == 1 else 'rows'} left out here"


# -- a run's module trees ------------------------------------------------------------------------


def _leaves(call: dict, prefix: Path = ()) -> Iterator[Path]:
    """The path of every row under `call`, in the order the page shows them."""
    for index, kid in enumerate(call["k"]):
        path = prefix + (index,)
        if "k" in kid:
            yield from _leaves(kid, path)
        else:
            yield path


def _rows_in(node: dict) -> int:
    return sum(_rows_in(kid) for kid in node["k"]) if "k" in node else 1


def _targets(section: dict) -> List[Path]:
    """The rows the page leads to in `section`, the most important first."""
    found = [(section.get("failure") or {}).get("at"), section.get("first")]
    found += [line.get("at") for line in section["lines"]]
    out: List[Path] = []
    for path in found:
        if path is not None and tuple(path) not in out:
            out.append(tuple(path))
    return out


class _Pruner:
    """A copy of a tree holding the rows at `keep`; `moved` maps each kept row's old path to its new one."""

    def __init__(self, keep: Set[Path]):
        self.keep = keep
        self.held = {path[:depth] for path in keep for depth in range(1, len(path))}
        self.moved: Dict[Path, Path] = {}

    def copy(self, call: dict, old: Path = (), new: Path = ()) -> dict:
        kids: List[dict] = []
        left_out = 0
        for index, kid in enumerate(call["k"]):
            path = old + (index,)
            if path in (self.held if "k" in kid else self.keep):
                if left_out:
                    kids.append({"t": "cut", "o": _left_out(left_out)})
                    left_out = 0
                if "k" in kid:
                    kids.append(self.copy(kid, path, new + (len(kids),)))
                else:
                    self.moved[path] = new + (len(kids),)
                    kids.append(kid)
            else:
                left_out += _rows_in(kid)
        if left_out:
            kids.append({"t": "cut", "o": _left_out(left_out)})
        return dict(call, k=kids)


def cut_sections(sections: List[dict], limit: int) -> Tuple[int, int]:
    """Cut a run page's sections, in place, to about `limit` rows (more only when the rows it
    leads to need their neighbours); returns (rows left out, rows in all)."""
    leaves = [list(_leaves(section["tree"])) for section in sections]
    total = sum(len(paths) for paths in leaves)
    if total <= limit:
        return 0, total
    kept = 0
    for section, paths, share in zip(sections, leaves, shares([len(p) for p in leaves], limit)):
        position = {path: i for i, path in enumerate(paths)}
        targets = [position[path] for path in _targets(section) if path in position]
        keep = {paths[i] for i in _kept(len(paths), targets, share)}
        # the rows the page's totals count (not outputs or attempts), which its filter counts against
        section["shown"] = sum(1 for path in keep if _at(section["tree"], path).get("t") not in ("out", "try"))
        pruner = _Pruner(keep)
        section["tree"] = pruner.copy(section["tree"])
        _move_links(section, pruner.moved)
        kept += len(keep)
    return total - kept, total


def _at(call: dict, path: Path) -> dict:
    for index in path:
        call = call["k"][index]
    return call


def _move_links(section: dict, moved: Dict[Path, Path]) -> None:
    def new(path):
        return None if path is None or tuple(path) not in moved else list(moved[tuple(path)])

    section["first"] = new(section.get("first"))
    failure = section.get("failure")
    if failure is not None:
        failure["at"] = new(failure.get("at"))
    for line in section["lines"]:
        if "at" in line:
            at = new(line["at"])
            if at is None:
                del line["at"]
            else:
                line["at"] = at


# -- a comparison's tables -----------------------------------------------------------------------


def cut_tables(tables: List[dict], limit: int) -> Tuple[int, int]:
    """Cut a comparison page's tables, in place, to about `limit` rows, keeping each table's first
    real divergence (judged against float64) and first divergence with their neighbours; returns
    (rows left out, rows in all)."""
    sizes = [len(table["rows"]) for table in tables]
    total = sum(sizes)
    if total <= limit:
        return 0, total
    left_out_in_all = 0
    for table, share in zip(tables, shares(sizes, limit)):
        rows, first, real = table["rows"], table["first"], table.get("real")
        keep = _kept(len(rows), [i for i in (real, first) if i is not None], share)
        kept: List[dict] = []
        left_out = 0
        for i, row in enumerate(rows):
            if i not in keep:
                left_out += 1
                continue
            if left_out:
                kept.append({"cut": left_out, "o": _left_out(left_out)})
                left_out = 0
            if i == first:
                table["first"] = len(kept)
            if i == real:
                table["real"] = len(kept)
            kept.append(row)
        if left_out:
            kept.append({"cut": left_out, "o": _left_out(left_out)})
        table["rows"] = kept
        left_out_in_all += len(rows) - len(keep)
    return left_out_in_all, total
