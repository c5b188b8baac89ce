"""The package type-checks by the rules pyproject.toml sets for mypy (`[tool.mypy]`: its default
checks, inside unannotated functions too, against Python 3.10): a None reaching what cannot take
it, an attribute a class does not have, a call with the wrong arguments or an ignore that no longer
silences anything fails the suite, not a reviewer's eye."""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_package_passes_mypy():
    pytest.importorskip("mypy", reason="mypy is a test dependency: pip install -e '.[test]'")
    # mypy's cache outside the checkout, one per checkout: reading torch's stubs cold takes half a
    # minute, a run with the cache a second or two
    cache = pathlib.Path(tempfile.gettempdir()) / f"torchlens-mypy-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}"
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--cache-dir", str(cache),
                           "torchlens"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
