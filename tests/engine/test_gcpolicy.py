"""The collector's thresholds during a run, and the caller's afterwards."""

from __future__ import annotations

import gc

import pytest

from sim.engine.gcpolicy import RARE_THRESHOLDS, rare_collections
from sim.engine.loop import simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.io.scenario import load_run
from tests.helpers import ROOT


@pytest.fixture
def own_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(500, 7, 3)
    yield (500, 7, 3)
    gc.set_threshold(*before)


def test_thresholds_are_raised_inside_and_given_back_after(own_thresholds):
    with rare_collections():
        assert gc.get_threshold() == RARE_THRESHOLDS
        with rare_collections():    # nested: the outer block's thresholds come back
            assert gc.get_threshold() == RARE_THRESHOLDS
        assert gc.get_threshold() == RARE_THRESHOLDS
    assert gc.get_threshold() == own_thresholds


def test_thresholds_come_back_after_an_exception(own_thresholds):
    with pytest.raises(RuntimeError), rare_collections():
        raise RuntimeError("boom")
    assert gc.get_threshold() == own_thresholds


def test_a_run_uses_rare_collections_and_restores_the_callers(own_thresholds):
    run = load_run(ROOT / "scenarios" / "default.toml", ["workload.limit=20"])
    seen: list[tuple[int, int, int]] = []
    res = simulate(run.engine_config(), run.requests(), Recorder(MemorySink()),
                   progress=lambda done, now: seen.append(gc.get_threshold()))
    assert res.status == "ok"
    assert seen and set(seen) == {RARE_THRESHOLDS}
    assert gc.get_threshold() == own_thresholds
