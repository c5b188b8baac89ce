"""Recordings, traces, partial traces and comparison reports in a notebook (`_repr_html_`): the page
`to_html` writes, embedded in the notebook's document, cut to a bounded number of rows with a note
of what was left out; rendered through IPython's display machinery, checked in the HTML and, in a
real browser, as two views in one document."""

from __future__ import annotations

import copy
import html.parser
import json
import re

import pytest
import torch
from test_html_view import (
    browser,  # noqa: F401  (the headless Chromium the page's own tests drive)
    rows,
)
from torch import nn

import torchlens as tl
from torchlens.view.notebook import MAX_ROWS

HIGHLIGHT, ATTEMPT = 2, 4  # row flags (torchlens/view/tree.py)


class _Elements(html.parser.HTMLParser):
    """The scripts of a page or fragment (attributes, text) and the text of its fallback paragraph."""

    def __init__(self):
        super().__init__()
        self.scripts, self.fallback, self._in = [], "", None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self._in = ("script", attrs, [])
        elif tag == "p" and attrs.get("class") == "fallback":
            self._in = ("fallback", attrs, [])

    def handle_data(self, data):
        if self._in is not None:
            self._in[2].append(data)

    def handle_endtag(self, tag):
        if self._in is not None and tag in ("script", "p"):
            kind, attrs, text = self._in
            if kind == "script":
                self.scripts.append((attrs, "".join(text)))
            else:
                self.fallback = "".join(text)
            self._in = None


def parsed(markup: str) -> _Elements:
    parser = _Elements()
    parser.feed(markup)
    return parser


def data_of(markup: str) -> dict:
    [data] = [text for attrs, text in parsed(markup).scripts if attrs.get("type") == "application/json"]
    return json.loads(data)


def code_of(markup: str) -> str:
    """The view's script, less the line that names its container (each fragment's own id)."""
    [code] = [text for attrs, text in parsed(markup).scripts if "type" not in attrs]
    return re.sub(r"document\.getElementById\(\"[^\"]+\"\)", "CONTAINER", code)


def top_level_selectors(css: str):
    """Each selector of each top-level rule of a stylesheet (a list split at its top-level commas)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    depth, start = 0, 0
    for i, char in enumerate(css):
        if char == "{":
            if depth == 0:
                parts, level, begin, head = [], 0, 0, css[start:i]
                for j, c in enumerate(head):
                    level += (c == "(") - (c == ")")
                    if c == "," and level == 0:
                        parts.append(head[begin:j])
                        begin = j + 1
                yield from (part.strip() for part in parts + [head[begin:]])
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                start = i + 1


def page_of(result, tmp_path) -> str:
    with open(result.to_html(tmp_path / "page.html"), encoding="utf-8") as page:
        return page.read()


def at(tree: dict, path):
    for index in path:
        tree = tree["k"][index]
    return tree


# -- real models ---------------------------------------------------------------------------------


def gpt2(nan: bool = False, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    if nan:
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    return model


def ids():
    return torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))


class Unrolled(nn.Module):
    """A recurrent cell unrolled over many steps: thousands of ops, one module call per step."""

    def __init__(self, steps: int, nan_at=None, shift_at=None, split_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.Linear(8, 8)
        self.steps, self.nan_at, self.shift_at, self.split_at = steps, nan_at, shift_at, split_at

    def forward(self, x):
        for step in range(self.steps):
            if step == self.split_at:  # the cell's sum in two halves: the same value, rounded otherwise
                w = self.cell.weight
                x = torch.tanh(x[:, :4] @ w[:, :4].T + x[:, 4:] @ w[:, 4:].T + self.cell.bias)
            else:
                x = torch.tanh(self.cell(x))
            if step == self.nan_at:
                x = x + torch.log(-torch.ones(()))  # NaN born here, and on to the output
            if step == self.shift_at:
                x = x + 1e-3
        return x


# -- through IPython's display machinery ---------------------------------------------------------


def displayed(result) -> dict:
    """What a notebook front end receives for `result` as the value of a cell: {mime type: data}."""
    formatters = pytest.importorskip(
        "IPython.core.formatters",
        reason="IPython is not installed: pip install ipython (it is in the test extra) to render through a "
               "notebook's display machinery")
    data, _ = formatters.DisplayFormatter().format(result)
    return data


def test_a_cell_shows_a_recording_as_its_page_and_keeps_a_one_line_text_repr(tmp_path):
    recording = tl.record(gpt2(), ids(), value_stats="exact")
    shown = displayed(recording)
    assert shown["text/plain"] == repr(recording) and repr(recording).startswith("<Recording: ")
    assert "\n" not in repr(recording) and len(repr(recording)) < 80
    markup = shown["text/html"]
    page = page_of(recording, tmp_path)
    assert data_of(markup) == data_of(page)  # the page's data, whole (a small run is not cut)
    assert code_of(markup) == code_of(page)  # and its scripts
    forward = data_of(markup)["sections"][0]
    assert sorted(row["i"] for row in rows(forward["tree"]) if row.get("t") in (None, "in")) == [
        event.ordinal for event in recording.ops]


def test_a_cell_shows_a_trace_and_a_partial_trace(tmp_path):
    trace = tl.trace(gpt2(), ids())
    shown = displayed(trace)
    assert shown["text/plain"].startswith("<Trace: ") and "\n" not in shown["text/plain"]
    assert data_of(shown["text/html"]) == data_of(page_of(trace, tmp_path))

    model = gpt2()
    model.transformer.h[1].mlp.c_proj.weight = nn.Parameter(torch.randn(7, 32))  # [8,128] @ [7,32]: no fit
    with pytest.raises(RuntimeError) as caught:
        tl.record(model, ids())
    partial = caught.value.partial_trace
    shown = displayed(partial)
    assert shown["text/plain"].startswith("<PartialTrace: ") and "\n" not in shown["text/plain"]
    forward = data_of(shown["text/html"])["sections"][0]
    attempted = at(forward["tree"], forward["failure"]["at"])
    assert attempted["t"] == "try" and attempted["f"] & ATTEMPT and attempted["i"] == partial.attempt.ordinal
    assert partial.error in forward["failure"]["tail"]


def test_a_cell_shows_a_comparison_report(tmp_path):
    model = gpt2()
    patched = copy.deepcopy(model)
    with torch.no_grad():
        patched.transformer.h[1].mlp.c_fc.weight[0, 0] += 0.5
    report = tl.debug.compare(tl.trace(model, ids()), tl.trace(patched, ids()))
    shown = displayed(report)
    assert shown["text/plain"] == repr(report) and "\n" not in repr(report)
    data = data_of(shown["text/html"])
    assert data == data_of(page_of(report, tmp_path))
    [table] = data["tables"]
    first = table["rows"][table["first"]]
    assert (first["a"], first["p"], first["v"]) == (
        report.first_divergence.ordinal_a, "transformer.h.1.mlp.c_fc", "diverged")


# -- the view as HTML ----------------------------------------------------------------------------


def test_the_nan_is_marked_in_the_view_and_said_where_no_script_runs():
    recording = tl.record(gpt2(nan=True), ids(), on_nonfinite="track", value_stats="reuse")
    markup = recording._repr_html_()
    forward = data_of(markup)["sections"][0]
    first = at(forward["tree"], forward["first"])
    assert first["f"] & HIGHLIGHT and (first["i"], first["o"]) == (
        recording.first_nonfinite.ordinal, recording.first_nonfinite.op)
    assert first["w"] == ["!! " + recording.findings[0].text]
    # a notebook that runs no script (untrusted, or rendered statically) still says what was found
    fallback = parsed(markup).fallback
    assert recording.findings[0].text in fallback and "to_html(path)" in fallback


def test_two_views_are_independent_elements_that_declare_nothing_global():
    recording = tl.record(gpt2(), ids())
    first, second = recording._repr_html_(), recording._repr_html_()
    ids_ = [re.search(r'<div class="torchlens-view embedded"[^>]* id="([^"]+)"', markup).group(1)
            for markup in (first, second)]
    assert ids_[0] != ids_[1]
    for markup, own in zip((first, second), ids_):
        assert markup.startswith('<div class="torchlens-view embedded"') and markup.rstrip().endswith("</div>")
        assert "<html" not in markup and "<body" not in markup and 'id="torchlens-data"' not in markup
        code = [text for attrs, text in parsed(markup).scripts if "type" not in attrs][0]
        assert code.lstrip().startswith("(function (root) {") and code.rstrip().endswith(
            f'}})(document.getElementById("{own}"));')
        assert "document.body" not in code and 'getElementById("app")' not in code
    style = re.search(r"<style>\n(.*?)</style>", first, re.S).group(1)
    selectors = list(top_level_selectors(style))
    assert len(selectors) > 50
    outside = [s for s in selectors if not s.startswith((".torchlens-view ", ".torchlens-view.", "@keyframes torchlens-"))
               and s != ".torchlens-view"]
    assert not outside  # every rule is scoped to the view: nothing restyles the notebook


def test_a_recorder_pass_of_thousands_of_ops_is_cut_with_a_note_that_keeps_the_nan(tmp_path):
    model = Unrolled(steps=2500, nan_at=2300)  # 5,000 ops; the NaN born at step 2,300
    with tl.recording.Recorder(model, value_stats="exact", on_nonfinite="track") as recorder:
        model(torch.randn(2, 8))
    recording = recorder.recordings[0]
    page = page_of(recording, tmp_path)
    whole = data_of(page)
    total = sum(1 for section in whole["sections"] for _ in rows(section["tree"]))
    markup = recording._repr_html_()
    data = data_of(markup)
    forward = data["sections"][0]
    shown = [row for row in rows(forward["tree"]) if row.get("t") != "cut"]
    cuts = [row for row in rows(forward["tree"]) if row.get("t") == "cut"]
    assert len(shown) == MAX_ROWS and cuts
    left_out = sum(int(row["o"].split()[1].replace(",", "")) for row in cuts)
    assert left_out == total - MAX_ROWS
    assert data["cut"].startswith(f"{left_out:,} of {total:,} rows are left out of this notebook view")
    assert "to_html(path) writes the whole page" in data["cut"] and data["cut"] in parsed(markup).fallback
    first = at(forward["tree"], forward["first"])  # the NaN's row is kept, and the page still leads to it
    assert first["f"] & HIGHLIGHT and first["i"] == recording.first_nonfinite.ordinal > MAX_ROWS
    assert [line["at"] for line in forward["lines"] if "at" in line] == [forward["first"]]
    assert forward["tree"]["n"] == whole["sections"][0]["tree"]["n"]  # module counts still describe the run
    assert len(markup.encode()) < 300_000 and len(page.encode()) > 600_000  # (about 130 bytes a row)


class FrozenThenHead(nn.Module):
    """Thousands of ops without gradients, then a head that has them: a long forward, a short backward."""

    def __init__(self):
        super().__init__()
        self.body, self.head = Unrolled(steps=1200), nn.Linear(8, 2)

    def forward(self, x):
        with torch.no_grad():
            x = self.body(x)
        return self.head(x)


def test_a_short_backward_is_kept_whole_and_leaves_its_share_to_the_forward():
    recording = tl.record(FrozenThenHead(), torch.randn(2, 8), backward=True)
    recording.output.sum().backward()
    forward, backward = data_of(recording._repr_html_())["sections"]
    backward_rows = list(rows(backward["tree"]))
    assert backward_rows and not any(row.get("t") == "cut" for row in backward_rows)
    kept = [row for row in rows(forward["tree"]) if row.get("t") != "cut"]
    assert len(kept) == MAX_ROWS - len(backward_rows) > MAX_ROWS // 2


def test_a_long_comparison_is_cut_around_its_first_divergence():
    x = torch.randn(2, 8)
    report = tl.debug.compare(tl.trace(Unrolled(steps=1300), x), tl.trace(Unrolled(steps=1300, shift_at=1200), x))
    assert len(report.rows) > MAX_ROWS
    [table] = data_of(report._repr_html_())["tables"]
    kept = [row for row in table["rows"] if "cut" not in row]
    assert len(kept) == MAX_ROWS
    first = table["rows"][table["first"]]
    assert (first["a"], first["v"]) == (report.first_divergence.ordinal_a, "diverged")
    assert report.first_divergence.ordinal_a > MAX_ROWS
    data = data_of(report._repr_html_())
    assert data["cut"].startswith(f"{len(report.rows) - MAX_ROWS:,} of {len(report.rows):,} rows are left out")
    assert "around the first divergence" in data["cut"]


def test_a_long_comparison_against_float64_keeps_its_first_real_divergence():
    x = torch.randn(2, 8)
    plain = Unrolled(steps=1300)
    report = tl.debug.compare(tl.trace(plain, x), tl.trace(Unrolled(steps=1300, shift_at=1200), x),
                              reference=tl.debug.reference(plain, x))
    assert report.first_real is not None and report.first_real.ordinal_a > MAX_ROWS
    data = data_of(report._repr_html_())
    [table] = data["tables"]
    real = table["rows"][table["real"]]
    assert (real["a"], real["j"]) == (report.first_real.ordinal_a, "real")
    assert "around the first real divergence" in data["cut"]


def test_a_long_comparison_whose_first_divergence_is_rounding_keeps_its_first_real_one_far_later():
    """Held to bit-for-bit equality (rtol=0, atol=0), a run whose step 3 sums in another order
    diverges there, by rounding; its bug, 1,200 steps on, is the first real divergence, which the
    view leads to: it keeps that row and the rows before it, as well as the first divergence's."""
    x = torch.randn(2, 8)
    plain = Unrolled(steps=1300)
    report = tl.debug.compare(tl.trace(plain, x), tl.trace(Unrolled(steps=1300, split_at=3, shift_at=1200), x),
                              rtol=0, atol=0, reference=tl.debug.reference(plain, x))
    first, real = report.first_divergence, report.first_real
    assert first.judgement == "rounding" and first.ordinal_a < 50
    assert real is not None and real.ordinal_a > MAX_ROWS and len(report.rows) > MAX_ROWS
    data = data_of(report._repr_html_())
    [table] = data["tables"]
    position = {row["a"]: i for i, row in enumerate(table["rows"]) if row.get("a") is not None}
    assert real.ordinal_a in position, "the first real divergence's row was left out of the view"
    assert table["real"] == position[real.ordinal_a] and table["rows"][table["real"]]["j"] == "real"
    assert "cut" not in table["rows"][table["real"] - 1]  # what led to it
    assert table["first"] == position[first.ordinal_a]
    assert (table["rows"][table["first"]]["v"], table["rows"][table["first"]]["j"]) == ("diverged", "rounding")
    assert "around the first real divergence and the first divergence" in data["cut"]


# -- in a browser: two views in one notebook-like document ---------------------------------------

NOTEBOOK = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><style>
body { margin: 31px; font-family: serif; }
h1, h2, p, li, pre { color: rgb(0, 128, 0); }
</style></head><body>
<h1>a notebook</h1>
<div class="cell">{first}</div>
<div class="cell">{second}</div>
<p id="after">the next cell</p>
</body></html>
"""


def test_two_views_in_one_document_draw_filter_and_scroll_on_their_own(browser, tmp_path):  # noqa: F811 (a fixture)
    from selenium.webdriver.support.ui import WebDriverWait

    nan = tl.record(gpt2(nan=True), ids(), on_nonfinite="track", value_stats="reuse")
    model = Unrolled(steps=1100, nan_at=1050)
    cut = tl.record(model, torch.randn(2, 8), on_nonfinite="track")
    path = tmp_path / "notebook.html"
    path.write_text(NOTEBOOK.replace("{first}", nan._repr_html_()).replace("{second}", cut._repr_html_()),
                    encoding="utf-8")
    browser.get(path.as_uri())
    views = browser.find_elements("css selector", ".torchlens-view")
    assert len(views) == 2
    WebDriverWait(browser, 10).until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('.torchlens-view')].every(v => v.torchlensView && "
        "v.torchlensView.timings.firstRender)"))
    assert not browser.find_elements("css selector", ".torchlens-view p.fallback")  # drawn: the note is gone
    # the notebook around the views is styled as it was
    assert browser.execute_script(
        "const s = getComputedStyle(document.body), h = getComputedStyle(document.querySelector('body > h1'));"
        "return [s.marginLeft, s.fontFamily, h.color, window.scrollY];") == ["31px", "serif", "rgb(0, 128, 0)", 0]
    assert browser.find_element("css selector", ".torchlens-view h1").value_of_css_property("color") != \
        "rgba(0, 128, 0, 1)"
    # each view marks its own first NaN, opened in its box; the second says what it left out
    for view, recording in zip(views, (nan, cut)):
        [row] = view.find_elements("css selector", ".op.first")
        assert row.text.split()[:2] == [f"#{recording.first_nonfinite.ordinal}", recording.first_nonfinite.op]
    note = views[1].find_element("css selector", "header p.cut")
    assert note.is_displayed() and "rows are left out of this notebook view" in note.text
    assert views[1].find_elements("css selector", ".op.k-cut")
    # the filter of one view leaves the other alone
    box = views[0].find_element("css selector", ".toolbar input[type=search]")
    box.send_keys("c_fc")
    WebDriverWait(browser, 5).until(lambda d: "filtering" in views[0].get_attribute("class"))
    assert "filtering" not in views[1].get_attribute("class")
    assert views[1].find_element("css selector", ".mrow").is_displayed()
    # leading to a row scrolls the view's own box, not the notebook
    lead = views[1].find_element("xpath", ".//button[text()='first non-finite']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", lead)
    before = browser.execute_script("return window.scrollY")
    lead.click()
    WebDriverWait(browser, 5).until(lambda d: d.execute_script("return arguments[0].scrollTop > 0", views[1]))
    assert browser.execute_script("return window.scrollY") == before
    row = views[1].find_element("css selector", ".op.first")
    assert browser.execute_script(
        "const r = arguments[0].getBoundingClientRect(), v = arguments[1].getBoundingClientRect();"
        "return r.top >= v.top && r.bottom <= v.bottom;", row, views[1])

