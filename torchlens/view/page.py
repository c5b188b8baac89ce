"""The HTML shell both pages share: one self-contained file, its data embedded as JSON.

The page must open anywhere a run's artefacts are copied (a laptop, a CI artifact, an air-gapped
cluster), so the stylesheet and scripts are inlined from `assets/` and nothing is fetched. The data
sits in a `<script type="application/json">` element, which the browser never executes; every `<`
in it is written as `\\u003c`, so no op name, module path or error text can close the element or
open a comment that would swallow the rest of the page.
"""

from __future__ import annotations

import functools
import html
import json
from importlib import resources
from typing import Sequence

__all__ = ["page"]


@functools.lru_cache(maxsize=None)
def asset(name: str) -> str:
    """A file of `torchlens/view/assets/`, as text (read once per process)."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def embedded_json(data) -> str:
    """`data` as JSON that is safe inside a `<script>` element."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c")


def page(title: str, data, scripts: Sequence[str]) -> str:
    """The document: `title`, the embedded `data`, the stylesheet and `scripts` (asset names)."""
    code = "\n".join(asset(name) for name in scripts)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n"
        f"<style>\n{asset('view.css')}</style>\n"
        "</head>\n<body>\n"
        '<noscript><p class="noscript">This page draws its tree with JavaScript; the run\'s data is '
        "in the script element with id torchlens-data.</p></noscript>\n"
        '<div id="app"></div>\n'
        f'<script type="application/json" id="torchlens-data">{embedded_json(data)}</script>\n'
        f"<script>\n{code}</script>\n"
        "</body>\n</html>\n"
    )
