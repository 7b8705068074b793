"""Whole runs with the fast GPU block accounting and with the per-block reference
(``scheduler.block_accounting``) write identical tables and summaries.

The call-by-call differential test of the two implementations is
``tests/model/test_gpu_fast.py``; this one checks that nothing the engine and
the connector do with the cache tells them apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.cli import main
from tests.helpers import ROOT

TABLES = ("requests.parquet", "steps.parquet", "transfers.parquet", "occupancy.parquet", "events.parquet")


def _run(scenario: Path, out: Path, accounting: str, *sets: str) -> Path:
    argv = ["run", str(scenario), "--out", str(out), "-q",
            "--set", f'scheduler.block_accounting="{accounting}"']
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    return out


def _same(a: Path, b: Path) -> None:
    for name in TABLES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa == sb
    assert sorted(p.name for p in (a / "reproducers").glob("*")) == \
        sorted(p.name for p in (b / "reproducers").glob("*"))


@pytest.mark.slow
def test_default_study_is_identical_with_both_accountings(tmp_path: Path) -> None:
    scenario = ROOT / "scenarios" / "default.toml"
    _same(_run(scenario, tmp_path / "fast", "fast"), _run(scenario, tmp_path / "ref", "reference"))


@pytest.mark.parametrize("logic", ["old", "new"])
def test_a_small_pool_with_preemption_and_rejection_is_identical(tmp_path: Path, logic: str) -> None:
    """A pool small enough to preempt, evict and reject, under both logics."""
    scenario = ROOT / "scenarios" / "default.toml"
    sets = ("hardware.gpu_blocks=2500", "workload.limit=120", f'window_logic="{logic}"')
    fast = _run(scenario, tmp_path / "fast", "fast", *sets)
    ref = _run(scenario, tmp_path / "ref", "reference", *sets)
    _same(fast, ref)
    summary = json.loads((fast / "summary.json").read_text())
    assert summary["engine"]["preemptions"] > 0, "the case must exercise preemption"
    assert summary["requests"]["rejected"] > 0, "and rejection"


@pytest.mark.slow
def test_mooncake_on_deepseek_v4_with_mtp_is_identical(tmp_path: Path, traces_dir: Path) -> None:
    """The first 1,000 Mooncake requests on the DeepSeek-V4-style layout with
    multi-module MTP (both logics crash there: crashes, reproducers, reloads)."""
    scenario = ROOT / "scenarios" / "compare" / "mooncake-deepseek-v4-mtp.toml"
    sets = ("workload.limit=1000", f'workload.path="{traces_dir / "conversation_trace.jsonl"}"')
    fast = _run(scenario, tmp_path / "fast", "fast", *sets)
    _same(fast, _run(scenario, tmp_path / "ref", "reference", *sets))
