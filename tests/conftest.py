"""Fixtures shared by every test folder (builders live in tests/helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import TRACES

# Scenarios that name a trace (trace = "mooncake-conversation") look in $KVSIM_TRACES first:
# point it at the shared traces for every test (and the kvsim subprocesses they start) when
# the folder is there and nothing else was chosen. Tests of the lookup itself set it themselves.
if TRACES.is_dir():
    os.environ.setdefault("KVSIM_TRACES", str(TRACES))


@pytest.fixture
def traces_dir() -> Path:
    """The shared public traces; must exist in CI (fail, never skip, there)."""
    if not TRACES.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{TRACES} is missing in CI")
        pytest.skip(f"{TRACES} not present")
    return TRACES
