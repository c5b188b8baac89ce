"""Call sites: which line of the user's code issued an op.

"The user's code" is the innermost frame outside torch and torchlens; for a model from a library
such as transformers that is the library's line, which is where the op really comes from. Paths are
shown relative to the working directory, or to the `sys.path` entry a module was imported from
(`transformers/models/gpt2/modeling_gpt2.py:312`), so they do not depend on where a package was
installed; `normalize=True` keeps only the base name.
"""

from __future__ import annotations

import os
import re
import sys
import types
from typing import Dict, Optional

import torch

__all__ = ["display_path", "find_user_site", "is_internal_file", "site_from_stack_trace", "still_running"]


def _directory_of(module: types.ModuleType) -> str:
    path = module.__file__
    assert path is not None, f"{module.__name__} has no __file__"
    return os.path.dirname(os.path.abspath(path)) + os.sep


_INTERNAL_DIRS = tuple(_directory_of(module) for module in (torch, sys.modules[__name__.split(".")[0]]))
_internal_cache: Dict[str, bool] = {}
_display_cache: Dict[str, str] = {}


def is_internal_file(filename: str) -> bool:
    internal = _internal_cache.get(filename)
    if internal is None:
        internal = _internal_cache[filename] = os.path.abspath(filename).startswith(_INTERNAL_DIRS)
    return internal


def display_path(filename: str) -> str:
    shown = _display_cache.get(filename)
    if shown is None:
        shown = _display_cache[filename] = _shortest_path(filename)
    return shown


def _shortest_path(filename: str) -> str:
    if filename.startswith("<"):
        return filename
    absolute = os.path.abspath(filename)
    roots = [os.getcwd()] + [os.path.abspath(p) for p in sys.path if p]
    best = absolute
    for root in roots:
        root = root.rstrip(os.sep) + os.sep
        if absolute.startswith(root) and len(absolute) - len(root) < len(best):
            best = absolute[len(root):]
    return best.replace(os.sep, "/")


def find_user_site(frame) -> Optional[str]:
    """Walk outwards from `frame` to the first frame outside torch and torchlens."""
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = _internal_cache.get(filename)
        if internal is None:
            internal = is_internal_file(filename)
        if not internal:
            return display_path(filename) + ":" + str(frame.f_lineno)
        frame = frame.f_back
    return None


def still_running(frame) -> bool:
    """Whether `frame` is on the current call stack: the call it runs has not returned yet."""
    current: Optional[types.FrameType] = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def site_from_stack_trace(stack_trace: Optional[str]) -> Optional[str]:
    """The user's site from an FX node's `stack_trace` (the innermost frame outside torch)."""
    if not stack_trace:
        return None
    site = None
    for filename, lineno in _FRAME_LINE.findall(stack_trace):
        if not is_internal_file(filename):
            site = display_path(filename) + ":" + lineno
    return site
