"""The code is lint-clean by the rules pyproject.toml sets for ruff (pyflakes, pycodestyle,
bugbear, sorted imports): a forgotten import, an unused variable, a closure bound to a loop's last
value or an import out of order fails the suite, not a reviewer's eye."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_package_benchmarks_examples_and_tests_pass_ruff():
    pytest.importorskip("ruff", reason="ruff is a test dependency: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "torchlens", "benchmarks", "examples",
                           "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
