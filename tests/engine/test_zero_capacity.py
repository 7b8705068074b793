"""A 0-slot CPU cache (the 0 GiB point of every CPU-RAM sweep) takes a short
path in ``OffloadingScheduler.build_store_job`` (only whether a chunk is offered
matters: every offer is refused); it must give exactly the full path's run."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from sim.engine.loop import EngineConfig
from sim.model.costs import StepCostModel, TransferModel
from sim.model.cpu_cache import CpuChunkCache
from sim.model.layout import GroupKind, GroupSpec, Layout
from tests.engine.test_engine import _workload
from tests.engine.worlds import HYBRID, SPEC6, run

EAGLE = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000),
                   GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=64, extra_retained_tokens=16,
                             bytes_per_block=1000),
                   GroupSpec(GroupKind.FULL, 16, eagle=True, bytes_per_block=1000)],
                  tokens_per_hash=16, blocks_per_chunk=2)
COST = StepCostModel(0.004, 2e-5, 1e-4, 1e-8)
LINK = TransferModel(2e9, 1e-4)


@pytest.mark.parametrize("layout_name", ["hybrid", "spec6", "eagle"])
@pytest.mark.parametrize("logic", ["old", "new", "latest"])
def test_zero_slot_cache_short_path_equals_the_full_path(layout_name: str, logic: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    layout = {"hybrid": HYBRID, "spec6": SPEC6, "eagle": EAGLE}[layout_name]
    cfg = EngineConfig(layout=layout, gpu_blocks=3000, cpu_capacity_chunks=0, window_logic=logic,
                       step_cost=COST, h2d=LINK, d2h=LINK)
    reqs = _workload(seed=7, n=40, tph=layout.tokens_per_hash)
    fast, s_fast = run(cfg, reqs)
    assert s_fast["transfers"]["store_rejections"] > 0     # the short path was taken
    monkeypatch.setattr(CpuChunkCache, "never_stores", property(lambda self: False))
    slow, s_slow = run(replace(cfg), reqs)
    for table in ("requests", "steps", "transfers", "events", "occupancy"):
        pd.testing.assert_frame_equal(fast[table], slow[table], check_exact=True)
    assert s_fast == s_slow
