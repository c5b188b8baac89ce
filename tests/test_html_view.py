"""The HTML view (`to_html`): a self-contained page whose module tree folds, whose first non-finite
op, failed call and first divergence are highlighted where a user looks, checked in the file and
in a real browser (headless Chromium driven by selenium)."""

from __future__ import annotations

import copy
import html.parser
import io
import json
import os
import re
import shutil

import pytest
import torch
from models import conv_net, images, tiny_gpt, tokens
from torch import nn

import torchlens as tl

HIGHLIGHT = 2  # a row's flag: the first non-finite row (torchlens/view/tree.py)
NONFINITE = 1  # a row's flag: its statistics hold NaN or an infinity


class _Scripts(html.parser.HTMLParser):
    """The page's script elements as a browser splits them: (attributes, text)."""

    def __init__(self):
        super().__init__()
        self.scripts, self._open = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._open = (dict(attrs), [])

    def handle_data(self, data):
        if self._open is not None:
            self._open[1].append(data)

    def handle_endtag(self, tag):
        if tag == "script" and self._open is not None:
            self.scripts.append((self._open[0], "".join(self._open[1])))
            self._open = None


def scripts(page: str):
    parser = _Scripts()
    parser.feed(page)
    return parser.scripts


def page_of(result, tmp_path) -> str:
    """The page `result.to_html` writes, as text."""
    with open(result.to_html(tmp_path / "page.html"), encoding="utf-8") as page:
        return page.read()


def page_data(page: str) -> dict:
    data = [text for attrs, text in scripts(page) if attrs.get("type") == "application/json"]
    assert len(data) == 1
    return json.loads(data[0])


def rows(call: dict):
    for child in call["k"]:
        if "k" in child:
            yield from rows(child)
        else:
            yield child


def at(tree: dict, path):
    """The row at `path` (child indices from the root), and the module paths on the way."""
    node, modules = tree, []
    for index in path:
        modules.append(node["p"])
        node = node["k"][index]
    return node, modules


def nan_gpt():
    model = tiny_gpt()
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[0, 0] = float("nan")
    return model


class Mismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3))

    def forward(self, x):
        return x @ self.w  # [2,8] @ [5,3]: the shapes do not fit


def failed_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), Mismatch()))
    with pytest.raises(RuntimeError) as caught:
        tl.record(model, torch.randn(2, 4), value_stats="exact")
    return caught.value.partial_trace


def diverging_report():
    model = tiny_gpt()
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.blocks[1].mlp.fc.weight[0, 0] += 1.0
    return tl.debug.compare(tl.trace(model, tokens()), tl.trace(perturbed, tokens()))


# -- the file ------------------------------------------------------------------------------------


def test_the_page_is_one_self_contained_file(tmp_path):
    recording = tl.record(tiny_gpt(), tokens(), value_stats="exact")
    for page in (page_of(recording, tmp_path), page_of(diverging_report(), tmp_path)):
        assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
        assert not re.search(r"<(link|img|iframe|object|embed)\b|@import|url\(", page, re.I)
        assert "http://" not in page and "https://" not in page
        found = scripts(page)
        assert len(found) == 2 and not any("src" in attrs for attrs, _ in found)
        assert "function" in found[1][1]  # the code itself is inline


def test_the_embedded_data_holds_every_op_as_narration_shows_it(tmp_path):
    recording = tl.record(tiny_gpt(), tokens(), value_stats="exact")
    data = page_data(page_of(recording, tmp_path))
    forward = data["sections"][0]
    shown = {row["i"]: row for row in rows(forward["tree"]) if row.get("t") in (None, "in")}
    assert sorted(shown) == [event.ordinal for event in recording.ops]
    for event in recording.ops:
        row = shown[event.ordinal]
        assert row["o"] == event.op
        assert row["m"] == ", ".join(tl.narration.grammar.meta_text(meta) for meta in event.outputs)
        assert row["v"] == str(event.stats)
    assert [row["l"] for row in rows(forward["tree"]) if row.get("t") == "out"] == ["out"]
    assert forward["tree"]["n"] == len(recording.ops)
    assert forward["footer"] == [recording.narrate().lines[-1]]


HOSTILE = "</script><script>document['title']='pwned'</script><!--"  # (a module name cannot hold a dot)


def hostile_recording():
    model = nn.Sequential()
    model.add_module(HOSTILE, nn.Linear(2, 2))
    return tl.record(model, torch.randn(1, 2))


def test_a_script_end_tag_in_a_name_cannot_break_out(tmp_path):
    page = page_of(hostile_recording(), tmp_path)
    assert page.lower().count("</script") == 2
    data = page_data(page)
    assert data["sections"][0]["tree"]["k"][1]["p"] == HOSTILE


def test_the_first_nonfinite_row_is_marked_with_its_finding(tmp_path):
    recording = tl.record(nan_gpt(), tokens(), value_stats="exact", on_nonfinite="track")
    forward = page_data(page_of(recording, tmp_path))["sections"][0]
    first = recording.first_nonfinite
    row, modules = at(forward["tree"], forward["first"])
    assert row["i"] == first.ordinal and row["f"] & HIGHLIGHT
    assert row["w"] == ["!! " + first.finding.text]
    assert modules[-1] == "blocks.1.attn.qkv"
    assert [line["text"] for line in forward["lines"] if line.get("at") == forward["first"]] == \
        ["!! " + recording.findings[0].text]
    assert sum(1 for row in rows(forward["tree"]) if row.get("f", 0) & HIGHLIGHT) == 1


def test_a_run_that_measured_nothing_says_so_rather_than_no_nan(tmp_path):
    recording = tl.record(nan_gpt(), tokens())
    lines = [line["text"] for line in page_data(page_of(recording, tmp_path))["sections"][0]["lines"]]
    assert any(line.startswith("values not measured") for line in lines)
    assert not any("no non-finite" in line for line in lines)
    sampled = tl.record(nan_gpt(), tokens(), value_stats="sampled")
    lines = [line["text"] for line in page_data(page_of(sampled, tmp_path))["sections"][0]["lines"]]
    assert any(line.startswith("finiteness not measured") for line in lines)


def test_a_tracked_run_with_unmeasured_ops_never_says_no_nan_plainly(tmp_path):
    class WithMeta(nn.Module):
        def forward(self, x):
            return x + 1, torch.ones(3, device="meta") * 2  # a meta tensor has no values to measure

    recording = tl.record(WithMeta(), torch.ones(3), on_nonfinite="track")
    lines = [line["text"] for line in page_data(page_of(recording, tmp_path))["sections"][0]["lines"]]
    assert "no non-finite values among those measured; 2 rows not measured (meta: 2)" in lines
    assert "no non-finite values" not in lines


def section_lines(result, tmp_path, index=0):
    return [line["text"] for line in page_data(page_of(result, tmp_path))["sections"][index]["lines"]]


def test_a_run_that_failed_before_its_output_never_calls_an_infinity_harmless(tmp_path):
    class BornThenFails(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 3))

        def forward(self, x):
            return (x * 100).exp() @ self.w  # +inf born at exp, then a shape error

    with pytest.raises(RuntimeError) as info:
        tl.record(BornThenFails(), torch.ones(2, 8), on_nonfinite="track", value_stats="exact")
    lines = section_lines(info.value.partial_trace, tmp_path)
    assert any("no finding before the failure" in line for line in lines)
    assert not any("harmless" in line for line in lines)


def test_sampled_statistics_alone_lead_to_no_first_nonfinite_row(tmp_path):
    class LogOfZeros(nn.Module):
        def forward(self, x):
            return (x * 2).sum() + torch.log(torch.zeros(3)).sum()

    x = torch.randn(100000)
    x[12345] = float("nan")  # in a tensor too large to read whole: a sample misses it
    data = page_data(page_of(tl.record(LogOfZeros(), x, value_stats="sampled"), tmp_path))
    assert data["sections"][0]["first"] is None
    assert not any(row.get("f", 0) & HIGHLIGHT for row in rows(data["sections"][0]["tree"]))


def test_a_nonfinite_loss_gradient_is_named_as_received_not_as_a_node(tmp_path):
    model = nn.Linear(3, 2)
    recording = tl.record(model, torch.ones(1, 3), value_stats="exact", backward=True)
    recording.output.backward(torch.full((1, 2), float("nan")))
    lines = section_lines(recording, tmp_path, 1)
    assert "first non-finite node: the gradient received at the output out" in lines


def test_rows_marked_by_tracking_alone_say_why_and_sites_follow_normalize(tmp_path):
    model = tiny_gpt()
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[0, 0] = float("nan")
    options = tl.options.NarrationOptions(sink=io.StringIO(), sites=True, normalize=True, prefix="[eval] ")
    recording = tl.record(model, tokens(), narrate=options, on_nonfinite="track")
    data = page_data(page_of(recording, tmp_path))
    marked = [row for row in rows(data["sections"][0]["tree"]) if row.get("f", 0) & NONFINITE]
    assert marked and all(re.match(r"(nan|[+-]inf)=\d", row["v"]) for row in marked)
    assert all("/" not in row["s"] for row in rows(data["sections"][0]["tree"]) if "s" in row)
    assert data["sections"][0]["footer"][0].startswith("-- end: ")  # found whatever the prefix


def test_to_html_survives_an_undecodable_file_name_and_a_failed_write_keeps_the_old_page(tmp_path, monkeypatch):
    class Missing(nn.Module):
        def forward(self, x):
            raise FileNotFoundError("cannot load " + os.fsdecode(b"/data/\xff.bin"))

    with pytest.raises(FileNotFoundError) as info:
        tl.record(Missing(), torch.ones(2))
    path = info.value.partial_trace.to_html(tmp_path / "page.html")
    assert "cannot load" in open(path, encoding="utf-8").read()
    from torchlens import view

    monkeypatch.setattr(view, "recording_page", lambda recording: "\ud800" + 1)  # fails while building
    with pytest.raises(TypeError):
        info.value.partial_trace.to_html(path)
    assert "cannot load" in open(path, encoding="utf-8").read() and os.listdir(tmp_path) == ["page.html"]


def test_a_comparison_carries_whole_numbers_depths_and_its_own_title(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))
    other = copy.deepcopy(model)
    with torch.no_grad():
        other[1][1].bias[0] += 0.40347
    report = tl.debug.compare(tl.trace(model, torch.ones(1, 4)), tl.trace(other, torch.ones(1, 4)))
    data = page_data(page_of(report, tmp_path))
    [table] = data["tables"]
    first = table["rows"][table["first"]]
    assert first["d"] == report.first_divergence.max_abs  # rounded once, by the page, as the text is
    assert first["dp"] == 2 and first["p"] == "1.1"  # `1` is called (a Sequential): depth 2, as narrated
    model.train()
    a = tl.trace(model, torch.ones(1, 4), backward=True)
    a.output.sum().backward()
    b = tl.trace(other.train(), torch.ones(1, 4), backward=True)
    b.output.sum().backward()
    gradients = tl.debug.compare(a, b).gradients
    assert page_data(page_of(gradients, tmp_path))["tables"][0]["title"] == "backward nodes (gradients)"


def test_a_failed_run_places_the_attempted_call_in_its_module(tmp_path):
    partial = failed_run()
    forward = page_data(page_of(partial, tmp_path))["sections"][0]
    row, modules = at(forward["tree"], forward["failure"]["at"])
    assert row["t"] == "try" and row["o"] == "matmul" and row["i"] == partial.attempt.ordinal
    assert modules == ["", "1", "1.1"]
    assert forward["failure"]["tail"] == str(partial.narrate(last=20))
    assert partial.error in forward["failure"]["error"]


def test_each_backward_is_a_section_with_its_first_nonfinite_gradient(tmp_path):
    recording = tl.record(nan_gpt(), tokens(), value_stats="exact", on_nonfinite="track", backward=True)
    recording.output.sum().backward()
    sections = page_data(page_of(recording, tmp_path))["sections"]
    run = recording.backward[0]
    assert [section["title"] for section in sections] == ["forward", run.header]
    row, _ = at(sections[1]["tree"], sections[1]["first"])
    assert row["t"] == "node" and row["i"] == run.first_nonfinite.ordinal
    assert row["b"] == run.first_nonfinite.forward
    assert sections[1]["tree"]["n"] == len(run.events)


def test_the_report_page_carries_every_row_and_the_first_divergence(tmp_path):
    report = diverging_report()
    data = page_data(page_of(report, tmp_path))
    table = data["tables"][0]
    assert len(table["rows"]) == len(report.rows) and table["summary"] == report.summary()
    first = table["rows"][table["first"]]
    assert (first["b"], first["o"], first["p"], first["v"]) == (
        report.first_divergence.ordinal_b, report.first_divergence.op, report.first_divergence.module, "diverged")


# -- in a browser --------------------------------------------------------------------------------

NO_BROWSER = ("no Chromium/ChromeDriver: install Debian's chromium and chromium-driver (or set "
              "TORCHLENS_CHROMIUM and TORCHLENS_CHROMEDRIVER) to run the HTML view in a real browser")


def _executable(variable: str, name: str):
    path = os.environ.get(variable) or shutil.which(name) or f"/usr/bin/{name}"
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module's tests (starting one takes a second or two)."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install selenium (it is in the test extra)")
    chromium, chromedriver = _executable("TORCHLENS_CHROMIUM", "chromium"), _executable(
        "TORCHLENS_CHROMEDRIVER", "chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip(NO_BROWSER)
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1200,800"):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.binary_location = chromium
    try:
        driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    except WebDriverException as exc:
        pytest.skip(f"Chromium is installed but did not start here: {exc.msg}")
    yield driver
    driver.quit()


def open_page(browser, path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(path.as_uri())
    WebDriverWait(browser, 10).until(
        lambda d: d.execute_script("return !!(window.torchlensView && window.torchlensView.timings.firstRender)"))
    return browser


def module_row(browser, path: str):
    return browser.find_element("xpath", f"//div[@class='mrow'][span[@class='path' and .='{path}']]")


def click(browser, element):
    """Click as a user does: on the element in the middle of the window, not under the sticky toolbar."""
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    element.click()


def op_xpath(tag: str) -> str:
    return f"//div[contains(@class, 'op ')][div/span[@class='tag' and text()='{tag}']]"


def visible(browser, xpath: str) -> bool:
    """Whether an element the xpath names is displayed (elements not built yet are not)."""
    return any(element.is_displayed() for element in browser.find_elements("xpath", xpath))


def in_viewport(browser, element) -> bool:
    return browser.execute_script(
        "const box = arguments[0].getBoundingClientRect(); return box.top >= 0 && box.bottom <= window.innerHeight;",
        element)


def wait_until(browser, condition):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 5).until(lambda d: condition())


def type_filter(browser, text: str):
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element("css selector", ".toolbar input[type=search]")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.BACKSPACE)
    if text:
        box.send_keys(text)


def test_the_tree_opens_with_the_root_open_and_folds_on_click(browser, tmp_path):
    recording = tl.record(tiny_gpt(), tokens())  # nothing non-finite measured: nothing opened on load
    open_page(browser, _written(recording, tmp_path / "run.html"))
    assert module_row(browser, "(root)").is_displayed()
    assert module_row(browser, "blocks.0").is_displayed() and visible(browser, op_xpath("#1"))
    deep = op_xpath("#7")  # linear in blocks.0.attn.qkv
    assert not visible(browser, deep)
    click(browser, module_row(browser, "blocks.0"))
    assert module_row(browser, "blocks.0.ln1").is_displayed() and not visible(browser, deep)
    click(browser, module_row(browser, "blocks.0.attn"))
    click(browser, module_row(browser, "blocks.0.attn.qkv"))
    assert visible(browser, deep)
    click(browser, module_row(browser, "blocks.0"))  # fold it again: everything inside disappears
    assert not visible(browser, deep) and not module_row(browser, "blocks.0.ln1").is_displayed()
    click(browser, browser.find_element("xpath", "//button[text()='expand all']"))
    assert visible(browser, op_xpath("#61")) and visible(browser, deep)
    click(browser, browser.find_element("xpath", "//button[text()='collapse all']"))
    assert not visible(browser, deep) and module_row(browser, "blocks.1").is_displayed()


def test_a_hostile_module_name_is_shown_as_text(browser, tmp_path):
    open_page(browser, _written(hostile_recording(), tmp_path / "hostile.html"))
    assert browser.title == "torchlens: Recording"
    names = [row.text.split("\n")[0] for row in browser.find_elements("css selector", ".mrow .path")]
    assert names == ["(root)", HOSTILE]


def test_the_first_nonfinite_op_is_highlighted_and_in_view_on_load(browser, tmp_path):
    recording = tl.record(nan_gpt(), tokens(), value_stats="exact", on_nonfinite="track")
    open_page(browser, _written(recording, tmp_path / "nan.html"))
    highlighted = browser.find_elements("css selector", ".op.first")
    assert len(highlighted) == 1
    row = highlighted[0]
    first = recording.first_nonfinite
    assert row.text.split()[:2] == [f"#{first.ordinal}", first.op]
    assert row.is_displayed() and in_viewport(browser, row)
    assert first.finding.text in row.text
    header = browser.find_element("css selector", "section.run ul.lines").text
    assert "held NaN or infinity" in header and recording.findings[0].text in header
    assert visible(browser, op_xpath(f"#{first.ordinal + 1}") + "[contains(@class, 'nf')]")


def test_the_filter_shows_matches_with_their_modules_and_clearing_restores_the_tree(browser, tmp_path):
    recording = tl.record(tiny_gpt(), tokens())
    open_page(browser, _written(recording, tmp_path / "run.html"))
    inside = op_xpath("#43")  # matmul in blocks.1.attn
    assert not visible(browser, inside)
    type_filter(browser, "blocks.1.ATTN")
    wait_until(browser, lambda: visible(browser, inside))
    assert visible(browser, op_xpath("#34")) and module_row(browser, "blocks.1").is_displayed()
    assert not visible(browser, op_xpath("#1")) and not visible(browser, op_xpath("#7"))
    assert not module_row(browser, "blocks.0").is_displayed()
    type_filter(browser, "")
    wait_until(browser, lambda: visible(browser, op_xpath("#1")))
    assert not visible(browser, inside) and module_row(browser, "blocks.0").is_displayed()


def test_the_filter_counts_rows_as_the_total_does(browser, tmp_path):
    class ReturnsItsInput(nn.Module):
        def forward(self, x):
            return torch.relu(x), x

    open_page(browser, _written(tl.record(ReturnsItsInput(), torch.ones(2)), tmp_path / "run.html"))
    type_filter(browser, "put")  # the input row, and the two output rows, which no total counts
    count = browser.find_element("css selector", ".toolbar .count")
    wait_until(browser, lambda: count.text != "")
    assert count.text == "1 of 2 rows match"


def test_a_failed_run_shows_the_attempted_call_in_its_open_module(browser, tmp_path):
    partial = failed_run()
    open_page(browser, _written(partial, tmp_path / "failed.html"))
    attempted = browser.find_element("css selector", ".op.attempt")
    assert attempted.is_displayed() and in_viewport(browser, attempted)
    assert attempted.text.split()[:2] == [f"#{partial.attempt.ordinal}", "matmul"]
    assert "attempted: failed" in attempted.text
    holder = attempted.find_element("xpath", "ancestor::div[contains(@class, 'mod')][1]/div[@class='mrow']")
    assert holder.text.split()[:2] == ["1.1", "Mismatch"]
    tail = browser.find_element("css selector", ".failure pre").text
    assert partial.error in tail and "!! attempted #" in tail


def test_a_backward_links_each_node_to_its_forward_op(browser, tmp_path):
    recording = tl.record(nan_gpt(), tokens(), value_stats="exact", on_nonfinite="track", backward=True)
    recording.output.sum().backward()
    open_page(browser, _written(recording, tmp_path / "backward.html"))
    first = recording.backward[0].first_nonfinite
    highlighted = browser.find_elements("css selector", "section.run:nth-of-type(2) .op.first")
    assert len(highlighted) == 1 and highlighted[0].text.split()[:2] == [f"~{first.ordinal}", first.op]
    forward_op = re.match(r"#(\d+)", first.forward).group(1)
    assert not visible(browser, op_xpath(f"#{forward_op}"))
    click(browser, highlighted[0].find_element("css selector", ".fwd"))
    assert visible(browser, op_xpath(f"#{forward_op}"))


def test_the_comparison_highlights_the_first_divergence(browser, tmp_path):
    report = diverging_report()
    open_page(browser, _written(report, tmp_path / "compare.html"))
    first = report.first_divergence
    row = browser.find_element("css selector", ".crow.first")
    assert row.text.split()[:4] == [f"#{first.ordinal_a}", f"#{first.ordinal_b}", first.op, first.module]
    assert row.is_displayed() and in_viewport(browser, row)
    assert "bad" in row.get_attribute("class")
    diverged = browser.find_elements("css selector", ".crow.bad")
    assert len(diverged) == report.counts["diverged"]
    type_filter(browser, "mlp.fc")
    data_rows = browser.find_elements("css selector", ".crow:not(.head)")
    wait_until(browser, lambda: not data_rows[0].is_displayed())
    shown = [row.text.split()[2] for row in data_rows if row.is_displayed()]
    assert shown == ["linear", "linear"]


def test_a_transformers_gpt2_page_renders_and_folds(browser, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    recording = tl.record(model, torch.randint(0, 50, (1, 8)), value_stats="exact", on_nonfinite="track")
    open_page(browser, _written(recording, tmp_path / "gpt2.html"))
    assert module_row(browser, "(root)").text.split()[1] == "GPT2LMHeadModel"
    assert "open" not in module_row(browser, "transformer").find_element("xpath", "..").get_attribute("class").split()
    click(browser, module_row(browser, "transformer"))
    assert module_row(browser, "transformer.h.0").is_displayed()
    click(browser, module_row(browser, "transformer.h.0"))
    assert module_row(browser, "transformer.h.0.attn").is_displayed()
    click(browser, module_row(browser, "transformer"))
    assert not module_row(browser, "transformer.h.0").is_displayed()
    assert "no non-finite values" in browser.find_element("css selector", "section.run ul.lines").text


def _written(result, path):
    result.to_html(path)
    return path


def test_a_conv_net_nan_is_highlighted_in_its_residual_block(browser, tmp_path):
    model = conv_net()
    with torch.no_grad():
        model.block.conv2.weight[0, 0, 1, 1] = float("nan")
    recording = tl.record(model, images(), on_nonfinite="track", value_stats="reuse")
    first = recording.first_nonfinite
    assert first.module == "block.conv2"
    open_page(browser, _written(recording, tmp_path / "conv.html"))
    [row] = browser.find_elements("css selector", ".op.first")
    assert row.text.split()[:2] == [f"#{first.ordinal}", "conv2d"] and row.is_displayed()
    assert module_row(browser, "block.conv2").is_displayed()  # its modules opened on load
    assert not visible(browser, op_xpath("#2"))  # the stem, which held no NaN, stays folded


def test_a_comparison_judged_against_float64_leads_with_the_first_real_divergence(browser, tmp_path):
    from test_compare_reference import _pair

    model, flipped, x = _pair(flip=True)
    ref = tl.debug.reference(model, x)
    report = tl.debug.compare(tl.trace(model, x), tl.trace(flipped, x), reference=ref)
    open_page(browser, _written(report, tmp_path / "compare.html"))
    real = report.first_real
    row = browser.find_element("css selector", ".crow.first-real")
    assert row.text.split()[:4] == [f"#{real.ordinal_a}", f"#{real.ordinal_b}", real.op, real.module]
    assert row.is_displayed() and in_viewport(browser, row)
    assert "real: a " in row.text and "a nearer float64" in row.text
    headline = browser.find_element("xpath", "//button[starts-with(., 'first real divergence: ')]")
    assert headline.text == report.verdict()
    assert len(browser.find_elements("css selector", ".crow.real")) == report.counts["real"]


@pytest.mark.parametrize("how", [dict(on_nonfinite="track"), dict(value_stats="exact")])
def test_the_output_row_holding_a_nan_is_marked_like_every_other_row_that_holds_one(tmp_path, how):
    """A NaN that reaches GPT-2's logits: the `=> output` row was the one row left unmarked."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2,
                                                                 n_positions=16)).eval()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    recording = tl.record(model, torch.tensor([[1, 2, 3]]), **how)
    tree = page_data(page_of(recording, tmp_path))["sections"][0]["tree"]
    outputs = [row for row in rows(tree) if row.get("t") == "out"]
    logits = next(row for row in outputs if row["l"] == "out['logits']")
    assert logits.get("f", 0) & NONFINITE and "nan=" in logits["v"]
    clean = transformers.GPT2LMHeadModel(model.config).eval()
    tree = page_data(page_of(tl.record(clean, torch.tensor([[1, 2, 3]]), **how), tmp_path))["sections"][0]["tree"]
    assert not any(row.get("f", 0) & NONFINITE for row in rows(tree))
