"""Engine test worlds: layouts, request builders, a run helper and the spec §6.1
crash world (shared by the engine, copy-path and reproducer tests)."""

from __future__ import annotations

import math

import pandas as pd

from sim.engine.loop import Engine, EngineConfig, SimulationResult, simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.io.workload import Request, chain_hash
from sim.model.costs import StepCostModel, TransferModel
from sim.model.layout import GroupKind, GroupSpec, KVShape, Layout

FA16 = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=1000)], tokens_per_hash=16,
                 blocks_per_chunk=1)
SHAPE = KVShape(layers=2, kv_heads=2, head_size=64, dtype_bytes=2)
HYBRID = Layout.of([GroupSpec(GroupKind.FULL, 16, shape=SHAPE),
                    GroupSpec(GroupKind.SLIDING_WINDOW, 16, window=128, shape=SHAPE)],
                   tokens_per_hash=16, blocks_per_chunk=4)
SPEC6 = Layout.of([GroupSpec(GroupKind.FULL, 256, bytes_per_block=2048),
                   GroupSpec(GroupKind.SLIDING_WINDOW, 64, window=128, bytes_per_block=512),
                   GroupSpec(GroupKind.SLIDING_WINDOW, 8, window=128, bytes_per_block=64)],
                  tokens_per_hash=8, blocks_per_chunk=4)
ONE_S = StepCostModel(overhead_s=1.0)
HALF_S_LINK = TransferModel(math.inf, 0.5)


def req(rid: str, t: float, prompt: int, out: int, prefix: int, tph: int = 16) -> Request:
    """A request whose prompt hashes depend only on ``prefix`` (equal prefixes share
    KV) and whose output hashes are its own."""
    hs: list[int] = []
    h = 0
    for j in range((prompt + out) // tph):
        tok = prefix * 1_000_003 + j if j < prompt // tph else (hash(rid) % 1_000_000) * 7919 + j
        h = chain_hash(h, tok)
        hs.append(h)
    return Request(rid, t, prompt, out, hs, tokens_per_hash=tph)


def run(cfg: EngineConfig, reqs: list[Request]) -> tuple[dict[str, pd.DataFrame], dict[str, object]]:
    sink = MemorySink()
    res = simulate(cfg, reqs, Recorder(sink, batch_rows=7))
    return sink.frames(), {"status": res.status, **res.summary.figures()}


def timeline(frames: dict[str, pd.DataFrame]) -> list[tuple[str, str, float]]:
    """(request, event, time) for every request and transfer, in time order
    (ties: by request, then lifecycle events before transfers)."""
    log: list[tuple[str, str, float]] = []
    for r in frames["requests"].itertuples():
        for ev in ("arrival", "scheduled", "first_token", "finish"):
            t = getattr(r, f"{ev}_s")
            if t is not None and not pd.isna(t):
                log.append((r.req_id, ev, float(t)))
    for x in frames["transfers"].itertuples():
        log.append((x.req_id, f"{x.direction}_submit", x.submit_s))
        log.append((x.req_id, f"{x.direction}_end", x.end_s))
    return sorted(log, key=lambda e: (e[2], e[0]))


def crash_world(on_crash: str, logic: str) -> tuple[dict[str, pd.DataFrame], SimulationResult]:
    """Spec §6.1 inside a run: the spec §6 layout, request b of 4353 tokens
    arrives while the CPU cache holds fa[0..3], swa[15] and short[118..121]
    (swa[14], the left key, missing). OLD hits 3904 and asserts in
    prepare_load (missing_chunk); NEW finds no verified window: 0 tokens.
    Request c comes later and is unaffected."""
    b = req("b", 1.0, 4353, 3, prefix=5, tph=8)
    c = req("c", 2.0, 600, 3, prefix=6, tph=8)
    cfg = EngineConfig(layout=SPEC6, gpu_blocks=4000, cpu_capacity_chunks=100,
                       window_logic=logic, on_crash=on_crash,  # type: ignore[arg-type]
                       step_cost=StepCostModel(0.01, 1e-5))
    sink = MemorySink()
    eng = Engine(cfg, [b, c], Recorder(sink))
    assert eng.cpu is not None
    keys = [SPEC6.offload_keys(g, b.block_hashes[: 4353 // 8]) for g in range(3)]
    stored = [*keys[0][0:4], keys[1][15], *keys[2][118:122]]
    plan = eng.cpu.prepare_store(stored)
    assert plan is not None
    eng.cpu.complete_store(plan.keys)
    res = eng.run()
    return sink.frames(), res
