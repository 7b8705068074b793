"""``OffloadingScheduler.zero_reallocated`` visits only the request states that
hold block ids (``_holding``; a waiting request holds none) and keeps, per
request and window group, the set of its not-yet-stored block ids across steps
(``_unstored_ids``) instead of building the slice every step. That set must always equal its definition,
``set(block_ids[g][_zero_range])`` (the null id aside: the step's allocated ids
never hold it), and the runs must be those of the definition itself."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from sim.engine.loop import EngineConfig
from sim.model.connector import OffloadingScheduler
from sim.model.costs import StepCostModel, TransferModel
from sim.model.gpu_cache import NULL_BLOCK_ID
from tests.engine.test_engine import _workload
from tests.engine.test_zero_capacity import EAGLE
from tests.engine.worlds import HYBRID, SPEC6, run

COST = StepCostModel(0.004, 2e-5, 1e-4, 1e-8)
LINK = TransferModel(5e8, 1e-4)


def _definition(st, g: int, rng: range) -> set[int]:
    return set(st.block_ids[g][rng.start : rng.stop])


@pytest.mark.parametrize("layout_name", ["hybrid", "spec6", "eagle"])
@pytest.mark.parametrize("logic", ["old", "new", "latest"])
@pytest.mark.parametrize("chunks", [0, 60])
def test_kept_set_equals_its_definition_and_the_run_is_unchanged(
        layout_name: str, logic: str, chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = {"hybrid": HYBRID, "spec6": SPEC6, "eagle": EAGLE}[layout_name]
    # a tight pool: window blocks freed by one request are soon handed to another
    cfg = EngineConfig(layout=layout, gpu_blocks=500, cpu_capacity_chunks=chunks, window_logic=logic,
                       max_num_batched_tokens=1024, step_cost=COST, h2d=LINK, d2h=LINK)
    reqs = _workload(seed=3, n=40, tph=layout.tokens_per_hash)
    kept = OffloadingScheduler._unstored_ids
    seen = {"calls": 0, "zeroed": 0}

    def checked(st, g: int, rng: range) -> set[int]:
        got = kept(st, g, rng)
        assert got - {NULL_BLOCK_ID} == _definition(st, g, rng) - {NULL_BLOCK_ID}
        seen["calls"] += 1
        return got

    zero = OffloadingScheduler.zero_reallocated

    def counting(self, allocated):
        # the states zero_reallocated visits: exactly the known ones holding block ids
        holding = {rid for rid, s in self._reqs.items() if any(s.block_ids)}
        assert holding <= set(self._holding) <= set(self._reqs)
        assert all(self._holding[rid] is self._reqs[rid] for rid in self._holding)
        before = sum(ids.count(NULL_BLOCK_ID) for s in self._reqs.values() for ids in s.block_ids)
        zero(self, allocated)
        seen["zeroed"] += sum(ids.count(NULL_BLOCK_ID) for s in self._reqs.values()
                              for ids in s.block_ids) - before

    monkeypatch.setattr(OffloadingScheduler, "_unstored_ids", staticmethod(checked))
    monkeypatch.setattr(OffloadingScheduler, "zero_reallocated", counting)
    fast, s_fast = run(cfg, reqs)
    assert seen["calls"] > 0 and seen["zeroed"] > 0      # the set was used and entries were zeroed
    monkeypatch.setattr(OffloadingScheduler, "_unstored_ids", staticmethod(_definition))
    slow, s_slow = run(replace(cfg), reqs)
    for table in ("requests", "steps", "transfers", "events", "occupancy"):
        pd.testing.assert_frame_equal(fast[table], slow[table], check_exact=True)
    assert s_fast == s_slow
