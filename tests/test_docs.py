"""Every code fence under docs/ tagged `# migration-test: tool=NAME expected=VALUE` runs here.

A fence is skipped when NAME cannot be imported; otherwise it runs in a fresh namespace and must
leave `RESULT == VALUE` behind.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```python\n(?P<code># migration-test: (?P<tags>[^\n]*)\n.*?)^```", re.M | re.S)
TAG = re.compile(r"^tool=(?P<tool>\S+)\s+expected=(?P<expected>.+?)\s*$")


def collect():
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in FENCE.finditer(text):
            tag = TAG.match(match.group("tags"))
            tags = tag.groupdict() if tag else {}
            line = text[: match.start()].count("\n") + 2
            yield pytest.param(page, line, tags, match.group("code"), id=f"{page.name}:{line}")


def tool_available(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # not installed, or installed but broken (torchsnooper on new setuptools)
        return False
    return True


def test_docs_have_tested_fences():
    pages = {param.values[0].name for param in collect()}
    assert {"coming-from-torchsnooper.md", "narration.md", "compiled.md", "crashes.md", "compare.md", "statistics.md"} <= pages


@pytest.mark.parametrize("page,line,tags,code", list(collect()))
def test_fence(page, line, tags, code, tmp_path, monkeypatch):
    assert "tool" in tags and "expected" in tags, f"{page.name}:{line}: tag needs tool= and expected="
    if not tool_available(tags["tool"]):
        pytest.skip(f"{tags['tool']} is not installed")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
    try:
        expected = ast.literal_eval(tags["expected"])
    except (ValueError, SyntaxError):
        expected = tags["expected"]
    assert "RESULT" in namespace, f"{page.name}:{line}: the fence must set RESULT"
    assert namespace["RESULT"] == expected
