"""Fixtures shared by every test folder (builders live in tests/helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import TRACES, VLLM_LOGIC_OF, vllm_venvs

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


@pytest.fixture(params=sorted(VLLM_LOGIC_OF))
def vllm_python(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """(version, python) of each real vLLM environment; must exist in CI (fail, never skip, there)."""
    version = request.param
    venv = vllm_venvs().get(version)
    if venv is None:
        if os.environ.get("CI"):
            pytest.fail(f"KVSIM_VLLM_VENVS names no vLLM {version} environment in CI (.ci/run installs it)")
        pytest.skip(f"no vLLM {version} environment (scripts/install-vllm-cpu.sh {version})")
    python = venv / "bin" / "python"
    assert python.is_file(), f"{python} missing"
    return version, python
