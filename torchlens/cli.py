"""The command line for saved traces: `torchlens` (or `python -m torchlens`).

    torchlens narrate run.tl [--last N] [--select MODULE]   print the narration
    torchlens html run.tl [-o page.html]                    write the HTML page, print its path
    torchlens compare a.tl b.tl [--html out.html]           print the comparison; exit 1 if they diverge
    torchlens repro run.tl DIR                              write a one-op repro, print its path

Each command does what the Python call of the same name does on `tl.load(path)`, so the two never
disagree. The exit status is what a script or CI job reads: 0 done (for `compare`, no divergence),
1 `compare` found a divergence, 2 the command could not run. A user's mistake (a missing file, a
file that is not a trace, a bad option) is one line on stderr that says what to do, never a
traceback: a traceback is kept for a failure of torchlens itself, which still exits 2 so that it
can never read as a divergence.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import List, Optional

__all__ = ["main"]

PROG = "torchlens"
OK, DIVERGED, FAILED = 0, 1, 2


class CommandError(Exception):
    """What stops a command, as the one line it prints (the file's name first, where it is about one)."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line naming the `--help` that lists the options."""

    def error(self, message: str):
        self.exit(FAILED, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def _count(text: str) -> int:
    """A number of lines for `--last`: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 0, got {text!r}")
    return value


def _tolerance(text: str) -> float:
    """An `--rtol` / `--atol`: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a finite number >= 0, got {text!r}")
    return value


def _load(path: str):
    """`tl.load(path)`, its failures as one line each."""
    from .api import load
    from .errors import TraceFileError

    try:
        return load(path)
    except FileNotFoundError:
        raise CommandError(f"{path}: no such file (a saved trace is what trace.save(path) writes)") from None
    except IsADirectoryError:
        raise CommandError(f"{path}: is a directory, not a saved trace (give the file trace.save(path) "
                           f"wrote)") from None
    except PermissionError:
        raise CommandError(f"{path}: permission denied (make the file readable to this user)") from None
    except TraceFileError as exc:
        text = str(exc) if path in str(exc) else f"{path}: {exc}"
        if "damaged" in text:
            text += " (copy it again, or save it again with trace.save(path))"
        elif "trace.save(path)" not in text:
            text += " (a saved trace is what trace.save(path) writes)"
        raise CommandError(text) from None
    except OSError as exc:
        raise CommandError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _write(what: str, path: str, write, option: str) -> str:
    """`write(path)` (a `to_html`), its failure to write as one line naming the `option` that moves it."""
    try:
        return write(path)
    except OSError as exc:
        raise CommandError(f"{path}: cannot write the {what} there ({exc.strerror or exc}): give another path "
                           f"with {option}") from None


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")


# -- the commands --------------------------------------------------------------------------------


def _narrate(args) -> int:
    from .selectors import in_module

    recording = _load(args.trace)
    select = in_module(*args.select) if args.select else None
    _out(recording.narrate(last=args.last, select=select))
    return OK


def _html(args) -> int:
    recording = _load(args.trace)
    output = args.output or _beside(args.trace, ".html")
    _out(_write("page", output, recording.to_html, "-o"))
    return OK


def _beside(path: str, suffix: str) -> str:
    """`run.tl` -> `run.html`, next to it (never the input itself)."""
    stem, old = os.path.splitext(path)
    return (path if old == suffix else stem) + suffix


def _compare(args) -> int:
    from .debug import compare as compare_traces

    report = compare_traces(_load(args.trace_a), _load(args.trace_b), rtol=args.rtol, atol=args.atol)
    page = _write("comparison page", args.html, report.to_html, "--html") if args.html else None
    _out(report.table(elide=not args.all, max_rows=None if args.all else 100))
    if page is not None:
        _out(page)
    diverged = report.first_divergence is not None or report.first_gradient_divergence is not None
    return DIVERGED if diverged else OK


def _repro(args) -> int:
    from .errors import ReproError

    recording = _load(args.trace)
    try:
        path = recording.repro(args.directory)
    except ReproError as exc:
        raise CommandError(f"{args.trace}: no repro: {exc}") from None
    except OSError as exc:
        raise CommandError(f"{args.directory}: cannot write the repro there ({exc.strerror or exc})") from None
    _out(os.fspath(path))
    return OK


# -- the parser ----------------------------------------------------------------------------------


def _parser():
    """(the top parser, its commands' parsers by name)."""
    top = _Parser(prog=PROG, description="Read traces saved with trace.save(path): narrate them, write their "
                  "HTML page, compare two, or write a one-op repro.",
                  epilog="Exit status: 0 done (compare: no divergence), 1 compare found a divergence, 2 the "
                  "command could not run.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    sub = commands.add_parser("narrate", help="print a saved trace's narration",
                              description="Print the narration of a saved trace, byte for byte what "
                              "recording.narrate() returns.")
    sub.add_argument("trace", help="a file written by trace.save(path)")
    sub.add_argument("--last", type=_count, metavar="N", help="only the last N lines (a failed run's crash tail)")
    sub.add_argument("--select", action="append", metavar="MODULE",
                     help="only this module's subtree, as tl.in_module(MODULE) selects it (a dotted path such "
                     "as transformer.h.1; repeat for several)")
    sub.set_defaults(run=_narrate)

    sub = commands.add_parser("html", help="write a saved trace's HTML page",
                              description="Write the HTML page recording.to_html(path) writes, and print its "
                              "path.")
    sub.add_argument("trace", help="a file written by trace.save(path)")
    sub.add_argument("-o", "--output", metavar="PAGE", help="where to write it (default: the trace's path with "
                     ".html for its suffix)")
    sub.set_defaults(run=_html)

    sub = commands.add_parser("compare", help="compare two saved traces op by op",
                              description="Compare two saved traces as tl.debug.compare(trace_a, trace_b) "
                              "does and print the report. Exit status 1 when it names a first divergence (of "
                              "the forward or of the gradients), 0 when it does not.")
    sub.add_argument("trace_a", help="a file written by trace.save(path), from tl.trace(...)")
    sub.add_argument("trace_b", help="the other one; relative differences are taken against it")
    sub.add_argument("--rtol", type=_tolerance, help="relative tolerance for every floating output (default: "
                     "per dtype)")
    sub.add_argument("--atol", type=_tolerance, help="absolute tolerance for every floating output (default: "
                     "per dtype)")
    sub.add_argument("--html", metavar="PAGE", help="also write the comparison's HTML page there")
    sub.add_argument("--all", action="store_true", help="print every row (by default runs of rows within "
                     "tolerance are folded and the table stops after 100 lines)")
    sub.set_defaults(run=_compare)

    sub = commands.add_parser("repro", help="write a one-op repro of a saved trace",
                              description="Write the one-op repro recording.repro(DIR) writes (repro.py and "
                              "its inputs) and print the script's path.")
    sub.add_argument("trace", help="a file written by trace.save(path)")
    sub.add_argument("directory", metavar="DIR", help="the directory to write it into")
    sub.set_defaults(run=_repro)
    return top, commands.choices


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line `argv` (default: the process's); returns the exit status."""
    from .errors import TorchlensError

    top, commands = _parser()
    args, unknown = top.parse_known_args(argv)
    if unknown:  # said by the command's parser, whose --help lists what it takes
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    name = f"{PROG} {args.command}"
    try:
        return args.run(args)
    except (CommandError, TorchlensError) as exc:  # (a TorchlensError: an option torchlens refused, e.g. --select)
        sys.stderr.write(f"{name}: error: {exc}\n")
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except Exception:
        traceback.print_exc()
        sys.stderr.write(f"{name}: error: torchlens failed (the traceback above says where)\n")
    return FAILED
