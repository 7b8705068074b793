"""LATEST (vLLM 0.33.0) in the rule table of :mod:`sim.model.windows`.

Two kinds of rows:

* every OLD/NEW row of ``tests/model/test_windows_rules.py``: LATEST gives
  NEW's answer (those cases have no ``extra_retained_tokens``, where the two
  agree);
* one or more rows per rule in which NEW and LATEST differ (the docstring
  table's NEW and LATEST cells differ), each with NEW's and LATEST's answer
  worked out by hand from the 0.33 code reading (docs/latest.md); the
  derivation sits next to each row.

Then the crash library: every file states an ``[expect.latest]`` (taken from
real vLLM 0.33.0 with scripts/vllm_check.py, never from kvsim) and kvsim's
LATEST meets it; and the decision kernel equals the real-object reference
under LATEST, as tests/model/test_decision.py holds for OLD and NEW.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sim.io.check import (
    case_outcomes,
    compare,
    evaluate,
    load_check_file,
    parse_check,
    reference_check,
    run_check,
)
from sim.model.connector import ModelledCrashError
from sim.model.cpu_cache import CpuChunkCache
from sim.model.layout import GroupKind, GroupSpec, Layout
from sim.model.windows import LATEST, NEW, WindowLogic, WindowProfile, profile
from sim.tools.fuzz import scenario_at
from tests.helpers import ROOT, Req, World, fa, make_req, swa
from tests.model.test_windows_rules import ROWS, docstring_table, slug, world

CRASH = ROOT / "scenarios" / "crash"


# -- OLD/NEW rows: LATEST answers as NEW ---------------------------------------------------------


@pytest.mark.parametrize("row", ROWS, ids=[f"{slug(r.rule)}/{r.case}" for r in ROWS])
def test_latest_keeps_new_on_the_old_new_rows(row: object) -> None:
    assert row.ask(LATEST) == row.new  # type: ignore[attr-defined]


# -- rule: window chunks of a window group ---------------------------------------------------------


def window_chunks(prof: WindowProfile) -> tuple[object, object]:
    # 0.33 sizes a sliding window in chunks as max(cdiv(W, t), cdiv(W - 1 + e, t)).
    # FA bs 8; SWA bs 8 W 16 (w = 2 either way); SWA bs 8 W 16 e 3:
    # NEW cdiv(16, 8) = 2, LATEST max(2, cdiv(18, 8) = 3) = 3. The lookup order
    # sorts window groups by w descending (stable): NEW 1, 2 (tie), LATEST 2, 1.
    layout = Layout.of([fa(8), swa(8, 16), swa(8, 16, extra=3)], tokens_per_hash=8)
    return prof.window_chunks(layout), prof.lookup_order(layout)


def window_chunks_e1(prof: WindowProfile) -> object:
    # e = 1 does not widen: cdiv(16 - 1 + 1, 8) = 2 = cdiv(16, 8).
    layout = Layout.of([fa(8), swa(8, 16, extra=1)], tokens_per_hash=8)
    return prof.window_chunks(layout)


def load_plan(w: World, req: Req, local: int = 0) -> tuple[object, ...]:
    """Lookup, allocation and load plan of ``req``: ("deferred"), ("tokens", 0),
    ("crash", tokens, kind, group, chunk) or ("loaded", tokens, chunks, hazards)."""
    w.sched.on_new_request(req)
    m = w.sched.get_num_new_matched_tokens(req, local)
    if m.tokens is None:
        return ("deferred",)
    if not m.tokens:
        return ("tokens", 0)
    alloc = w.gpu.allocate_new(req.req_id, tuple([] for _ in w.layout.groups), 0, m.tokens, m.tokens)
    assert alloc is not None
    try:
        plan = w.sched.update_state_after_alloc(req, alloc.blocks, m.tokens, alloc.null_prefix)
    except ModelledCrashError as exc:
        c = exc.crash
        return ("crash", m.tokens, c.kind, c.group, c.chunk)
    assert plan is not None
    return ("loaded", m.tokens, tuple(j for g, j in plan.chunks if g == 1),
            tuple((h.kind, h.group, h.chunk) for h in plan.hazards))


E4 = Layout.of([fa(8), swa(8, 16, extra=3)], tokens_per_hash=8)


def window_chunks_e7(prof: WindowProfile) -> tuple[object, ...]:
    # Spec §10 E7: FA bs 8, SWA bs 8 W 16 e 10, bpc 1, 81 tokens; FA 0..9 and
    # SWA 6..9 stored. M = 80; FA -> 80.
    # NEW: w = 2, window 9, 8 -> 80; allocation keeps tokens from
    # 80 - 15 - 10 = 55: blocks 6..9 = 4 pending > w*bpc + 1 = 3 -> assertion.
    # LATEST: w = max(2, cdiv(25, 8)) = 4; window 9..6 -> 80; 4 <= 5: the
    # load reads SWA 6..9.
    layout = Layout.of([fa(8), swa(8, 16, extra=10)], tokens_per_hash=8)
    w = world(prof, layout)
    req = make_req(layout, 81)
    w.store(req, 0, range(10))
    w.store(req, 1, range(6, 10))
    return load_plan(w, req)


# -- rule: window search, first run ----------------------------------------------------------------


def first_run_profile(prof: WindowProfile) -> object:
    # SWA bs 8, W 16, e 6, candidate boundary 76 (pad 4). NEW: w = 2,
    # loadwin = max(2, cdiv(15 + 4, 8)) = 3. LATEST: w = max(2, cdiv(21, 8)) = 3,
    # loadwin_e = max(3, cdiv(15 + 6 + 4, 8)) = 4.
    group = swa(8, 16, extra=6)
    w = prof.window_chunks(Layout.of([fa(8), group], tokens_per_hash=8))[1]
    assert w is not None
    return prof.initial_window(group, 8, w, 76)


def first_run_e4(prof: WindowProfile) -> tuple[object, ...]:
    # Spec §10 E4: FA bs 8, SWA bs 8 W 16 e 3, 81 tokens; FA 0..9, SWA 8, 9.
    # NEW: w = 2, window 9, 8 -> 80; allocation keeps tokens from 80 - 15 - 3
    # = 62: blocks 7..9 -> SWA 7 is not on CPU -> prepare_load "not found".
    # LATEST: w = 3: 9, 8 hit, 7 misses, nothing further left -> 0 tokens.
    w = world(prof, E4)
    req = make_req(E4, 81)
    w.store(req, 0, range(10))
    w.store(req, 1, [8, 9])
    return load_plan(w, req)


# -- rule: being-loaded check window -------------------------------------------------------------


def being_loaded_profile(prof: WindowProfile) -> object:
    # As first_run_profile, for the check after the lookup at C + hit = 76.
    group = swa(8, 16, extra=6)
    w = prof.window_chunks(Layout.of([fa(8), group], tokens_per_hash=8))[1]
    return prof.being_loaded_window(group, 8, w, 76)


def being_loaded_e4(prof: WindowProfile) -> tuple[object, ...]:
    # E4 with SWA 7 stored as well and being loaded by another request.
    # NEW: window 9, 8 -> 80; the check looks at the last loadwin(80) = 2
    # chunks (8, 9): none loading -> the load reads 7..9 (allocation keeps
    # block 7) and 7 a second time: double_load.
    # LATEST: window 9, 8, 7 -> 80; loadwin_e(80) = 3 chunks 7..9: 7 is
    # loading -> deferred.
    w = world(prof, E4)
    req = make_req(E4, 81)
    w.store(req, 0, range(10))
    w.store(req, 1, [7, 8, 9])
    key = w.key(req, 1, 7)
    w.cpu.prepare_load([key])
    assert w.sched.being_loaded is not None
    w.sched.being_loaded.add(key)
    return load_plan(w, req)


# -- rule: store reachability (window) -----------------------------------------------------------


def reach_profile(prof: WindowProfile) -> list[int]:
    # FA bs 32 (alignment 32 tokens), SWA bs 4 W 8 e 4, bpc 1: 8 blocks per
    # segment. NEW keeps cdiv(8 - 1, 4) = 2 blocks per segment (6, 7, 14, 15);
    # LATEST widens the window to W + e = 12: cdiv(11, 4) = 3 (5..7, 13..15).
    layout = Layout.of([fa(32), swa(4, 8, extra=4)], tokens_per_hash=4)
    mask = prof.reachable_chunks(layout, 1, False, 0, 16, 16, None)
    assert mask is not None
    return [i for i, keep in enumerate(mask) if keep]


# -- rule: null block in a stored chunk -------------------------------------------------------------


def null_block_dense(prof: WindowProfile) -> object:
    # FA bs 8, SWA bs 4 W 16, bpc 2: alignment 16 tokens = 4 SWA blocks, need
    # cdiv(15, 4) = 4 >= 4: every block reachable (no mask). SWA block ids
    # [0, 5, 6, 7, 8, 9]: chunk 0's first block is null.
    # NEW: no mask (the connector checks the last block only: chunk 0 kept).
    # LATEST: a reachable null block drops chunk 0.
    layout = Layout.of([fa(8), swa(4, 16)], tokens_per_hash=4, blocks_per_chunk=2)
    return prof.reachable_chunks(layout, 1, False, 0, 3, 3, None, [0, 5, 6, 7, 8, 9])


def null_block_masked(prof: WindowProfile) -> object:
    # FA bs 8, SWA bs 4 W 8, bpc 2: 4 blocks per segment, need cdiv(7, 4) = 2:
    # blocks 2, 3, 6, 7 reachable -> chunks 1 and 3. Block 4 (chunk 2, not
    # reachable) and block 2 (chunk 1, reachable) are null.
    # NEW: chunks 1, 3. LATEST: chunk 1 has a reachable null block -> 3 only.
    layout = Layout.of([fa(8), swa(4, 8)], tokens_per_hash=4, blocks_per_chunk=2)
    mask = prof.reachable_chunks(layout, 1, False, 0, 4, 4, None, [1, 2, 0, 3, 0, 5, 6, 7])
    assert mask is not None
    return [i for i, keep in enumerate(mask) if keep]


def null_block_store(prof: WindowProfile) -> tuple[int, ...]:
    # null_block_dense through a store job: a 48-token prompt, FA 6 blocks,
    # SWA 12 blocks whose first is null (as after a hit that skipped it).
    # Stored SWA chunks: NEW 0..5, LATEST 1..5.
    layout = Layout.of([fa(8), swa(4, 16)], tokens_per_hash=4, blocks_per_chunk=2)
    w = world(prof, layout)
    req = make_req(layout, 48)
    w.sched.on_new_request(req)
    w.sched.update_block_ids(req.req_id, [list(range(1, 7)), [0, *range(11, 22)]])
    plan = w.sched.build_store_job(req.req_id, 48)
    assert plan is not None
    return tuple(j for g, j in plan.chunks if g == 1)


# -- rule: store index at a lookup -------------------------------------------------------------------


def store_index(prof: WindowProfile) -> tuple[tuple[int, int], ...]:
    # FA bs 4, CPU room for 2 chunks. Request a stores chunks 0, 1; request b
    # stores two chunks of its own, evicting a's. a is looked up again (as
    # after a preemption: no hit) and recomputes its 8 tokens.
    # NEW keeps a's store index at 2: nothing is offered again.
    # LATEST restarts it at 0: chunks 0, 1 are stored again.
    layout = Layout.of([fa(4)], tokens_per_hash=4)
    w = world(prof, layout)
    w.cpu = CpuChunkCache(2)
    w.sched = type(w.sched)(layout, w.cpu, prof)
    a, b = make_req(layout, 8, "a", base=1), make_req(layout, 8, "b", base=100)
    for req in (a, b):
        w.sched.on_new_request(req)
        assert w.sched.get_num_new_matched_tokens(req, 0).tokens == 0
        w.sched.update_block_ids(req.req_id, [[1, 2] if req is a else [3, 4]])
        plan = w.sched.build_store_job(req.req_id, 8)
        assert plan is not None and len(plan.chunks) == 2
        w.sched.complete_job(plan.job_id)
    assert w.sched.get_num_new_matched_tokens(a, 0).tokens == 0
    w.sched.update_block_ids(a.req_id, [[5, 6]])
    plan = w.sched.build_store_job(a.req_id, 8)
    return () if plan is None else plan.chunks


def cpu_recency(prof: WindowProfile) -> tuple[int, ...]:
    # FA bs 4, CPU room for 2 chunks. Request a stores chunks 0, 1; request b
    # then stores one chunk, evicting one of a's.
    # NEW: a's store touches its pending chunks (no effect), they turn idle in
    # store order, so chunk 0 is the oldest and goes.
    # LATEST (vLLM 0.33): both chunks carry a's provisional rank, the tail
    # (chunk 1, ending at token 8) below the head, so chunk 1 goes.
    layout = Layout.of([fa(4)], tokens_per_hash=4)
    w = world(prof, layout)
    w.cpu = CpuChunkCache(2, request_scoped=prof.request_scoped_recency)
    w.sched = type(w.sched)(layout, w.cpu, prof)
    a, b = make_req(layout, 8, "a", base=1), make_req(layout, 4, "b", base=100)
    evicted: tuple[int, ...] = ()
    for req, ids in ((a, [1, 2]), (b, [3])):
        w.sched.on_new_request(req)
        assert w.sched.get_num_new_matched_tokens(req, 0).tokens == 0
        w.sched.update_block_ids(req.req_id, [ids])
        plan = w.sched.build_store_job(req.req_id, len(ids) * 4)
        assert plan is not None
        w.sched.complete_job(plan.job_id)
        evicted = tuple(w.sched.keys_of("a", 0).index(k) for k in plan.evicted)
    return evicted


@dataclass(frozen=True)
class LatestRow:
    rule: str  #: exactly as in the windows docstring's table
    case: str
    ask: Callable[[WindowProfile], object]
    new: object
    latest: object


def skipped_without_kv(prof: WindowProfile) -> object:
    # the scheduler's waiting queues (tests/model/test_scheduler.py, deferred_behind_preempted):
    # 0.30 keeps the deferred b in skipped_waiting and looks it up again before the preempted c;
    # 0.33 puts b back at the front of waiting, behind c, and stops at c
    from tests.model.test_scheduler import deferred_behind_preempted
    return deferred_behind_preempted(prof.logic.value)


LATEST_ROWS = [
    LatestRow("window chunks of a window group", "profile", window_chunks,
              ((None, 2, 2), (0, 1, 2)), ((None, 2, 3), (0, 2, 1))),
    LatestRow("window chunks of a window group", "e7-assertion", window_chunks_e7,
              ("crash", 80, "assertion", 1, 6), ("loaded", 80, (6, 7, 8, 9), ())),
    LatestRow("window search, first run", "profile", first_run_profile, 3, 4),
    LatestRow("window search, first run", "e4-mtp", first_run_e4,
              ("crash", 80, "missing_chunk", 1, 7), ("tokens", 0)),
    LatestRow("being-loaded check window", "profile", being_loaded_profile, 3, 4),
    LatestRow("being-loaded check window", "e4-loading", being_loaded_e4,
              ("loaded", 80, (7, 8, 9), (("double_load", 1, 7),)), ("deferred",)),
    LatestRow("store reachability (window)", "extra-widens", reach_profile,
              [6, 7, 14, 15], [5, 6, 7, 13, 14, 15]),
    LatestRow("null block in a stored chunk", "dense", null_block_dense, None, [False, True, True]),
    LatestRow("null block in a stored chunk", "masked", null_block_masked, [1, 3], [3]),
    LatestRow("null block in a stored chunk", "store-job", null_block_store,
              (0, 1, 2, 3, 4, 5), (1, 2, 3, 4, 5)),
    LatestRow("store index at a lookup", "evicted-then-recomputed", store_index, (), ((0, 0), (0, 1))),
    LatestRow("CPU recency (LRU / ARC)", "tail-first", cpu_recency, (0,), (1,)),
    LatestRow("skipped request holding no KV", "behind-a-preempted-one", skipped_without_kv,
              (("b", "|"), ("b", "|", "c"), True), (("|", "b"), ("|", "c", "b"), False)),
]


@pytest.mark.parametrize("row,prof", [
    pytest.param(row, prof, id=f"{slug(row.rule)}/{row.case}/{prof.logic}")
    for row in LATEST_ROWS for prof in (NEW, LATEST)])
def test_latest_rule(row: LatestRow, prof: WindowProfile) -> None:
    assert row.ask(prof) == (row.new if prof is NEW else row.latest)


@pytest.mark.parametrize("row", LATEST_ROWS, ids=[f"{slug(r.rule)}/{r.case}" for r in LATEST_ROWS])
def test_every_latest_row_tells_new_from_latest(row: LatestRow) -> None:
    assert row.new != row.latest


def test_every_new_latest_rule_of_the_docstring_has_a_row() -> None:
    rules = {cells[0] for cells in docstring_table() if cells[2] != cells[3]}
    assert rules == {row.rule for row in LATEST_ROWS}
    # the rules where only LATEST differs keep OLD == NEW
    assert {cells[0] for cells in docstring_table() if cells[1] == cells[2]} >= {
        "window chunks of a window group", "null block in a stored chunk", "store index at a lookup"}


def test_latest_is_found_by_name() -> None:
    assert profile("latest") is LATEST and LATEST.logic is WindowLogic.LATEST
    assert [lg.value for lg in WindowLogic] == ["old", "new", "latest"]


def test_latest_without_extra_tokens_sizes_windows_as_new() -> None:
    layout = Layout.of([fa(16), swa(16, 40), GroupSpec(GroupKind.CHUNKED_LOCAL, 16, attention_chunk=48),
                        GroupSpec(GroupKind.MAMBA, 16)], tokens_per_hash=16)
    assert LATEST.window_chunks(layout) == layout.window_chunks == (None, 3, 3, 1)
    assert LATEST.lookup_order(layout) == layout.lookup_order
    assert LATEST.window_groups(layout) == layout.window_groups


# -- the crash library ----------------------------------------------------------------------------

TOP = sorted(CRASH.glob("*.toml"))


@pytest.mark.parametrize("path", TOP, ids=[p.name for p in TOP])
def test_library_latest_expectation_holds(path: Path) -> None:
    _, items = load_check_file(path)
    sc = parse_check(items[0], str(path))
    exp = sc.expect.get("latest")
    assert exp is not None, f"{path.name} states no [expect.latest]"
    case = sc.case(str(path))
    out = run_check(case, "latest")
    assert compare(exp, out) == []
    assert reference_check(case, "latest") == out
    # the library runner checks it as well (window_logic = "both" files)
    _, mismatches = evaluate(sc, str(path))
    assert "latest" not in mismatches


def test_library_latest_mismatch_is_reported(tmp_path: Path) -> None:
    src = (CRASH / "e04-extra-retained-tokens-swa7-missing.toml").read_text()
    bad = src.rsplit("[expect.latest]", 1)
    text = bad[0] + "[expect.latest]" + bad[1].replace("external_tokens = 0", "external_tokens = 80")
    sc = parse_check(__import__("tomllib").loads(text), "bad")
    _, mismatches = evaluate(sc, "bad")
    assert list(mismatches) == ["latest"]


def test_library_states_latest_where_it_differs_from_new() -> None:
    differ = []
    for path in TOP:
        sc = parse_check(load_check_file(path)[1][0], str(path))
        if sc.expect["latest"] != sc.expect["new"]:
            differ.append(path.name)
    # E4 (MTP window now covered) and E7 (assertion bound now counts e)
    assert sorted(differ) == ["e04-extra-retained-tokens-swa7-missing.toml",
                              "e07-pending-blocks-assertion-large-extra-retained.toml"]


# -- kernel vs real objects under LATEST --------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 7])
def test_kernel_equals_the_reference_under_latest(seed: int) -> None:
    for i in range(250):
        case = scenario_at(seed, i)
        assert case_outcomes(case, ("latest",))["latest"] == reference_check(case, "latest"), (seed, i)


def test_kernel_equals_the_reference_under_latest_with_extra_tokens() -> None:
    """The stream's cases with ``extra_retained_tokens``, where 0.30 and 0.33 part."""
    differs = checked = 0
    for i in range(4000):
        case = scenario_at(11, i)
        if not any(g.extra_retained_tokens for g in case.groups):
            continue
        outs = case_outcomes(case, ("new", "latest"))
        assert outs["latest"] == reference_check(case, "latest"), i
        differs += outs["new"] != outs["latest"]
        checked += 1
        if checked == 150:
            break
    assert checked == 150 and differs >= 10, (checked, differs)
