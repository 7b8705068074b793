"""The torch data path inside runs: fingerprints written by steps, copies by jobs,
verification of what requests read; OLD with assertions stripped."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from sim.engine.loop import CopyPathConfig, Engine, EngineConfig
from sim.engine.metrics import MemorySink, Recorder
from sim.io.workload import MultiTurnParams, Request, iter_multiturn
from sim.model.costs import StepCostModel, TransferModel
from tests.engine.worlds import HYBRID, SPEC6, req

CP = CopyPathConfig(mode="fingerprint", device="cpu")


def _world(logic: str, assertions: bool, left: str) -> tuple[dict[str, pd.DataFrame], object]:
    """Spec §6.1 in a run with real copies: request b (4353 tokens) arrives at
    t = 1 while the CPU holds fa[0..3], swa[15], short[118..121] with correct
    content, and the left key swa[14] is ``left`` ("missing" or "pending": its
    store lands only at t = 2)."""
    b = req("b", 1.0, 4353, 3, prefix=5, tph=8)
    cfg = EngineConfig(layout=SPEC6, gpu_blocks=4000, cpu_capacity_chunks=100, window_logic=logic,  # type: ignore[arg-type]
                       assertions=assertions, copy_path=CP, step_cost=StepCostModel(0.01, 1e-5),
                       h2d=TransferModel(1e9, 1e-4), d2h=TransferModel(1e9, 1e-4))
    sink = MemorySink()
    eng = Engine(cfg, [b], Recorder(sink))
    cpu, copy = eng.cpu, eng.copy
    assert cpu is not None and copy is not None
    hashes = b.block_hashes
    keys = [SPEC6.offload_keys(g, hashes[: 4353 // 8]) for g in range(3)]
    chunks = [(0, j) for j in range(4)] + [(1, 15)] + [(2, j) for j in range(118, 122)]
    if left == "pending":
        chunks.append((1, 14))
    plan = cpu.prepare_store([keys[g][j] for g, j in chunks])
    assert plan is not None
    # the content those chunks should hold: computed into spare GPU blocks, then stored
    bpc = SPEC6.blocks_per_chunk
    spare = iter(range(3999, 3000, -1))
    group_blocks = [[0] * (4353 // g.tokens_per_block + 1) for g in SPEC6.groups]
    for g, j in chunks:
        for i in range(j * bpc, j * bpc + bpc):
            group_blocks[g][i] = next(spare)
    copy.compute(group_blocks, hashes, 12345, 0, 4352)
    ready = [k for k, (g, j) in zip(plan.keys, chunks, strict=True) if (g, j) != (1, 14)]
    for _key, slot, (g, j) in zip(plan.keys, plan.slots, chunks, strict=True):
        if (g, j) == (1, 14):
            continue
        sizes = [0, 0, 0]
        sizes[g] = bpc
        idx = [0, 0, 0]
        idx[g] = j * bpc
        copy.store(sizes, idx, group_blocks[g][j * bpc: j * bpc + bpc], [slot])
    cpu.complete_store(ready)

    def late_store() -> object:
        yield eng.env.timeout(2.0)
        g, j = 1, 14
        slot = plan.slots[chunks.index((g, j))]
        copy.store([0, bpc, 0], [0, j * bpc, 0], group_blocks[g][j * bpc: j * bpc + bpc], [slot])
        cpu.complete_store([keys[g][j]])
        eng.kick()     # as a link completion would

    if left == "pending":
        eng.env.process(late_store())
    res = eng.run()
    return sink.frames(), res


def test_new_logic_reads_only_verified_chunks() -> None:
    for left in ("missing", "pending"):
        f, res = _world("new", True, left)
        assert res.status == "ok" and f["events"].empty, left
        assert res.summary.integrity_violations == 0


def test_old_with_assertions_reads_nothing_bad_because_it_crashes() -> None:
    f, res = _world("old", True, "pending")
    ev = f["events"]
    assert list(zip(ev.kind, ev.detail, ev.group, ev.chunk, strict=True)) == [
        ("crash", "chunk_not_ready", 1, 14)]
    assert res.summary.integrity_violations == 0


def test_old_without_assertions_reads_the_unwritten_chunk() -> None:
    """python -O: the not-ready chunk is loaded before its store lands; the
    copy path finds the stale rows in the block of swa[14] the request reads."""
    f, res = _world("old", False, "pending")
    ev = f["events"]
    assert res.summary.crashes == 0
    hazard = ev[ev.kind == "hazard"]
    assert list(zip(hazard.detail, hazard.group, hazard.chunk, strict=True)) == [("unsafe_read", 1, 14)]
    bad = ev[ev.kind == "integrity"]
    assert len(bad) >= 1
    assert set(zip(bad.req_id, bad.group, bad.chunk, strict=False)) == {("b", 1, 14)}
    assert "token 3776" in bad.iloc[0].message           # spec §6.2: tokens 3776..3839 of swa[14]
    assert "found 0x0000000000000000" in bad.iloc[0].message
    assert res.summary.integrity_violations == len(bad)


def test_old_without_assertions_still_dies_on_a_missing_chunk() -> None:
    f, res = _world("old", False, "missing")
    ev = f["events"]
    assert list(zip(ev.kind, ev.detail, ev.group, ev.chunk, strict=True)) == [
        ("crash", "missing_chunk", 1, 14)]
    assert "AttributeError" in ev.iloc[0].message
    assert res.summary.integrity_violations == 0


def _workload() -> list[Request]:
    p = MultiTurnParams(sessions=30, session_rate_per_s=3.0, turns_mean=4.0, system_prompt_tokens=512,
                        first_user_tokens_mean=1500.0, followup_user_tokens_mean=200.0,
                        output_tokens_mean=60.0, max_context_tokens=6000, think_time_mean_s=2.0)
    return list(iter_multiturn(p, 4, 16, limit=80))


# chunk-by-chunk admission (no full-input reservation) preempts more: the data path is
# checked under many preemptions and reloads
BUSY = EngineConfig(layout=HYBRID, gpu_blocks=500, cpu_capacity_chunks=600, max_num_batched_tokens=1024,
                    max_num_seqs=8, copy_path=CP, reserve_full_isl=False,
                    step_cost=StepCostModel(0.004, 2e-5, 1e-4, 1e-8),
                    h2d=TransferModel(5e8, 1e-4), d2h=TransferModel(5e8, 1e-4))


def _run(cfg: EngineConfig) -> tuple[dict[str, pd.DataFrame], object]:
    sink = MemorySink()
    res = Engine(cfg, _workload(), Recorder(sink)).run()
    return sink.frames(), res


def test_busy_run_under_new_logic_reads_exactly_what_was_computed() -> None:
    f, res = _run(BUSY)
    s = res.summary
    assert res.status == "ok" and s.integrity_violations == 0
    # not vacuous: loads, GPU prefix hits and preemptions all happened
    assert s.load_jobs > 20 and s.gpu_hit_tokens > 0 and s.preemptions > 5
    assert f["events"].empty


def test_fast_forward_identical_with_the_copy_path() -> None:
    a, _ra = _run(BUSY)
    b, _rb = _run(replace(BUSY, fast_forward=False))
    for t in ("requests", "transfers", "events", "occupancy"):
        pd.testing.assert_frame_equal(a[t], b[t], check_exact=True)


def test_a_broken_copy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification is not vacuous: drop the first block of every load."""
    from sim.engine.copypath import CopyPath

    real = CopyPath.load

    def lossy(self: CopyPath, sizes, idx, gpu_ids, slots):  # type: ignore[no-untyped-def]
        t = real(self, sizes, idx, gpu_ids, slots)
        self.compute([[gpu_ids[0]]] + [[0] for _ in sizes[1:]], [], 999, 0, 1)   # scribble on one block
        return t

    monkeypatch.setattr(CopyPath, "load", lossy)
    f, res = _run(BUSY)
    assert res.summary.integrity_violations > 0
    assert set(f["events"].kind) == {"integrity"}


def test_measured_timing_uses_the_copies() -> None:
    f, res = _run(replace(BUSY, copy_path=replace(CP, timing="measured")))
    x = f["transfers"]
    assert res.summary.integrity_violations == 0 and len(x) > 0
    assert (x.end_s - x.start_s).min() > 0     # real copies take time
