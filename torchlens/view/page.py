"""The HTML shell both pages share: one self-contained file, its data embedded as JSON.

The page must open anywhere a run's artefacts are copied (a laptop, a CI artifact, an air-gapped
cluster), so the stylesheet and scripts are inlined from `assets/` and nothing is fetched. The data
sits in a `<script type="application/json">` element, which the browser never executes; every `<`
in it is written as `\\u003c`, so no op name, module path or error text can close the element or
open a comment that would swallow the rest of the page.

The same view can also be one element among others (`fragment`: a notebook cell's output, where
several views share one document). So the view lives in a container, `.torchlens-view`, to which
every style rule is scoped; its scripts run inside a function given that container, find their
data in it and declare nothing global; and a fragment's container has an id of its own.
"""

from __future__ import annotations

import functools
import html
import json
import uuid
from importlib import resources
from typing import Sequence

__all__ = ["fragment", "page"]


@functools.lru_cache(maxsize=None)
def asset(name: str) -> str:
    """A file of `torchlens/view/assets/`, as text (read once per process)."""
    # (one part per joinpath: Python 3.10's Traversable, a zipped install's, takes no more)
    return resources.files(__package__).joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def embedded_json(data) -> str:
    """`data` as JSON that is safe inside a `<script>` element."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c")


def _view(root_id: str, data, scripts: Sequence[str], data_attributes: str, inner: str = "",
          container: str = 'class="torchlens-view"') -> str:
    """The container (`container`: its attributes), holding `inner` (what shows until the script
    has drawn the view), the data, and the scripts, run in a function that is handed the container
    (so they need no global name)."""
    code = "\n".join(asset(name) for name in scripts)
    return (
        f'<div {container} id="{root_id}">\n{inner}'
        f'<script type="application/json" {data_attributes}>{embedded_json(data)}</script>\n'
        f"<script>\n(function (root) {{\n{code}}})(document.getElementById({json.dumps(root_id)}));\n</script>\n"
        "</div>\n"
    )


def page(title: str, data, scripts: Sequence[str]) -> str:
    """The document: `title`, the embedded `data`, the stylesheet and `scripts` (asset names)."""
    noscript = ('<noscript><p class="noscript">This page draws its tree with JavaScript; the run\'s data is '
                "in the script element with id torchlens-data.</p></noscript>\n")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n"
        f"<style>\nbody {{ margin: 0; }}\n{asset('view.css')}</style>\n"
        "</head>\n<body>\n"
        + _view("torchlens-view", data, scripts, 'id="torchlens-data" class="torchlens-data"', noscript)
        + "</body>\n</html>\n"
    )


def fragment(title: str, data, scripts: Sequence[str], fallback: str) -> str:
    """The same view as one element to place in another document (a notebook cell's output).

    Its stylesheet comes with it (scoped to the container, so it restyles nothing around it); its
    container's id is unique, so a notebook of many views, kept across kernel restarts, never
    confuses two. `fallback` is what shows where the script does not run (an untrusted notebook,
    a viewer that strips scripts): the script removes it once the view is drawn.
    """
    root_id = "torchlens-view-" + uuid.uuid4().hex[:16]
    inner = (f"<style>\n{asset('view.css')}</style>\n"
             f'<p class="fallback">{html.escape(title)}: {html.escape(fallback)}</p>\n')
    # (a notebook's own shortcuts must not fire while a key is typed into the filter box)
    return _view(root_id, data, scripts, 'class="torchlens-data"', inner,
                 'class="torchlens-view embedded" data-lm-suppress-shortcuts="true"')
