"""Replay a ``check/1`` scenario as a run with the torch copy path.

What it models
    A check scenario states one request and the CPU chunk states it meets
    (spec §6). Here that world is built inside the engine with real tensors:
    present chunks hold the KV the request would compute (fingerprints
    written into spare GPU blocks and stored into their slots), a *pending*
    chunk's store lands only at ``t = 2 s`` (so its slot still holds stale,
    never-written data before), a *loading* chunk is pinned by another load
    that completes at ``t = 2 s``, a *retry* key is uncertain until then; the
    local GPU hit holds the right KV too. The request arrives at ``t = 1 s``
    and runs to completion. Every block it reads after a load is verified.

    :func:`replay_check` returns what happened under one logic, with vLLM's
    assertions on or stripped (``python -O``): the crash (if any), the
    hazards, and the integrity violations (request, group, chunk).

Simplifications
    * One request; two output tokens; no GPU pressure (the pool is sized to
      fit); zero compute cost apart from a 10 ms step and 0.1 ms per job.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sim.engine.loop import CopyPathConfig, Engine, EngineConfig
from sim.engine.metrics import MemorySink, Recorder
from sim.errors import InputError
from sim.io.check import CheckScenario, Logic, expand_chunk_states
from sim.io.workload import Request
from sim.model.costs import StepCostModel, TransferModel
from sim.model.cpu_cache import offload_key
from sim.model.layout import cdiv
from sim.model.request import kv_salt

__all__ = ["replay_check"]

_LAND_S = 2.0
_ARRIVE_S = 1.0


def replay_check(sc: CheckScenario, logic: Logic, *, assertions: bool = True,
                 source: str = "<check>") -> dict[str, Any]:
    """Run the scenario's request through the engine with the copy path.

    Returns:
        ``{"crash": {kind, group, chunk, message} | None, "hazards": [[kind,
        group, chunk]...], "violations": [[group, chunk], ...] (first
        occurrence order), "external_tokens": tokens loaded, "status": ...}``.
    """
    if sc.tiers:
        raise InputError(source, "tiers", "a check with secondary tiers cannot be replayed with the copy "
                         "path (it moves no tier data)", "no [[tiers]] with --copy-path")
    layout = sc.layout()
    states = expand_chunk_states(sc, source)
    tph = sc.tokens_per_hash
    n = sc.num_tokens
    out_tokens = 2
    hashes = list(range(1, n // tph + 1))
    hashes += [10**12 + i for i in range((n + out_tokens) // tph - len(hashes))]
    req = Request("check", _ARRIVE_S, n, out_tokens, hashes, None, tph)
    need = sum(cdiv(n + out_tokens, g.tokens_per_block) for g in layout.groups)
    gpu_blocks = 2 + 4 * need + 4 * layout.blocks_per_chunk * len(states)
    cfg = EngineConfig(layout=layout, gpu_blocks=gpu_blocks, prefix_caching=sc.prefix_caching,
                       cpu_capacity_chunks=sc.cpu_capacity_chunks or max(100, len(states)),
                       window_logic=logic, assertions=assertions,
                       copy_path=CopyPathConfig(mode="fingerprint", device="cpu"),
                       step_cost=StepCostModel(overhead_s=0.01), h2d=TransferModel(1e12, 1e-4),
                       d2h=TransferModel(1e12, 1e-4), max_num_batched_tokens=max(8192, n + out_tokens))
    sink = MemorySink()
    eng = Engine(cfg, [req], Recorder(sink))
    cpu, copy, gpu, conn = eng.cpu, eng.copy, eng.gpu, eng.conn
    assert cpu is not None and copy is not None and conn is not None
    bpc = layout.blocks_per_chunk
    hpc = layout.hashes_per_chunk
    salt = kv_salt(req.req_id)
    spare: Iterator[int] = iter(range(gpu_blocks - 1, 0, -1))
    key_of = {gj: offload_key(hashes[(gj[1] + 1) * hpc[gj[0]] - 1], gj[0]) for gj in states}
    ordered = sorted(states)

    def only(g: int, ids: list[int], end: int) -> list[list[int]]:
        """Block lists that write group ``g`` only (the null block elsewhere)."""
        return [ids if h == g else [0] * cdiv(end, spec.tokens_per_block)
                for h, spec in enumerate(layout.groups)]

    def write_chunk(g: int, j: int, slot: int) -> None:
        """The chunk's correct KV: computed into spare blocks, stored into ``slot``."""
        bs = layout.groups[g].tokens_per_block
        ids = [next(spare) for _ in range(bpc)]
        lists = only(g, [0] * (j * bpc) + ids, (j + 1) * bpc * bs)
        copy.compute(lists, hashes, salt, j * bpc * bs, (j + 1) * bpc * bs)
        sizes = [0] * len(layout.groups)
        idx = [0] * len(layout.groups)
        sizes[g], idx[g] = bpc, j * bpc
        copy.store(sizes, idx, ids, [slot])

    stored = [gj for gj in ordered if states[gj] in ("present", "pending", "loading")]
    slots: dict[tuple[int, int], int] = {}
    if stored:
        plan = cpu.prepare_store([key_of[gj] for gj in stored])
        if plan is None:  # pragma: no cover - capacity validated by the check schema
            raise RuntimeError("could not place the stated chunks")
        slots = dict(zip(stored, plan.slots, strict=True))
    for gj in stored:
        if states[gj] != "pending":
            write_chunk(*gj, slots[gj])
    cpu.complete_store([key_of[gj] for gj in stored if states[gj] != "pending"])
    loading = [key_of[gj] for gj in ordered if states[gj] == "loading"]
    if loading:
        cpu.prepare_load(loading)
        if conn.being_loaded is not None:
            conn.being_loaded.update(loading)
    retry = [key_of[gj] for gj in ordered if states[gj] == "retry"]
    cpu.mark_uncertain(retry)
    cpu.take_events()
    # the local GPU hit holds the right KV
    if sc.gpu_computed_tokens:
        gpu.seed_prefix(hashes, sc.gpu_computed_tokens)
        for g, spec in enumerate(layout.groups):
            bs = spec.tokens_per_block
            hpb = bs // tph
            first = gpu.retained_range(g, sc.gpu_computed_tokens)[0]
            for i in range(first, sc.gpu_computed_tokens // bs):
                blk = gpu.pool.cached((hashes[(i + 1) * hpb - 1], g))
                if blk is None:
                    continue
                bid = blk if isinstance(blk, int) else blk.block_id   # fast accounting: an id
                lists = only(g, [0] * i + [bid], (i + 1) * bs)
                copy.compute(lists, hashes, salt, i * bs, (i + 1) * bs)

    def land() -> Any:
        yield eng.env.timeout(_LAND_S)
        pending = [gj for gj in stored if states[gj] == "pending"]
        for gj in pending:
            write_chunk(*gj, slots[gj])
        if pending:
            cpu.complete_store([key_of[gj] for gj in pending])
        if loading:
            cpu.complete_load(loading)
            if conn.being_loaded is not None:
                conn.being_loaded.difference_update(loading)
        cpu.clear_uncertain(retry)
        eng.kick()

    eng.env.process(land())
    res = eng.run()
    frames = sink.frames()
    ev = frames["events"]
    crash = None
    crashes = ev[ev.kind == "crash"]
    if len(crashes):
        c = crashes.iloc[0]
        crash = {"kind": c.detail, "group": int(c.group), "chunk": int(c.chunk), "message": c.message}
    hz = ev[ev.kind == "hazard"]
    bad = ev[ev.kind == "integrity"]
    violations: list[list[int]] = []
    for g, j in zip(bad.group, bad.chunk, strict=True):
        if [int(g), int(j)] not in violations:
            violations.append([int(g), int(j)])
    rows = frames["requests"]
    return {
        "logic": logic, "assertions": assertions, "status": res.status, "crash": crash,
        "hazards": [[d, int(g), int(j)] for d, g, j in zip(hz.detail, hz.group, hz.chunk, strict=True)],
        "violations": violations, "integrity_violations": int(res.summary.integrity_violations),
        "external_tokens": int(rows.cpu_hit_tokens.sum() + rows.cpu_reload_tokens.sum()),
    }
