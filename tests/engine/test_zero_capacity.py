"""A 0-slot CPU cache (the 0 GiB point of every CPU-RAM sweep) takes a short
path in ``OffloadingScheduler.build_store_job`` (only whether a chunk is offered
matters: every offer is refused; a full-attention group that offered keeps
offering until the next lookup, so it is not scanned again); it must give
exactly the full path's run."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from sim.engine.loop import EngineConfig
from sim.model.connector import OffloadingScheduler
from sim.model.costs import StepCostModel, TransferModel
from sim.model.cpu_cache import CpuChunkCache
from sim.model.layout import GroupKind, GroupSpec, Layout
from tests.engine.test_engine import _workload
from tests.engine.worlds import HYBRID, SPEC6, run
from tests.helpers import World, fa, make_req, swa

EAGLE = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000),
                   GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=64, extra_retained_tokens=16,
                             bytes_per_block=1000),
                   GroupSpec(GroupKind.FULL, 16, eagle=True, bytes_per_block=1000)],
                  tokens_per_hash=16, blocks_per_chunk=2)
COST = StepCostModel(0.004, 2e-5, 1e-4, 1e-8)
LINK = TransferModel(2e9, 1e-4)


@pytest.mark.parametrize("layout_name", ["hybrid", "spec6", "eagle"])
@pytest.mark.parametrize("logic", ["old", "new", "latest"])
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_zero_slot_cache_short_path_equals_the_full_path(layout_name: str, logic: str, pool: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    layout = {"hybrid": HYBRID, "spec6": SPEC6, "eagle": EAGLE}[layout_name]
    # tight: window blocks are soon re-allocated, so their unstored entries are zeroed
    # and a window group's offer can stop
    sizes = {"roomy": {"gpu_blocks": 3000}, "tight": {"gpu_blocks": 500, "max_num_batched_tokens": 1024}}
    cfg = EngineConfig(layout=layout, cpu_capacity_chunks=0, window_logic=logic,
                       step_cost=COST, h2d=LINK, d2h=LINK, **sizes[pool])
    reqs = _workload(seed=7, n=40, tph=layout.tokens_per_hash)
    scans = OffloadingScheduler._offering_group
    offers = [0]

    def counted(self, st, tokens):
        g = scans(self, st, tokens)
        offers[0] += g is not None
        return g

    monkeypatch.setattr(OffloadingScheduler, "_offering_group", counted)
    fast, s_fast = run(cfg, reqs)
    assert s_fast["transfers"]["store_rejections"] > 0     # the short path was taken
    # some refused offers came from a pinned full-attention group, without a scan
    # (not under OLD, whose storable count is not capped by keys: its window
    # scans, asked first, may raise)
    if logic == "old":
        assert offers[0] == s_fast["transfers"]["store_rejections"]
    else:
        assert offers[0] < s_fast["transfers"]["store_rejections"]
    monkeypatch.setattr(CpuChunkCache, "never_stores", property(lambda self: False))
    slow, s_slow = run(replace(cfg), reqs)
    for table in ("requests", "steps", "transfers", "events", "occupancy"):
        pd.testing.assert_frame_equal(fast[table], slow[table], check_exact=True)
    assert s_fast == s_slow


@pytest.mark.parametrize("logic", ["old", "new", "latest"])
def test_only_a_full_attention_offer_pins_and_a_lookup_drops_the_pin(logic: str) -> None:
    """A window group's offer can stop (its ids zeroed when re-allocated): it
    never pins; a full-attention group's does (not under OLD), until a lookup."""
    layout = Layout.of([fa(64), swa(16, 32)], tokens_per_hash=16, blocks_per_chunk=1)
    w = World(layout, logic, capacity=0)
    assert w.cpu.never_stores
    # 48 tokens: no whole 64-token full chunk, three 16-token window chunks
    short = make_req(layout, 48, "short")
    w.sched.on_new_request(short)
    alloc = w.gpu.allocate_new(short.req_id, ([], []), 0, 0, 48)
    assert alloc is not None
    w.sched.update_block_ids(short.req_id, alloc.new_block_ids)
    assert w.sched.build_store_job(short.req_id, 48) is None
    assert w.sched.store_rejections == 1                  # the window group offered ...
    assert w.sched._reqs[short.req_id].offer_pin is None  # ... and pinned nothing
    long = make_req(layout, 128, "long", base=100)
    w.sched.on_new_request(long)
    alloc = w.gpu.allocate_new(long.req_id, ([], []), 0, 0, 128)
    assert alloc is not None
    w.sched.update_block_ids(long.req_id, alloc.new_block_ids)
    assert w.sched.build_store_job(long.req_id, 128) is None
    assert w.sched.store_rejections == 2
    pinned = w.sched._reqs[long.req_id].offer_pin
    assert pinned == (None if logic == "old" else 128)
    assert w.sched.build_store_job(long.req_id, 128) is None
    assert w.sched.store_rejections == 3                  # pinned or scanned: offered again
    w.sched.get_num_new_matched_tokens(long, 0)
    assert w.sched._reqs[long.req_id].offer_pin is None
