"""Every case of ``benchmarks/bench_engine.py`` loads and replays its first requests under
both block accountings with the same figures: a case that a scenario or model change
broke shows here, not at the next measurement."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from sim.engine.loop import simulate
from sim.engine.metrics import Recorder
from sim.io.scenario import load_run

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 30


def _bench_engine() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks" / "bench_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench_engine()


@pytest.mark.parametrize("case", sorted(BENCH.CASES))
def test_every_bench_engine_case_replays(case: str, request: pytest.FixtureRequest):
    if case != "default":   # the others replay a public trace
        request.getfixturevalue("traces_dir")
    spec = BENCH.CASES[case]
    figures = {}
    for accounting in BENCH.ACCOUNTINGS:
        run = load_run(spec["scenario"], [*spec["set"], f"workload.limit={LIMIT}",
                                          f'scheduler.block_accounting="{accounting}"'])
        res = simulate(run.engine_config(), run.requests(), Recorder(BENCH._Discard()))
        assert res.status == "ok", (case, accounting, res.status)
        assert res.summary.requests_finished == LIMIT
        figures[accounting] = res.summary.figures()
    assert figures["fast"] == figures["reference"]
