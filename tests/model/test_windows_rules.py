"""The OLD/NEW rule table of :mod:`sim.model.windows`, one row per rule, both profiles
(LATEST: tests/model/test_latest.py).

Every row names a rule exactly as the table in the windows docstring spells
it, an input, and the answer of OLD (vLLM 0.29) and of NEW (0.30). The
answers are worked out by hand from the behavioural spec
(``shared/reference/vllm-kv-offloading.md``); the derivation sits next to
each row. Most rows ask the profile object directly; a few run the spec's
worked examples (§6, §7.3, §10) through the scheduler, so that the rule is
seen where the connector applies it.

``test_every_rule_of_the_docstring_has_a_row`` keeps the table and the test
in step: a rule added to the docstring fails until it gets a row here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from sim.model import windows
from sim.model.connector import ModelledCrashError, OffloadingScheduler
from sim.model.cpu_cache import CpuChunkCache, EvictionPolicy, LookupResult, key_parts, offload_key
from sim.model.gpu_cache import Block
from sim.model.layout import GroupKind, GroupSpec, Layout
from sim.model.windows import NEW, OLD, WindowProfile, profile, store_alignment
from tests.helpers import Req, World, fa, make_req, swa

H = LookupResult.HIT
P = LookupResult.HIT_PENDING
M = LookupResult.MISS


def scan(prof: WindowProfile, states: list[LookupResult], need: int, initial: int | None) -> int | None:
    """``window_scan`` over keys 0..n-1 whose lookups answer ``states``."""
    keys = [offload_key(i, 1) for i in range(len(states))]
    answers = dict(zip(keys, states, strict=True))
    return prof.window_scan(answers.__getitem__, keys, need, initial)


def world(prof: WindowProfile, layout: Layout, **kwargs: object) -> World:
    """A World whose scheduler is rebuilt with ``kwargs`` (e.g. offload_prompt_only)."""
    w = World(layout, str(prof.logic), capacity=1000)
    if kwargs:
        w.sched = OffloadingScheduler(layout, w.cpu, prof, **kwargs)  # type: ignore[arg-type]
    return w


# -- rule: window search, first run ------------------------------------------------------


def first_run_profile(prof: WindowProfile) -> tuple[int | None, int | None]:
    # Spec §10 E2, group 1: SWA bs 16, W 32, bpc 1 -> tpc 16, w = 2. The finer
    # group has set M = 72, so the slice is keys[0:cdiv(72, 16) = 5] and the
    # candidate boundary is 72. Chunk 2 is missing.
    # NEW: pad = -72 mod 16 = 8, loadwin = max(2, cdiv(31 + 8, 16)) = 3 chunks
    # for the first run. Scan: 4, 3 (run 2 < 3), 2 MISS (required -> 2),
    # 1, 0 -> run 2 -> end index 0 + 2 = 2.
    # OLD: no initial window; 4, 3 -> run 2 = need -> end index 3 + 2 = 5.
    # (GPU allocation at N = 72 retains tokens from 72 - 32 + 1 = 41, block 2:
    # OLD's window [3, 5) leaves chunk 2 unverified.)
    init = prof.initial_window(swa(16, 32), 16, 2, 72)
    return init, scan(prof, [H, H, M, H, H], 2, init)


def first_run_e3(prof: WindowProfile) -> object:
    # Spec §10 E3: tph 16, bpc 1; (FA bs 16), (SWA bs 64, W 128 -> w = 2);
    # 2049-token prompt; FA chunks 0..66 and SWA chunks 15, 16 stored.
    # M = 2048 (the -1 token); FA: 67 chunks -> M = 1072. SWA slice [0, 17).
    # OLD: 16, 15 -> run 2 -> M stays 1072, hit 1072; allocation retains
    # tokens from 1072 - 128 + 1 = 945 -> block 14 -> chunk 14 is missing:
    # prepare_load asserts "not found" on (group 1, chunk 14).
    # NEW: loadwin(1072) = max(2, cdiv(127 + 16, 64)) = 3; 16, 15, then 14
    # MISS and no two hits further left -> 0.
    layout = Layout.of([fa(16), swa(64, 128)], tokens_per_hash=16)
    w = world(prof, layout)
    req = make_req(layout, 2049)
    w.store(req, 0, range(67))
    w.store(req, 1, [15, 16])
    w.sched.on_new_request(req)
    m = w.sched.get_num_new_matched_tokens(req, 0)
    if not m.tokens:
        return ("tokens", m.tokens)
    alloc = w.gpu.allocate_new(req.req_id, ([], []), 0, m.tokens, m.tokens)
    assert alloc is not None
    try:
        w.sched.update_state_after_alloc(req, alloc.blocks, m.tokens)
    except ModelledCrashError as exc:
        c = exc.crash
        return ("crash", m.tokens, c.kind, c.group, c.chunk)
    return ("loaded", m.tokens)


# -- rule: HIT_PENDING in the window scan ------------------------------------------------------


def pending_profile(prof: WindowProfile) -> int | None:
    # Spec §4.4 vs §4.6 item 3 with the E8 states: SWA keys [HIT, HIT, MISS,
    # PENDING], need 2 (initial window loadwin(16) = max(2, cdiv(7, 4)) = 2).
    # OLD: index 3 is pending -> deferred for good; 1, 0 make a run of 2 ->
    # None. NEW: the pending run is broken by the MISS at 2; the run 1, 0 has
    # no pending chunk -> end index 2.
    return scan(prof, [H, H, M, P], 2, prof.initial_window(swa(4, 8), 4, 2, 16))


def pending_e8(prof: WindowProfile) -> int | None:
    # Spec §10 E8: tph 4, bpc 1; (FA bs 4), (SWA bs 4, W 8); 17-token prompt;
    # FA 0..3 and SWA 0, 1 stored, SWA 3 store-pending.
    # M = 16; FA: 4 chunks -> 16. SWA as in the row above: OLD None; NEW end
    # index 2 -> M = 8, hit 8 (FA re-checked only if it tightened: it did not).
    layout = Layout.of([fa(4), swa(4, 8)], tokens_per_hash=4)
    w = world(prof, layout)
    req = make_req(layout, 17)
    w.store(req, 0, range(4))
    w.store(req, 1, [0, 1])
    w.store(req, 1, [3], complete=False)
    w.sched.on_new_request(req)
    return w.sched.get_num_new_matched_tokens(req, 0).tokens


# -- rule: EAGLE query widening ------------------------------------------------------------


def eagle_widening(prof: WindowProfile) -> tuple[bool, bool]:
    # §4.2: OLD peeks one chunk further only for SW-type EAGLE groups;
    # §4.6 item 4: NEW for every EAGLE group (issue #52735).
    return prof.eagle_widens(fa(16, eagle=True)), prof.eagle_widens(swa(16, 32, eagle=True))


# -- rule: being-loaded check window ----------------------------------------------------------


def being_loaded(prof: WindowProfile) -> tuple[int | None, int | None]:
    # §4.5 / §4.6 item 5 with the §6 numbers: SWA bs 64, W 128, bpc 4 ->
    # tpc 256, w = cdiv(128, 256) = 1; boundary 3904.
    # OLD inspects the last w = 1 chunk. NEW: pad = 4096 - 3904 = 192,
    # loadwin = max(1, cdiv(127 + 192, 256)) = 2 chunks.
    # A full-attention group (w None) is inspected whole by both.
    return (prof.being_loaded_window(swa(64, 128), 256, 1, 3904),
            prof.being_loaded_window(fa(256), 1024, None, 3904))


# -- rule: load start search after alloc --------------------------------------------------------


def load_start_aligned(prof: WindowProfile) -> tuple[int, bool]:
    # §5.2 with E6's numbers: C = 16, bs 16. The group holds unhashed,
    # non-null blocks at indices 0 and 1, so the search stops at its start.
    # OLD searches from 0 -> first 0 -> "C <= first * bs" is 16 <= 0: fails.
    # NEW searches from cdiv(16, 16) = 1 -> first 1; 16 mod 16 == 0: holds.
    first = prof.load_search_start(16, 16)
    return first, prof.local_boundary_violation(16, first, 16) is None


def load_start_unaligned(prof: WindowProfile) -> tuple[int, bool]:
    # §5.2: C = 40, bs 16, first fresh block 3. OLD: 40 <= 48 holds.
    # NEW: search from cdiv(40, 16) = 3; "C mod bs == 0" fails (40 mod 16 = 8).
    return prof.load_search_start(40, 16), prof.local_boundary_violation(40, 3, 16) is None


def load_start_e6(prof: WindowProfile) -> object:
    # Spec §10 E6: tph 16, bpc 1, two groups of bs 16, 64-token prompt; both
    # groups' chunks 0, 1 on CPU; C = 16 local tokens. Lookup from chunk 1:
    # chunk 1 HIT, chunk 2 MISS -> M = 32, E = 16. Crafted block lists: group 0
    # [hashed, fresh], group 1 [41, 42] both unhashed.
    # OLD: group 1's search from block 0 finds 41 -> 16 <= 0 fails -> an
    # "assertion" crash in group 1 at chunk 0. NEW: both groups load chunk 1
    # into block index 1.
    layout = Layout.of([fa(16), fa(16)], tokens_per_hash=16)
    w = world(prof, layout)
    req = make_req(layout, 64)
    w.store(req, 0, [0, 1])
    w.store(req, 1, [0, 1])
    w.sched.on_new_request(req)
    m = w.sched.get_num_new_matched_tokens(req, 16)
    hashed = Block(5)
    hashed.block_hash = (req.block_hashes[0], 0)
    blocks = ([hashed, Block(6)], [Block(41), Block(42)])
    try:
        plan = w.sched.update_state_after_alloc(req, blocks, m.tokens or 0)
    except ModelledCrashError as exc:
        c = exc.crash
        return (m.tokens, "crash", c.kind, c.group, c.chunk)
    assert plan is not None
    return (m.tokens, "load", plan.chunks, plan.block_indices, plan.dst_block_ids)


# -- rule: store length at finish -------------------------------------------------------------


def finish_length(prof: WindowProfile) -> int:
    # §7.1 with E9's numbers: 7 prompt tokens, 8 tokens at finish.
    # OLD T = num_tokens = 8; NEW T = max(7, 8 - 1) = 7.
    return prof.finished_store_tokens(7, 8)


def finish_e9(prof: WindowProfile) -> tuple[tuple[int, int], ...]:
    # Spec §10 E9: FA bs 4, bpc 1, offload_prompt_only off, 7-token prompt,
    # the first sampled token ends the request (8 tokens, two hash blocks).
    # OLD stores chunks 0 and 1 (T = 8, token 7 never computed); NEW T = 7 ->
    # chunk 0 only.
    layout = Layout.of([fa(4)], tokens_per_hash=4)
    w = world(prof, layout, offload_prompt_only=False)
    req = Req("r", [11, 12], num_tokens=8, num_prompt_tokens=7)
    w.sched.on_new_request(req)
    alloc = w.gpu.allocate_new("r", ([],), 0, 0, 8)
    assert alloc is not None
    w.sched.update_block_ids("r", alloc.new_block_ids)
    w.sched.request_finished("r")
    plan = w.sched.build_store_job("r", None)
    return () if plan is None else plan.chunks


# -- rule: EAGLE tail excluded from stores ------------------------------------------------------


def eagle_tail(prof: WindowProfile) -> tuple[bool, ...]:
    # §7.1: OLD drops the last chunk of an EAGLE group whenever decoding; NEW
    # only while decoding and not finished. (decoding, finished) in the order
    # (no, no), (no, yes), (yes, no), (yes, yes).
    combos = [(False, False), (False, True), (True, False), (True, True)]
    return tuple(prof.eagle_tail_excluded(d, f) for d, f in combos)


# -- rule: storable chunks capped by keys ---------------------------------------------------------


def capped_by_keys(prof: WindowProfile) -> tuple[tuple[tuple[int, int], ...], ...]:
    # §7.1: S = min(T // tpc, known block ids // bpc [NEW: , keys]). FA bs 16,
    # bpc 1, T = 64 -> S = 4 with 4 GPU blocks, but the request's hashes
    # cover only 32 tokens (2 keys). Then the hashes catch up.
    # OLD (spec): stores the two keys it has and advances to 4: chunks 2, 3 are
    # a permanent hole (NEW's cap "prevents a permanent hole"). vLLM 0.29.0's
    # own code asserts first (len(offload_keys) == len(offload_block_ids)), so
    # the hole needs python -O; see the row's xfail.
    # NEW: S = 2 now; chunks 2, 3 once their keys exist.
    layout = Layout.of([fa(16)], tokens_per_hash=16)
    w = world(prof, layout)
    req = Req("r", [1, 2], 64)
    w.sched.on_new_request(req)
    alloc = w.gpu.allocate_new("r", ([],), 0, 0, 64)
    assert alloc is not None
    w.sched.update_block_ids("r", alloc.new_block_ids)
    out = []
    for _ in range(2):
        plan = w.sched.build_store_job("r", 64)
        out.append(() if plan is None else plan.chunks)
        req.block_hashes += [3, 4]
    return tuple(out)


# -- rule: spec decode, no group annotated --------------------------------------------------------


def unannotated_eagle(prof: WindowProfile) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    # §10 E10(a): EAGLE spec decode on and no group annotated: OLD treats every
    # group as EAGLE, NEW none. With one group annotated both take the
    # annotation as it is.
    cpu = CpuChunkCache(10)
    plain = Layout.of([fa(16), swa(16, 32)], tokens_per_hash=16)
    marked = Layout.of([fa(16), swa(16, 32, eagle=True)], tokens_per_hash=16)
    return (OffloadingScheduler(plain, cpu, prof, spec_decode_eagle=True).eagle,
            OffloadingScheduler(marked, cpu, prof, spec_decode_eagle=True).eagle)


# -- rule: store reachability (window) -------------------------------------------------------------

REACH = Layout.of([fa(36), swa(4, 16)], tokens_per_hash=4)


def reach_profile(prof: WindowProfile) -> list[int]:
    # §7.3 example: FA bs 36, SWA bs 4, W 16, bpc 1 -> A = 9 chunks per FA
    # segment, w = 4, need = cdiv(15, 4) = 4 blocks; frontier S = 250,
    # prompt horizon 300. Chunks [240, 250):
    # OLD: full segment 234..242 keeps pos >= 9 - 4 -> 239..242; the partial
    # segment 243..249 has seg_len 7 -> pos >= 3 -> 246..249.
    # NEW: pos >= 9 - 4 in every segment -> 239..242, 248..251; the final
    # segment judged at the horizon (300 = 33 * 9 + 3) adds 297..299 only.
    mask = prof.reachable_chunks(REACH, 1, False, 240, 250, 250, 300)
    assert mask is not None
    return [240 + i for i, keep in enumerate(mask) if keep]


def reach_chunked_prefill(prof: WindowProfile) -> list[int]:
    # The §7.3 verified example end to end: 1200-token prompt, prefill steps
    # of 1000 and 200 tokens. Step 1 stores up to SWA chunk 250, step 2 up to
    # 300. Listing the SWA chunks stored in [240, 252) and [292, 300):
    # OLD: 240..242, 246..249 (frontier tail), 250, 251 (segment 243..251 is
    # full at S = 300: pos >= 5 -> 248..251), 293..296, 297..299 (partial
    # segment of length 3: all kept).
    # NEW: 240..242, 248..251, 293..296, 297..299 -- OLD's 246, 247 are the
    # difference the spec reports.
    w = world(prof, REACH)
    req = make_req(REACH, 1200)
    w.sched.on_new_request(req)
    alloc = w.gpu.allocate_new(req.req_id, ([], []), 0, 0, 1000)
    assert alloc is not None
    w.sched.update_block_ids(req.req_id, alloc.new_block_ids)
    stored: list[tuple[int, int]] = []
    plan = w.sched.build_store_job(req.req_id, 1000)
    assert plan is not None
    stored += plan.chunks
    new_ids = w.gpu.allocate_more(req.req_id, 1000, 1200)
    assert new_ids is not None
    w.sched.zero_reallocated({b for ids in new_ids for b in ids})
    w.sched.update_block_ids(req.req_id, new_ids)
    plan = w.sched.build_store_job(req.req_id, 1200)
    assert plan is not None
    stored += plan.chunks
    return sorted(j for g, j in stored if g == 1 and (240 <= j < 252 or 292 <= j < 300))


# -- the table ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    rule: str  #: exactly as in the windows docstring's table
    case: str
    ask: Callable[[WindowProfile], object]
    old: object
    new: object
    old_xfail: str | None = None


def arc_last_resort(prof: WindowProfile) -> object:
    """ARC with T1 below its target and T2's only chunk pinned: what a store's
    eviction takes (the CPU cache built as the scheduler builds it for ``prof``)."""
    a, b, c, d, e = (offload_key(h, 0) for h in range(1, 6))
    cache = CpuChunkCache(3, EvictionPolicy.ARC, arc_t1_last_resort=prof.arc_t1_last_resort)
    for keys in ((a, b, c), (d,)):            # d's store evicts a from T1 (target 0)
        res = cache.prepare_store(list(keys))
        assert res is not None
        cache.complete_store(list(res.keys))
    for _ in range(3):
        cache.touch([a])                      # ghost hits: T1's target is 3
    cache.touch([c])                          # c to T2
    cache.prepare_load([c])                   # T2's only chunk pinned
    res = cache.prepare_store([e])
    return None if res is None else tuple(key_parts(k) for k in res.evicted)


ROWS = [
    Row("window search, first run", "profile", first_run_profile, (None, 5), (3, 2)),
    Row("window search, first run", "e3-fa-sets-boundary", first_run_e3,
        ("crash", 1072, "missing_chunk", 1, 14), ("tokens", 0)),
    Row("HIT_PENDING in the window scan", "profile", pending_profile, None, 2),
    Row("HIT_PENDING in the window scan", "e8", pending_e8, None, 8),
    Row("EAGLE query widening (peek)", "fa-and-swa", eagle_widening, (False, True), (True, True)),
    Row("being-loaded check window", "swa-and-fa", being_loaded, (1, None), (2, None)),
    Row("load start search after alloc", "aligned-local", load_start_aligned, (0, False), (1, True)),
    Row("load start search after alloc", "unaligned-local", load_start_unaligned, (0, True), (3, False)),
    Row("load start search after alloc", "e6", load_start_e6,
        (16, "crash", "assertion", 1, 0), (16, "load", ((0, 1), (1, 1)), (1, 1), (6, 42))),
    Row("store length at finish", "profile", finish_length, 8, 7),
    Row("store length at finish", "e9", finish_e9, ((0, 0), (0, 1)), ((0, 0),)),
    Row("EAGLE tail excluded from stores", "profile", eagle_tail,
        (False, False, True, True), (False, False, True, False)),
    Row("storable chunks capped by keys", "hashes-lag", capped_by_keys,
        (((0, 0), (0, 1)), ()), (((0, 0), (0, 1)), ((0, 2), (0, 3))),
        old_xfail="OLD's strict zip raises ValueError; vLLM 0.29.0 asserts that the two lengths "
                  "match (_build_store_jobs: an AssertionError that stops the engine; the spec's "
                  "permanent hole is what python -O gives), so kvsim should record an assertion "
                  "crash: not modelled, as kvsim's workloads hash every token (keys never lag)"),
    Row("spec decode, no group annotated", "plain-and-marked", unannotated_eagle,
        ((True, True), (False, True)), ((False, False), (False, True))),
    Row("store reachability (window)", "profile", reach_profile,
        [240, 241, 242, 246, 247, 248, 249], [240, 241, 242, 248, 249]),
    Row("store reachability (window)", "chunked-prefill", reach_chunked_prefill,
        [240, 241, 242, 246, 247, 248, 249, 250, 251, 293, 294, 295, 296, 297, 298, 299],
        [240, 241, 242, 248, 249, 250, 251, 293, 294, 295, 296, 297, 298, 299]),
    Row("ARC, T1 and T2 both declined", "t2-pinned", arc_last_resort, None, ((2, 0),)),
]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def params() -> list[object]:
    out = []
    for row in ROWS:
        for prof in (OLD, NEW):
            marks = []
            if prof is OLD and row.old_xfail:
                marks.append(pytest.mark.xfail(strict=True, raises=ValueError, reason=row.old_xfail))
            out.append(pytest.param(row, prof, marks=marks, id=f"{slug(row.rule)}/{row.case}/{prof.logic}"))
    return out


@pytest.mark.parametrize("row,prof", params())
def test_rule(row: Row, prof: WindowProfile) -> None:
    expected = row.old if prof is OLD else row.new
    assert row.ask(prof) == expected


@pytest.mark.parametrize("row", ROWS, ids=[f"{slug(r.rule)}/{r.case}" for r in ROWS])
def test_every_row_tells_old_from_new(row: Row) -> None:
    assert row.old != row.new


def docstring_table() -> list[list[str]]:
    """The rows of the windows docstring's rule table: [rule, OLD, NEW, LATEST] cells."""
    doc = windows.__doc__ or ""
    table = doc.split("\nrule ", 1)[1]
    body = table.split("\n", 2)[2]  # past the header line and the rule below it
    rows = body.split("\n====")[0].splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in rows if line.strip()]


def docstring_rules() -> list[str]:
    """The rules in which OLD and NEW differ (the LATEST-only rules are
    tests/model/test_latest.py's)."""
    return [cells[0] for cells in docstring_table() if cells[1] != cells[2]]


def test_every_rule_of_the_docstring_has_a_row() -> None:
    assert all(len(cells) == 4 for cells in docstring_table())
    rules = docstring_rules()
    assert len(rules) == 11, rules
    assert sorted(set(rules)) == sorted({row.rule for row in ROWS})


def test_profiles_are_found_by_name() -> None:
    assert windows.profile("old") is OLD and windows.profile("new") is NEW
    assert [p.logic.value for p in (OLD, NEW)] == ["old", "new"]



def test_periodic_mask_and_chunks_any_equal_their_definitions() -> None:
    """The tiled block mask and the per-chunk ``any`` equal the index-by-index forms."""
    for b0 in range(12):
        for b1 in range(40):
            for shift in (0, 1):
                for per in (1, 2, 3, 4, 8, 32):
                    for need in range(per):
                        want = [i >= shift and (i - shift) % per >= per - need for i in range(b0, b1)]
                        assert windows._periodic_mask(b0, b1, shift, per, need) == want
    for bpc in (1, 2, 3, 4):
        for n in range(10):
            blocks = [(k * 7 + n) % 5 == 0 for k in range(n * bpc)]
            want = [any(blocks[k * bpc : (k + 1) * bpc]) for k in range(n)]
            assert windows._chunks_any(blocks, bpc) == want


def test_without_full_attention_the_store_grid_is_the_largest_chunk() -> None:
    """vLLM 0.30 and 0.33 judge a window group's store mask on the full-attention chunk grid
    and, with no full-attention group, on the largest tokens per chunk of all groups (0.29:
    no grid, every chunk reachable). A 5-token window of 4-token blocks beside a chunked-local
    group of 16-token blocks stores only the chunks that end on the 16-token grid (those a
    hit needs). Found in lockstep with vLLM 0.30.0 (the run fuzzer's seed 7 runs 14 and 30:
    kvsim offered all eight window chunks of the first 32-token prefill, vLLM two)."""
    layout = Layout.of([GroupSpec(GroupKind.CHUNKED_LOCAL, 16, attention_chunk=32),
                        GroupSpec(GroupKind.SLIDING_WINDOW, 4, window=5)], tokens_per_hash=4)
    assert layout.alignment_tokens is None and store_alignment(layout) == 16
    ids = list(range(1, 9))
    assert profile("old").reachable_chunks(layout, 1, False, 0, 8, 8, None, ids) is None
    for logic in ("new", "latest"):
        mask = profile(logic).reachable_chunks(layout, 1, False, 0, 8, 8, None, ids)
        assert mask == [False, False, False, True, False, False, False, True], logic
    # with a full-attention group the grid is its chunk, as before
    full = Layout.of([GroupSpec(GroupKind.FULL, 32), GroupSpec(GroupKind.SLIDING_WINDOW, 4, window=5)],
                     tokens_per_hash=4)
    assert store_alignment(full) == full.alignment_tokens == 32
