"""The torch copy path (sim.engine.copypath): fingerprints, spec §8.2 copies, verify, calibrate, CLI.

torch is installed wherever the tests run (CI installs the pinned CPU wheel), so
it is imported plainly: a missing torch fails these tests instead of skipping them.
The last tests prove that the rest of the package neither needs nor imports torch.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import tomllib
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch

from sim.cli import main
from sim.engine import copypath
from sim.engine.copypath import (
    CopyPath,
    CopyPathError,
    Violation,
    _gather_scatter,
    _one_pass,
    calibrate,
    fingerprints,
    hardware_snippet,
)
from sim.io.scenario import HardwareFile, HardwareSection
from sim.model.layout import GroupKind, GroupSpec, KVShape, Layout
from tests.helpers import ROOT, SPEC6, fa

# -- an independent, slow reference of the fingerprint --------------------------------

M64 = (1 << 64) - 1
C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
GAMMA, POS = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03


def mix(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * C1) & M64
    x ^= x >> 27
    x = (x * C2) & M64
    return x ^ (x >> 31)


def unmix(y: int) -> int:
    """Inverse of ``mix`` (xorshifts undone by iteration, multiplications by modular inverses)."""

    def unxorshift(v: int, s: int) -> int:
        x = v
        for _ in range(64 // s + 1):
            x = v ^ (x >> s)
        return x

    y = unxorshift(y, 31)
    y = (y * pow(C2, -1, 1 << 64)) & M64
    y = unxorshift(y, 27)
    y = (y * pow(C1, -1, 1 << 64)) & M64
    return unxorshift(y, 30)


def signed(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def fp_raw(g: int, h: int, p: int) -> int:
    """fp before the 0 -> 1 replacement, unsigned."""
    x = mix((h & M64) ^ mix((g + 1) * GAMMA))
    return mix(x + (p + 1) * POS)


def fp_ref(g: int, hashes: list[int], salt: int, tph: int, p: int) -> int:
    h = hashes[p // tph] if p // tph < len(hashes) else salt
    return signed(fp_raw(g, h, p) or 1)


# -- builders ---------------------------------------------------------------------

HASHES = [(i * 0x2545F4914F6CDD1D + 17) & M64 for i in range(600)]  # some above 2**63
SALT = 0x5EED


def spec6_blocks(first: int) -> list[list[int]]:
    """Block lists of the spec §6.2 request after the N = 3904 hit: group 0 has 16
    real blocks, group 1 59 null + 2 real, group 2 472 null + 16 real; real ids
    are consecutive from ``first``."""
    ids = iter(range(first, first + 34))
    return [[next(ids) for _ in range(16)],
            [0] * 59 + [next(ids) for _ in range(2)],
            [0] * 472 + [next(ids) for _ in range(16)]]


def real(blocks: list[list[int]]) -> list[int]:
    return [b for lst in blocks for b in lst if b]


SPEC6_SIZES, SPEC6_INDICES = [16, 2, 16], [0, 59, 472]
SPEC6_SLOTS = [13, 5, 7, 9, 11, 12, 0, 1, 2, 4]  # 4 + 2 + 4 slots, deliberately unordered
#: what the request reads per group at N = 3904 (group 1 and 2: the window, blocks 59-60 / 472-487)
SPEC6_RANGES = [(0, 3904), (3776, 3904), (3776, 3904)]


@pytest.fixture
def spec6() -> CopyPath:
    cp = CopyPath(SPEC6, 80, 20, device="cpu")
    cp.compute(spec6_blocks(1), HASHES, SALT, 0, 3904)
    return cp


# -- fingerprints -----------------------------------------------------------------------


def test_fingerprints_equal_the_slow_reference_for_every_input_kind() -> None:
    hashes = HASHES[:40]
    got = fingerprints(3, hashes, SALT, 8, 5, 400)  # 320 hashed tokens, then the salted tail
    want = [fp_ref(3, hashes, SALT, 8, p) for p in range(5, 400)]
    assert got.dtype == torch.int64
    assert got.tolist() == want
    signed_hashes = array("q", [signed(h) for h in hashes])
    assert fingerprints(3, signed_hashes, SALT, 8, 5, 400).tolist() == want
    assert fingerprints(3, memoryview(signed_hashes), SALT, 8, 5, 400).tolist() == want
    assert fingerprints(3, tuple(signed_hashes), SALT, 8, 5, 400).tolist() == want
    assert fingerprints(3, [], SALT, 8, 0, 4).tolist() == [fp_ref(3, [], SALT, 8, p) for p in range(4)]
    assert fingerprints(3, hashes, SALT, 8, 9, 9).shape == (0,)


def test_fingerprints_are_deterministic_and_differ_across_group_hash_position() -> None:
    a = fingerprints(1, HASHES, SALT, 16, 0, 4096)
    assert torch.equal(a, fingerprints(1, HASHES, SALT, 16, 0, 4096))
    assert torch.equal(a[100:200], fingerprints(1, HASHES, SALT, 16, 100, 200))
    everything = torch.cat([fingerprints(g, HASHES[k::7], SALT + k, 16, 0, 2048)
                            for g in range(4) for k in range(7)])
    assert len(set(everything.tolist())) == everything.numel()  # no collision among 57344 words
    assert bool((everything != 0).all())


def test_shared_prefix_gives_the_same_words_and_the_salt_keeps_tails_apart() -> None:
    a = fingerprints(0, HASHES[:10], 1, 16, 0, 170)
    b = fingerprints(0, HASHES[:10], 2, 16, 0, 170)
    assert torch.equal(a[:160], b[:160])
    assert bool((a[160:] != b[160:]).all())


def test_a_zero_fingerprint_is_replaced_by_one() -> None:
    g, p = 2, 37
    # choose h so that the mix gives exactly 0 at (g, h, p)
    h = unmix((-(p + 1) * POS) & M64) ^ mix((g + 1) * GAMMA)
    assert fp_raw(g, h, p) == 0
    assert fingerprints(g, [h], SALT, 64, p, p + 1).tolist() == [1]
    assert fingerprints(g, [h], SALT, 64, p + 1, p + 2).tolist() != [1]


# -- compute -----------------------------------------------------------------------


def test_compute_writes_tokens_to_their_blocks_and_skips_null_entries() -> None:
    layout = Layout.of([fa(16)], tokens_per_hash=16)
    cp = CopyPath(layout, 8, 2, device="cpu")
    cp.compute([[0, 3, 0, 5, 6]], HASHES, SALT, 0, 70)  # 70 tokens: block 4 holds tokens 64..69
    gpu = cp.gpu_tensor(0)
    assert gpu.shape == (8, 16)
    fp = fingerprints(0, HASHES, SALT, 16, 0, 70)
    assert torch.equal(gpu[3], fp[16:32])
    assert torch.equal(gpu[5], fp[48:64])
    assert gpu[6, :6].tolist() == fp[64:70].tolist() and gpu[6, 6:].tolist() == [0] * 10
    for row in (0, 1, 2, 4, 7):  # the null block and untouched blocks stay 0
        assert gpu[row].tolist() == [0] * 16
    cp.compute([[0, 3, 0, 5, 6]], HASHES, SALT, 70, 72)  # a decode step adds two tokens
    assert gpu[6, :8].tolist() == fingerprints(0, HASHES, SALT, 16, 0, 72)[64:72].tolist()


@pytest.mark.parametrize("mode", ["fingerprint", "realistic"])
def test_compute_in_small_steps_writes_the_same_bytes_as_one_large_step(
        mode: Literal["fingerprint", "realistic"]) -> None:
    """Steps of up to 4 tokens take a scalar path; it must agree with the vectorised one."""
    layout = realistic_layout(bpc=1)
    whole = CopyPath(layout, 12, 1, mode=mode, device="cpu")
    steps = CopyPath(layout, 12, 1, mode=mode, device="cpu")
    blocks = [[1, 2, 3, 4], [0, 5]]  # group 1: the window dropped its first block
    hashes = HASHES[:3]  # tokens 48.. are in the salted tail
    whole.compute(blocks, hashes, SALT, 0, 61)
    for a, b in [(0, 1), (1, 4), (4, 8), (8, 40), (40, 43), (43, 47), (47, 48), (48, 50), (50, 61)]:
        steps.compute(blocks, hashes, SALT, a, b)
    for g in range(2):
        assert torch.equal(whole.gpu_tensor(g), steps.gpu_tensor(g))
    assert not whole.gpu_tensor(1)[0].any()
    assert whole.verify("r", blocks, hashes, SALT, [(0, 61), (32, 61)]) == []


def test_compute_refuses_block_lists_that_do_not_cover_the_tokens() -> None:
    cp = CopyPath(Layout.of([fa(16)], tokens_per_hash=16), 8, 2, device="cpu")
    with pytest.raises(CopyPathError, match="group 0 has 2 blocks"):
        cp.compute([[1, 2]], HASHES, SALT, 0, 33)
    with pytest.raises(CopyPathError, match=r"block ids out of \[0, 8\)"):
        cp.compute([[1, 9]], HASHES, SALT, 0, 32)
    with pytest.raises(CopyPathError, match="2 block lists for 1 groups"):
        cp.compute([[1], [2]], HASHES, SALT, 0, 16)


# -- store and load (spec §8.2) ------------------------------------------------------------


def test_spec6_store_places_each_block_in_its_slot_and_sub_page(spec6: CopyPath) -> None:
    src = spec6_blocks(1)
    spec6.store(SPEC6_SIZES, SPEC6_INDICES, real(src), SPEC6_SLOTS)
    # group 0: skip 0, block i -> slots[i // 4], sub-page i % 4
    for i, b in enumerate(src[0]):
        assert torch.equal(spec6.cpu_tensor(0)[SPEC6_SLOTS[i // 4], i % 4], spec6.gpu_tensor(0)[b])
    # group 1: block index 59 -> skip 59 mod 4 = 3: its 2 blocks go to sub-page 3 of
    # slots[4] and sub-page 0 of slots[5]; the other sub-pages of those slots stay empty
    cpu1, gpu1 = spec6.cpu_tensor(1), spec6.gpu_tensor(1)
    assert torch.equal(cpu1[SPEC6_SLOTS[4], 3], gpu1[src[1][59]])
    assert torch.equal(cpu1[SPEC6_SLOTS[5], 0], gpu1[src[1][60]])
    assert not cpu1[SPEC6_SLOTS[4], :3].any() and not cpu1[SPEC6_SLOTS[5], 1:].any()
    # group 2: block index 472, skip 0, slots[6..9]
    for i, b in enumerate(src[2][472:]):
        assert torch.equal(spec6.cpu_tensor(2)[SPEC6_SLOTS[6 + i // 4], i % 4], spec6.gpu_tensor(2)[b])


def test_spec6_store_then_load_round_trip_restores_exactly_the_rows(spec6: CopyPath) -> None:
    src, dst = spec6_blocks(1), spec6_blocks(40)
    seconds = spec6.store(SPEC6_SIZES, SPEC6_INDICES, real(src), SPEC6_SLOTS)
    assert seconds >= 0
    spec6.load(SPEC6_SIZES, SPEC6_INDICES, real(dst), SPEC6_SLOTS)
    for g in range(3):
        for a, b in zip(real([src[g]]), real([dst[g]]), strict=True):
            assert torch.equal(spec6.gpu_tensor(g)[a], spec6.gpu_tensor(g)[b])
    assert spec6.verify("r", dst, HASHES, SALT, SPEC6_RANGES) == []
    # the window-aware range matters: token 3775 lives in a null block of group 1
    bad = spec6.verify("r", dst, HASHES, SALT, [(0, 0), (3775, 3904), (0, 0)])
    assert [(v.group, v.block_index, v.block_id, v.token, v.found) for v in bad] == [(1, 58, 0, 3775, 0)]


def test_bpc1_round_trip() -> None:
    layout = Layout.of([fa(16), GroupSpec(GroupKind.SLIDING_WINDOW, 32, window=64)], tokens_per_hash=16)
    cp = CopyPath(layout, 16, 6, device="cpu")
    src = [[1, 2, 3, 4], [5, 6]]
    cp.compute(src, HASHES, SALT, 0, 60)
    cp.store([4, 2], [0, 0], [1, 2, 3, 4, 5, 6], [5, 4, 3, 2, 1, 0])
    dst = [[7, 8, 9, 10], [11, 12]]
    cp.load([4, 2], [0, 0], [7, 8, 9, 10, 11, 12], [5, 4, 3, 2, 1, 0])
    assert torch.equal(cp.gpu_tensor(0)[7:11], cp.gpu_tensor(0)[1:5])
    assert torch.equal(cp.gpu_tensor(1)[11:13], cp.gpu_tensor(1)[5:7])
    assert cp.verify("r", dst, HASHES, SALT, [(0, 60), (0, 60)]) == []
    # a load of only the window part (block index 1 of group 1, skip 0 with bpc 1)
    cp.load([0, 1], [0, 1], [13], [0])
    assert torch.equal(cp.gpu_tensor(1)[13], cp.gpu_tensor(1)[6])
    assert cp.store([0, 0], [0, 0], [], []) == 0.0


@pytest.mark.parametrize(("sizes", "indices", "blocks", "slots", "message"), [
    ([16, 2, 16], [0, 59, 472], list(range(1, 36)), SPEC6_SLOTS, "consume 34 GPU block ids and 10 CPU slots"),
    ([16, 2, 16], [0, 59, 472], list(range(1, 35)), SPEC6_SLOTS[:-1], "the job has 34 and 9"),
    # skip 0 instead of 3 for group 1: only 9 slots are consumed
    ([16, 2, 16], [0, 60, 472], list(range(1, 35)), SPEC6_SLOTS, "consume 34 GPU block ids and 9 CPU"),
    ([16, 2], [0, 59], list(range(1, 19)), SPEC6_SLOTS[:6], "for 3 groups"),
    ([16, 2, 16], [0, 59, 472], [0, *range(2, 35)], SPEC6_SLOTS, "GPU block ids out of"),
    ([16, 2, 16], [0, 59, 472], list(range(1, 35)), [*SPEC6_SLOTS[:-1], 20], "CPU slots out of"),
    ([-1, 2, 16], [0, 59, 472], list(range(1, 18)), SPEC6_SLOTS[4:], "must be >= 0"),
])
def test_jobs_that_do_not_consume_their_lists_exactly_are_refused_before_copying(
        spec6: CopyPath, sizes: list[int], indices: list[int], blocks: list[int], slots: list[int],
        message: str) -> None:
    before = [spec6.cpu_tensor(g).clone() for g in range(3)]
    gpu_before = [spec6.gpu_tensor(g).clone() for g in range(3)]
    for op in (spec6.store, spec6.load):
        with pytest.raises(CopyPathError, match=message):
            op(sizes, indices, blocks, slots)
    assert all(torch.equal(spec6.cpu_tensor(g), before[g]) for g in range(3))
    assert all(torch.equal(spec6.gpu_tensor(g), gpu_before[g]) for g in range(3))


# -- the single-pass CPU copies against a straightforward reference ---------------------------


def ref_copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int]) -> None:
    """The reference: one row at a time, in job order."""
    for d, s in zip(dst_rows, src_rows, strict=True):
        dst[d] = src[s]


def row_pattern(rng: random.Random, kind: str, k: int, lo: int, hi: int) -> list[int]:
    """``k`` row numbers in ``[lo, hi)``, distinct unless ``kind`` is ``repeated``."""
    if kind == "run":
        a = rng.randrange(lo, hi - k + 1)
        return list(range(a, a + k))
    if kind == "reversed":
        a = rng.randrange(lo, hi - k + 1)
        return list(range(a + k - 1, a - 1, -1))
    if kind == "runs":  # shuffled runs of 2..5 consecutive rows
        length = rng.randrange(2, 6)
        pieces = [list(range(a, min(a + length, hi))) for a in range(lo, hi, length)]
        rng.shuffle(pieces)
        return [r for piece in pieces for r in piece][:k]
    if kind == "repeated":  # a short pattern over and over (sources only)
        pattern = rng.sample(range(lo, hi), rng.randrange(1, 4))
        return [pattern[i % len(pattern)] for i in range(k)]
    assert kind == "random"
    return rng.sample(range(lo, hi), k)


DST_KINDS = ["random", "run", "runs", "reversed"]
SRC_KINDS = [*DST_KINDS, "repeated"]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread: the bytes do not depend on it, and on a busy 2-core machine every
    parallel op of a second thread can wait a scheduler tick (these tests do thousands)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("row_words", [1, 16, 256, 2048, 4096])  # rows of 8 B .. 32 KiB
@pytest.mark.usefixtures("one_thread")
def test_one_pass_copies_the_same_bytes_as_the_reference_and_the_gather_scatter(row_words: int) -> None:
    rng = random.Random(row_words)
    gen = torch.Generator().manual_seed(row_words)
    src = torch.randint(-2**62, 2**62, (40, row_words), dtype=torch.int64, generator=gen)
    base = torch.randint(-2**62, 2**62, (48, row_words), dtype=torch.int64, generator=gen)
    used: set[str] = set()
    for dk in DST_KINDS:
        for sk in SRC_KINDS:
            for k in (1, 2, 3, 7, 24):
                dst_rows, src_rows = row_pattern(rng, dk, k, 0, 48), row_pattern(rng, sk, k, 0, 40)
                d_idx, s_idx = torch.tensor(dst_rows), torch.tensor(src_rows)
                want, old, new = base.clone(), base.clone(), base.clone()
                ref_copy_rows(want, dst_rows, src, src_rows)
                _gather_scatter(old, d_idx, src, s_idx, torch.empty(k, row_words, dtype=torch.int64))
                call = _one_pass(new, dst_rows, src, src_rows, row_words * 8)
                if call is None:
                    used.add("staging")
                else:
                    func = call.func  # type: ignore[attr-defined]
                    used.add(getattr(func, "__name__", str(func)))
                    call()
                    assert torch.equal(new, want), (dk, sk, k)
                assert torch.equal(old, want), (dk, sk, k)
    if row_words * 8 < 16384:  # small rows: one run (or long ones) by slices, the fused index ops, staging
        assert used == {"_foreach_copy_", "index_select", "index_copy_", "staging"}
    else:  # rows of 16 KiB and more: always run by run, in pieces
        assert used == {"_foreach_copy_"}


def test_one_pass_cuts_runs_into_pieces_below_the_parallel_grain_when_torch_has_threads() -> None:
    """Pieces of at most 32768 elements never wake torch's intra-op pool (which can wait a
    scheduler tick per op on a busy machine); with one thread, whole runs are copied."""
    src = torch.arange(40 * 4096, dtype=torch.int64).view(40, 4096)  # 32 KiB rows
    dst_rows, src_rows = [*range(3, 13), 20, 30], [*range(25, 35), 0, 5]  # runs of 10, 1, 1
    before = torch.get_num_threads()
    try:
        for threads, numels in ((2, [32768, 8192, 4096, 4096]), (1, [40960, 4096, 4096])):
            torch.set_num_threads(threads)
            dst, want = torch.zeros(40, 4096, dtype=torch.int64), torch.zeros(40, 4096, dtype=torch.int64)
            call = _one_pass(dst, dst_rows, src, src_rows, 4096 * 8)
            assert call is not None and call.func is torch._foreach_copy_  # type: ignore[attr-defined]
            assert [t.numel() for t in call.args[0]] == numels  # type: ignore[attr-defined]
            call()
            ref_copy_rows(want, dst_rows, src, src_rows)
            assert torch.equal(dst, want)
    finally:
        torch.set_num_threads(before)


def random_job(rng: random.Random, cp: CopyPath,
               store: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """A job with per-group patterns; destinations distinct within a group (as in any real job)."""
    bpc = cp.layout.blocks_per_chunk
    sizes, indices, blocks, slots = [], [], [], []
    for _ in cp.layout.groups:
        n = rng.choice([0, 1, 1, 2, 5, 9, 16])
        b = rng.randrange(0, 50)
        sizes.append(n)
        indices.append(b)
        if n == 0:
            continue
        m = -(-(n + b % bpc) // bpc)
        blocks += row_pattern(rng, rng.choice(SRC_KINDS if store else DST_KINDS), n, 1, cp.gpu_blocks)
        slots += row_pattern(rng, rng.choice(DST_KINDS if store else SRC_KINDS), m, 0, cp.cpu_slots)
    return sizes, indices, blocks, slots


def reference_job(gpu: list[torch.Tensor], cpu: list[torch.Tensor], bpc: int, store: bool, sizes: list[int],
                  indices: list[int], blocks: list[int], slots: list[int]) -> None:
    """Spec §8.2 placement, one row at a time."""
    goff = soff = 0
    for g, (n, b) in enumerate(zip(sizes, indices, strict=True)):
        if n == 0:
            continue
        skip = b % bpc
        for i in range(n):
            blk, slot, sub = blocks[goff + i], slots[soff + (skip + i) // bpc], (skip + i) % bpc
            if store:
                cpu[g][slot, sub] = gpu[g][blk]
            else:
                gpu[g][blk] = cpu[g][slot, sub]
        goff += n
        soff += -(-(n + skip) // bpc)


@pytest.mark.parametrize("mode", ["fingerprint", "realistic"])
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.usefixtures("one_thread")
def test_store_and_load_write_the_same_bytes_as_the_reference_and_the_gather_scatter(
        mode: Literal["fingerprint", "realistic"], bpc: int, pieces: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if pieces:  # as with a thread pool, and with pieces far smaller than rows and runs
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        monkeypatch.setattr(copypath, "_GRAIN", 1000)
    copied: list[int] = []  # elements per copy of the run-by-run path
    foreach_copy = torch._foreach_copy_

    def spy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        copied.extend(t.numel() for t in dst)
        foreach_copy(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    # rows of 128 B, 16 KiB + 8 B (int64 words), 32 KiB and 16 KiB + 1 B (uint8 words)
    groups = [GroupSpec(GroupKind.FULL, bs, bytes_per_block=b)
              for bs, b in ((16, 128), (2048, 16392), (4096, 32768), (16, 16385))]
    if mode == "fingerprint":
        groups = groups[:3]  # fingerprint rows: 128 B, 16 KiB, 32 KiB
    layout = Layout.of(groups, tokens_per_hash=16, blocks_per_chunk=bpc)
    new = CopyPath(layout, 40, 24, mode=mode, device="cpu")
    old = CopyPath(layout, 40, 24, mode=mode, device="cpu", single_pass=False)
    gen = torch.Generator().manual_seed(bpc)
    ref_gpu, ref_cpu = [], []
    for g in range(len(groups)):
        for side in (new.gpu_tensor, new.cpu_tensor):
            t = side(g)
            t.copy_(torch.randint(0, 127, t.shape, generator=gen).to(t.dtype))
        old.gpu_tensor(g).copy_(new.gpu_tensor(g))
        old.cpu_tensor(g).copy_(new.cpu_tensor(g))
        ref_gpu.append(new.gpu_tensor(g).clone())
        ref_cpu.append(new.cpu_tensor(g).clone())
    rng = random.Random(bpc)
    for j in range(120):
        store = j % 2 == 0
        job = random_job(rng, new, store)
        for cp in (new, old):
            assert (cp.store if store else cp.load)(*job) >= 0
        reference_job(ref_gpu, ref_cpu, bpc, store, *job)
        for g in range(len(groups)):
            assert torch.equal(new.gpu_tensor(g), ref_gpu[g]), (j, g, job)
            assert torch.equal(new.cpu_tensor(g), ref_cpu[g]), (j, g, job)
            assert torch.equal(old.gpu_tensor(g), ref_gpu[g]), (j, g, job)
            assert torch.equal(old.cpu_tensor(g), ref_cpu[g]), (j, g, job)
    assert (max(copied) <= 1000) if pieces else (max(copied) > 1000)


# -- verify ------------------------------------------------------------------------------


def test_verify_reports_exactly_the_corrupted_block(spec6: CopyPath) -> None:
    dst = spec6_blocks(40)
    spec6.store(SPEC6_SIZES, SPEC6_INDICES, real(spec6_blocks(1)), SPEC6_SLOTS)
    spec6.load(SPEC6_SIZES, SPEC6_INDICES, real(dst), SPEC6_SLOTS)
    row = spec6.gpu_tensor(0)[dst[0][5]]
    row[7] = 12345  # token 5 * 256 + 7
    row[9] = 777    # a second bad word in the same block: still one violation
    spec6.gpu_tensor(2)[dst[2][480], 0] = 0  # token 480 * 8 of group 2
    got = spec6.verify("r7", dst, HASHES, SALT, SPEC6_RANGES)
    assert got == [
        Violation("r7", 0, 5, dst[0][5], fp_ref(0, HASHES[:488], SALT, 8, 1287), 12345, 1287),
        Violation("r7", 2, 480, dst[2][480], fp_ref(2, HASHES[:488], SALT, 8, 3840), 0, 3840),
    ]


def test_verify_catches_swapped_slots_and_a_never_written_slot() -> None:
    layout = Layout.of([fa(16)], tokens_per_hash=16)
    cp = CopyPath(layout, 16, 8, device="cpu")
    cp.compute([[1, 2, 3]], HASHES, SALT, 0, 48)
    cp.store([3], [0], [1, 2, 3], [0, 1, 2])
    cp.load([3], [0], [4, 5, 6], [1, 0, 2])  # the first two slots swapped
    fp = fingerprints(0, HASHES, SALT, 16, 0, 48).tolist()
    assert cp.verify("a", [[4, 5, 6]], HASHES, SALT, [(0, 48)]) == [
        Violation("a", 0, 0, 4, fp[0], fp[16], 0),
        Violation("a", 0, 1, 5, fp[16], fp[0], 16),
    ]
    cp.load([1], [2], [7], [6])  # slot 6 was never written
    assert cp.verify("b", [[1, 2, 7]], HASHES, SALT, [(0, 48)]) == [Violation("b", 0, 2, 7, fp[32], 0, 32)]


def test_verify_reports_null_blocks_in_the_range() -> None:
    cp = CopyPath(Layout.of([fa(16)], tokens_per_hash=16), 8, 2, device="cpu")
    cp.compute([[0, 2]], HASHES, SALT, 0, 32)
    got = cp.verify("n", [[0, 2]], HASHES, SALT, [(4, 32)])
    assert [(v.block_index, v.block_id, v.token) for v in got] == [(0, 0, 4)]
    assert cp.verify("n", [[0, 2]], HASHES, SALT, [(16, 32)]) == []
    # even a null block that (wrongly) holds the right words must not be read
    cp.gpu_tensor(0)[0] = fingerprints(0, HASHES, SALT, 16, 0, 16)
    got = cp.verify("n", [[0, 2]], HASHES, SALT, [(4, 32)])
    assert [(v.block_id, v.token) for v in got] == [(0, 4)] and got[0].found == got[0].expected
    with pytest.raises(CopyPathError, match="1 ranges for"):
        CopyPath(SPEC6, 4, 1, device="cpu").verify("n", [[], [], []], HASHES, SALT, [(0, 0)])


# -- realistic mode ------------------------------------------------------------------------


def realistic_layout(bpc: int = 2) -> Layout:
    shape = KVShape(layers=2, kv_heads=2, head_size=8, dtype_bytes=2)  # 128 bytes per token
    return Layout.of([GroupSpec(GroupKind.FULL, 16, shape=shape),
                      GroupSpec(GroupKind.SLIDING_WINDOW, 32, window=64, shape=shape)],
                     tokens_per_hash=16, blocks_per_chunk=bpc)


def test_realistic_mode_sizes_tensors_by_the_layout_bytes_and_refuses_above_the_limit() -> None:
    layout = realistic_layout()
    need = (10 + 3 * 2) * (2048 + 4096)
    cp = CopyPath(layout, 10, 3, mode="realistic", device="cpu", memory_limit_bytes=need)
    assert cp.gpu_tensor(0).shape == (10, 2048) and cp.gpu_tensor(0).dtype == torch.uint8
    assert cp.cpu_tensor(1).shape == (3, 2, 4096)
    assert cp.nbytes == need
    fp_mode = CopyPath(layout, 10, 3, device="cpu")
    assert fp_mode.gpu_tensor(1).shape == (10, 32) and fp_mode.nbytes == (10 + 6) * (16 + 32) * 8
    with pytest.raises(ValueError, match=r"needs 98304 bytes \(96.00 KiB\) .* but memory_limit_bytes is "
                                         r"98303 bytes.*mode='fingerprint' \(needs 6.00 KiB\)") as info:
        CopyPath(layout, 10, 3, mode="realistic", device="cpu", memory_limit_bytes=need - 1)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="needs the KV bytes per block of group 0"):
        CopyPath(SPEC6, 10, 3, mode="realistic", device="cpu")
    with pytest.raises(ValueError, match="of RAM is available"):
        CopyPath(Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=2**40)], 16), 10**6, 1,
                 mode="realistic", device="cpu")
    with pytest.raises(ValueError, match="allowed: auto, cpu, cuda"):
        CopyPath(layout, 10, 3, device="tpu")


def test_realistic_mode_round_trip_moves_whole_rows_and_keeps_fingerprints_in_token_slices() -> None:
    cp = CopyPath(realistic_layout(), 12, 4, mode="realistic", device="cpu")
    gen = torch.Generator().manual_seed(1)
    for g in range(2):  # payload: random bytes everywhere but the null block
        cp.gpu_tensor(g)[1:] = torch.randint(0, 256, cp.gpu_tensor(g)[1:].shape, dtype=torch.uint8,
                                             generator=gen)
    src = [[1, 2, 3], [0, 4]]
    cp.compute(src, HASHES, SALT, 0, 40)
    fp = fingerprints(0, HASHES, SALT, 16, 0, 40)
    # token t of a block: bytes [t * 128, t * 128 + 8) hold its fingerprint, little-endian
    row = cp.gpu_tensor(0)[2]
    assert int.from_bytes(bytes(row[3 * 128: 3 * 128 + 8].tolist()), "little", signed=True) == int(fp[19])
    # group 0: block indices 0..2 (skip 0) -> slots 3, 1; group 1: block index 1 -> skip 1 -> slot 0
    cp.store([3, 1], [0, 1], [1, 2, 3, 4], [3, 1, 0])
    dst = [[5, 6, 7], [0, 8]]
    cp.load([3, 1], [0, 1], [5, 6, 7, 8], [3, 1, 0])
    assert torch.equal(cp.gpu_tensor(0)[5:8], cp.gpu_tensor(0)[1:4])  # payload bytes moved too
    assert torch.equal(cp.gpu_tensor(1)[8], cp.gpu_tensor(1)[4])
    assert torch.equal(cp.cpu_tensor(1)[0, 1], cp.gpu_tensor(1)[4])
    assert cp.verify("r", dst, HASHES, SALT, [(0, 40), (32, 40)]) == []
    cp.gpu_tensor(0)[6, 5 * 128 + 8] ^= 0xFF  # payload byte: not interpreted
    assert cp.verify("r", dst, HASHES, SALT, [(0, 40), (32, 40)]) == []
    cp.gpu_tensor(0)[6, 5 * 128 + 7] ^= 0x01  # top byte of token 21's fingerprint
    got = cp.verify("r", dst, HASHES, SALT, [(0, 40), (32, 40)])
    assert [(v.group, v.block_index, v.block_id, v.token, v.expected) for v in got] == [
        (0, 1, 6, 21, int(fp[21]))]
    assert got[0].found == int(fp[21]) ^ (1 << 56)


def test_realistic_mode_with_under_8_bytes_per_token_stores_the_low_bytes() -> None:
    layout = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=16 * 4)], tokens_per_hash=16)
    cp = CopyPath(layout, 6, 2, mode="realistic", device="cpu")
    cp.compute([[1, 2]], HASHES, SALT, 0, 32)
    cp.store([2], [0], [1, 2], [1, 0])
    cp.load([1], [1], [3], [0])
    assert cp.verify("r", [[1, 3]], HASHES, SALT, [(0, 32)]) == []
    cp.load([1], [0], [4], [1])
    cp.load([1], [0], [5], [1])
    cp.gpu_tensor(0)[5].zero_()
    fp = fingerprints(0, HASHES, SALT, 16, 0, 32)
    assert cp.verify("r", [[5, 4]], HASHES, SALT, [(0, 16)]) == [
        Violation("r", 0, 0, 5, int(fp[0]) & 0xFFFFFFFF, 0, 0)]
    # block 4 holds tokens 0..15, read as tokens 16..31: a mismatch on the first word
    assert [v.token for v in cp.verify("r", [[5, 4]], HASHES, SALT, [(16, 32)])] == [16]


# -- calibrate ---------------------------------------------------------------------------


def test_calibrate_on_cpu_returns_bandwidths_ratios_and_a_usable_snippet() -> None:
    t0 = time.perf_counter()
    result = calibrate("cpu", chunk_bytes=(4096, 65536), batch_sizes=(1, 8), repeats=2,
                       max_job_bytes=65536 * 4)
    assert time.perf_counter() - t0 < 5
    assert [(r["chunk_bytes"], r["batch"]) for r in result["rows"]] == [(4096, 1), (4096, 8), (65536, 1)]
    assert result["skipped"] == [(65536, 8)]
    for r in result["rows"]:
        for key in ("h2d_gbps", "d2h_gbps", "contig_h2d_gbps", "contig_d2h_gbps", "h2d_ratio", "d2h_ratio"):
            assert r[key] > 0, key
        assert r["h2d_gbps"] == pytest.approx(r["job_bytes"] / r["h2d_s"] / 1e9)
    for d in ("h2d", "d2h"):
        assert result[f"{d}_bandwidth"] > 0 and result[f"contig_{d}_bandwidth"] > 0
        assert result[f"{d}_latency_s"] >= 0 and result[f"{d}_ratio"] > 0
    assert result["ratio"] == min(result["h2d_ratio"], result["d2h_ratio"])
    assert result["device"] == "cpu"
    snippet = hardware_snippet(result)
    keys = tomllib.loads(snippet)
    assert set(keys) == {"h2d_bandwidth", "d2h_bandwidth", "h2d_latency_s", "d2h_latency_s"}
    section = HardwareSection.model_validate(keys)
    assert section.h2d_bandwidth == pytest.approx(result["h2d_bandwidth"], rel=1e-3)
    HardwareFile.model_validate(tomllib.loads(
        'schema = "hardware/1"\nname = "here"\ngpu = "h200"\nhbm_bytes = "141GB"\n' + snippet))
    with pytest.raises(ValueError, match="above max_job_bytes"):
        calibrate("cpu", chunk_bytes=(4096,), batch_sizes=(4,), repeats=1, max_job_bytes=100)


def test_cli_calibrate_prints_the_table_and_writes_the_snippet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hw.toml"
    code = main(["calibrate", "--device", "cpu", "--chunk-bytes", "4KiB,16KiB", "--batch", "1,4",
                 "--repeats", "1", "--out", str(out)])
    stdout, _ = capsys.readouterr()
    assert code == 0
    lines = stdout.splitlines()
    assert "chunks/job" in lines[1] and "ratio" in lines[1]
    assert [line.split()[:3] for line in lines[2:6]] == [
        ["4.00", "KiB", "1"], ["4.00", "KiB", "4"], ["16.00", "KiB", "1"], ["16.00", "KiB", "4"]]
    written = out.read_text()
    assert stdout.endswith(written)
    HardwareSection.model_validate(tomllib.loads(written))
    assert [p.name for p in tmp_path.iterdir()] == ["hw.toml"]  # no temporary file left


@pytest.mark.parametrize(("args", "prefix"), [
    (["--chunk-bytes", "4XB"], "argument:--chunk-bytes: unknown unit"),
    (["--batch", "0"], "argument:--batch: '0'"),
    (["--batch", "x"], "argument:--batch:"),
    (["--repeats", "0"], "argument:--repeats: 0"),
    (["--chunk-bytes", "4KiB", "--batch", "1", "--repeats", "1", "--out", "/nonexistent/dir/hw.toml"],
     "argument:--out: '/nonexistent/dir/hw.toml'"),
])
def test_cli_calibrate_bad_arguments_exit_2_with_one_line(
        args: list[str], prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvsim: error: {prefix}"), err


# -- torch stays optional -------------------------------------------------------------------

NO_TORCH = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any "import torch" now raises ImportError
import sim
for m in pkgutil.iter_modules(sim.__path__):
    if m.name != "copypath":
        importlib.import_module("sim." + m.name)
from sim.cli import main
assert main(["validate", "scenarios/default.toml"]) == 0
assert main(["check", "scenarios/crash/e02-group1-chunk2-absent.toml"]) in (0, 1)
print("EXIT", main(["calibrate", "--device", "cpu"]))
"""

CLEAN = """
import importlib, pkgutil, sys
import sim
for m in pkgutil.iter_modules(sim.__path__):
    if m.name != "copypath":
        importlib.import_module("sim." + m.name)
import sim.cli
sim.cli.build_parser()
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
"""


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_package_works_without_torch_and_calibrate_says_how_to_get_it() -> None:
    proc = run_python(NO_TORCH)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "EXIT 2"
    assert proc.stderr.strip().splitlines()[-1] == (
        "kvsim: error: calibrate: torch is not installed; allowed: pip install 'kvsim[torch]'")


def test_no_module_but_copypath_imports_torch() -> None:
    proc = run_python(CLEAN)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
