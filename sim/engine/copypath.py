"""The torch data path: real GPU/CPU tensors and the copies of the worker (spec §8).

What it models
    The OffloadingConnector worker's view of KV memory (spec §8.1): per KV
    cache group ``g`` a GPU tensor with one row per GPU block, and a CPU tensor
    with one row per CPU slot holding ``blocks_per_chunk`` (``bpc``) sub-pages.
    A load or store job is turned into copies exactly as spec §8.2 describes
    (per group in order, ``skip = block_indices[g] mod bpc`` sub-pages skipped
    in the first chunk, the flat GPU block and CPU slot lists consumed exactly),
    and :meth:`CopyPath.verify` checks that what a request is about to read is
    what it would have computed. The simulator's bookkeeping (which block ids,
    which slots) is thereby checked against real bytes moved by real copies.

    Token contents are *fingerprints*: one 64-bit word per token,
    ``fp(g, h, p)``, a mix of the group, the chained prefix hash ``h`` of the
    token's hash block (or a request-private salt for a token in an incomplete
    hash block) and the absolute token position ``p``. Two requests that share
    a prefix therefore write identical bytes for it, as real KV would be.

Modes
    ``fingerprint``
        Group ``g``'s GPU tensor is int64 ``[gpu_blocks, bs_g * FP_WORDS]``
        (``bs_g`` tokens per block, word 0 of each token's slice holds the
        fingerprint); the CPU tensor is ``[cpu_slots, bpc, bs_g * FP_WORDS]``.
        Small: 8 bytes per token.
    ``realistic``
        Rows have the layout's real size: the GPU tensor is uint8
        ``[gpu_blocks, B_g]`` with ``B_g = Layout.kv_bytes_per_block(g)``. The
        row is read as ``bs_g`` token slices of ``S = B_g // bs_g`` bytes
        (token ``t`` of the block at bytes ``[t*S, (t+1)*S)``; the
        ``B_g mod bs_g`` bytes at the end of the row belong to no token). The
        fingerprint is stored little-endian in the first ``min(8, S)`` bytes of
        the token's slice; when ``S < 8`` only its low ``S`` bytes are stored and
        compared (weaker, but such tiny blocks only occur in toy layouts). The
        other bytes are payload that is copied but never interpreted. Copies
        move whole rows through the widest integer view that divides the row
        (int64 whenever the row is a multiple of 8 bytes), since torch's
        byte-wise index kernels are several times slower.

Writes and checks
    :meth:`CopyPath.compute` writes the fingerprints of the tokens a step
    computed, for all groups with one set of vectorised mixes and one
    ``index_put_`` per group; steps of at most ``_FEW_TOKENS`` tokens (decode)
    compute the same words in Python ints, since a dozen torch calls on tiny
    tensors cost more (about 30 us instead of 550 us for one token of three
    groups on a 2-core machine; tested to agree). :meth:`CopyPath.verify` is
    vectorised per group and reports the first differing word of each block.

Copies
    CPU device: every byte moves once, per group and job (:func:`_one_pass`).
    Rows of at least ``_RUN_BYTES`` (16 KiB), or runs of rows consecutive on
    both sides that average that much, are copied run by run as memcpys, all
    in one ``torch._foreach_copy_``; with more than one torch thread, in
    pieces of at most ``_GRAIN`` (32768) elements: a piece that small runs on
    the calling thread, whereas every copy that wakes torch's intra-op pool
    waits a scheduler tick on a busy machine. Smaller rows whose destination
    rows form one run take one ``index_select(..., out=dst[a:b])``, whose
    source rows form one run one ``index_copy_``. Only small rows with neither
    side contiguous still gather into a reused staging buffer and scatter from
    it: one torch call per run would cost more than the second pass over the
    bytes. The timed part is the copy calls (``time.perf_counter``); the
    planning before them (row lists, runs, views, index tensors) is not, as
    the index tensors never were. The plan is built in Python lists (cheaper
    than torch calls for jobs of tens to hundreds of blocks), index tensors
    only where an index op needs them. ``CopyPath(single_pass=False)`` keeps
    the former gather/scatter for every job (a reference for tests and
    ``benchmarks/bench_copypath.py``).

    CUDA device: the CPU tensors are pinned. A load gathers the job's CPU
    sub-pages into a pinned staging buffer (host memcpy), then, on a dedicated
    H2D stream that first waits for the current (compute) stream, does one
    contiguous H2D copy of the whole job and one device-side ``index_copy_``
    per group. A store is the mirror on a D2H stream: device-side
    ``index_select`` per group into a device staging buffer, one contiguous
    D2H copy into pinned staging, then host-side ``index_copy_`` into the CPU
    rows. The measured time is the device part (CUDA events on the stream)
    plus the host gather/scatter (``perf_counter``). Each call waits for its
    copy to finish: the simulated clock, not CUDA, decides when a job is
    complete, so jobs of one direction are trivially in submission order.

Simplifications relative to vLLM
    * One tensor per group, not one per layer or per shared KV tensor; a row
      is a whole block across the group's layers (spec §8.1's per-layer pages
      are concatenated). Transfer bytes per block equal spec §8.4's.
    * vLLM copies each page with its own DMA descriptor
      (``cuMemcpyBatchAsync`` / Triton), with no host-side gather; the host
      gather/scatter here makes measured CUDA times pessimistic for small
      pages. ``kvsim calibrate`` measures exactly this path. The cost model
      (``timing = "model"``) charges vLLM's pieces instead: one page per layer
      per block, or one packed block (:func:`sim.model.costs.pieces_per_block`,
      ``docs/costs.md``).

Invariants
    * A row that was never written is all zeros, and ``fp`` is never 0, so a
      read of never-written memory is always a mismatch.
    * The null block (GPU block id 0) is never written by :meth:`compute`,
      never a copy source or destination (:class:`CopyPathError`), and is a
      violation wherever :meth:`verify` is asked to read it.

torch is an optional dependency: only import this module when the copy path
is enabled.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from sim.model.layout import GroupKind, GroupSpec, Layout, cdiv

__all__ = [
    "FP_WORDS",
    "CopyPath",
    "CopyPathError",
    "Violation",
    "calibrate",
    "calibration_table",
    "fingerprints",
    "hardware_snippet",
]

#: int64 words per token in fingerprint mode (word 0 holds the fingerprint)
FP_WORDS = 1
#: :meth:`CopyPath.compute` of at most this many tokens computes in Python ints
_FEW_TOKENS = 4

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """A Python int folded to the signed int64 with the same low 64 bits."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


# splitmix64 finalizer constants (Steele, Lea, Flood 2014), and two odd
# multipliers: the golden-ratio gamma for groups, another for positions
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)
_GAMMA = 0x9E3779B97F4A7C15
_POS = _s64(0xD1B54A32D192ED03)


def _mix_int(x: int) -> int:
    """The 64-bit mix on one Python int (unsigned result)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The same mix on an int64 tensor: multiplications wrap modulo 2**64 and the
    right shifts are made logical by masking the sign-extended bits."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _group_key(group: int) -> int:
    return _s64(_mix_int((group + 1) * _GAMMA))


def _fp_int(key: int, h: int, p: int) -> int:
    """One fingerprint in Python ints (signed), for ranges of a few tokens."""
    x = _mix_int(h ^ key)
    return _s64(_mix_int(x + (p + 1) * _POS) or 1)


def _as_int64(values: Sequence[int]) -> torch.Tensor:
    """Hashes as an int64 tensor (bits of larger or unsigned ints folded modulo 2**64).

    ``array('q')`` and memoryviews of 8-byte integers are read without a Python loop.
    """
    if isinstance(values, array | memoryview):
        mv = memoryview(values)
        if len(mv) == 0:
            return torch.empty(0, dtype=torch.int64)
        if mv.itemsize == 8 and mv.format in ("q", "Q", "l", "L") and mv.c_contiguous and not mv.readonly:
            return torch.frombuffer(mv, dtype=torch.int64)
        values = mv.tolist()
    try:
        return torch.tensor(values if isinstance(values, list | tuple) else list(values), dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):
        return torch.tensor([_s64(int(v)) for v in values], dtype=torch.int64)


def fingerprints(group: int, block_hashes: Sequence[int], salt: int, tph: int, start: int, end: int,
                 *, device: str | torch.device = "cpu") -> torch.Tensor:
    """Fingerprints of tokens ``[start, end)`` of one request in one group.

    ``fp(g, h, p) = mix(mix(h XOR key(g)) + (p + 1) * K)`` over 64-bit words,
    with ``mix`` the splitmix64 finalizer, ``key(g) = mix((g + 1) * gamma)`` and
    ``K`` an odd constant; ``h = block_hashes[p // tph]`` when that hash block is
    complete (``p // tph < len(block_hashes)``), else ``salt``. A result of 0 is
    replaced by 1, so 0 always means "never written".

    Args:
        group: KV cache group index.
        block_hashes: chained hashes of the request's complete hash blocks
            (any int sequence; ``array('q')`` is read without copying).
        salt: request-private value for tokens of the incomplete last hash block.
        tph: tokens per hash block.
        start: first token position.
        end: one past the last token position.
        device: where the result lives.

    Returns:
        int64 tensor of shape ``[end - start]``.

    Raises:
        ValueError: ``start`` / ``end`` / ``tph`` out of range.
    """
    if tph <= 0 or start < 0 or end < start:
        raise ValueError(f"fingerprints: bad range tph={tph} start={start} end={end}")
    return _fingerprint_table((group,), block_hashes, salt, tph, start, end, torch.device(device))[0]


def _fingerprint_table(groups: Sequence[int], block_hashes: Sequence[int], salt: int, tph: int, start: int,
                       end: int, dev: torch.device) -> torch.Tensor:
    """:func:`fingerprints` of several groups at once: int64 ``[len(groups), end - start]``.

    The mixes run once over all groups, so the number of torch calls does not
    grow with the number of groups (a decode step writes one token per group).
    """
    n = end - start
    if n == 0:
        return torch.empty((len(groups), 0), dtype=torch.int64, device=dev)
    lo = start // tph
    hi = min(len(block_hashes), cdiv(end, tph))
    salt_t = torch.tensor([_s64(salt)], dtype=torch.int64)
    if hi > lo:
        parts = [_as_int64(block_hashes[lo:hi])]
        if hi * tph < end:
            parts.append(salt_t)  # the tokens past the last complete hash block
        hb = torch.cat(parts).to(dev)  # one value per hash block touched
    else:
        hb = salt_t.to(dev)
    keys = torch.tensor([_group_key(g) for g in groups], dtype=torch.int64, device=dev)
    xb = _mix(hb[None, :] ^ keys[:, None])  # [G, hash blocks]
    pos = torch.arange(start, end, dtype=torch.int64, device=dev)
    x = xb[:, torch.clamp(pos // tph - lo, max=hb.numel() - 1)]
    fp = _mix(x + (pos + 1) * _POS)
    return fp.masked_fill_(fp == 0, 1)


class CopyPathError(RuntimeError):
    """The simulator asked for an impossible copy (a kvsim bug, not bad input)."""


@dataclass(frozen=True, slots=True)
class Violation:
    """A request would read a block that does not hold what it computed.

    Attributes:
        req_id: the reading request.
        group: KV cache group.
        block_index: logical block index in the request's block list of ``group``.
        block_id: GPU block id (0: the null block).
        expected: the first differing fingerprint word, as computed.
        found: what the block held there (0: never written).
        token: absolute token position of that word.
    """

    req_id: str
    group: int
    block_index: int
    block_id: int
    expected: int
    found: int
    token: int


@dataclass(slots=True)
class _Group:
    """Tensors and views of one KV cache group."""

    bs: int                    #: tokens per block
    row_bytes: int             #: bytes of one block row
    gpu: torch.Tensor          #: [gpu_blocks, row] (int64 words or uint8 bytes)
    cpu: torch.Tensor          #: [cpu_slots, bpc, row]
    gpu_w: torch.Tensor        #: [gpu_blocks, row_words] copy view
    cpu_w: torch.Tensor        #: [cpu_slots * bpc, row_words] copy view
    tok: torch.Tensor          #: fingerprint view: [gpu_blocks, bs] int64 or [gpu_blocks, bs, width] uint8
    width: int                 #: fingerprint bytes stored per token (8: the full word)


def _word_dtype(row_bytes: int) -> torch.dtype:
    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0:
            return dt
    return torch.uint8


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _exact(n: int) -> str:
    return f"{n} bytes ({_fmt_bytes(n)})"


def _available_ram() -> int | None:
    """``MemAvailable`` from /proc/meminfo, else free pages x page size, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available to torch {torch.__version__}; "
                             "allowed: cpu, auto")
        return device
    raise ValueError(f"device {device!r} is unknown; allowed: auto, cpu, cuda, cuda:N")


def _cuda_stream(dev: torch.device) -> Any:
    return torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _low_bytes(fp: torch.Tensor, width: int) -> torch.Tensor:
    """The ``width`` low-order bytes of each int64 word, as uint8 ``[n, width]`` (little-endian order)."""
    b = fp.contiguous().view(torch.uint8).view(-1, 8)
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI
        b = b.flip(1)
    return b[:, :width]


def _bytes_to_word(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_low_bytes`: uint8 ``[n, width]`` -> int64 ``[n]`` (missing high bytes 0)."""
    n, width = b.shape
    full = b if width == 8 else torch.cat(
        [b, torch.zeros((n, 8 - width), dtype=torch.uint8, device=b.device)], dim=1)
    if sys.byteorder == "big":  # pragma: no cover
        full = full.flip(1)
    return full.contiguous().view(torch.int64).view(-1)


#: a job's rows are copied one run at a time when its runs of rows (consecutive on
#: both sides) average at least this many bytes; below, one torch call per run
#: costs more than a second pass over the bytes (16 KiB rows break even on a 2-core VM)
_RUN_BYTES = 16 * 1024
#: torch runs an op on at most this many elements on the calling thread
#: (``at::internal::GRAIN_SIZE``); a larger one wakes the intra-op thread pool,
#: which on a busy machine (``kvsim sweep --jobs N`` on N cores) waits a scheduler
#: tick, about 16 ms, per op
_GRAIN = 32768


def _is_run(rows: list[int]) -> bool:
    """Whether ``rows`` (non-empty) are consecutive ascending integers, i.e. one slice."""
    n = len(rows)
    return rows[-1] - rows[0] == n - 1 and (n < 3 or rows == list(range(rows[0], rows[0] + n)))


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(source row, destination row, length)`` of pairs consecutive on both sides, in order."""
    out = []
    s0, d0, k = src[0], dst[0], 1
    for i in range(1, len(src)):
        s, d = src[i], dst[i]
        if s == s0 + k and d == d0 + k:
            k += 1
        else:
            out.append((s0, d0, k))
            s0, d0, k = s, d, 1
    out.append((s0, d0, k))
    return out


def _one_pass(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int],
              row_bytes: int) -> Callable[[], object] | None:
    """Rows ``src[src_rows[i]] -> dst[dst_rows[i]]`` as one prepared call that moves each byte once.

    ``dst`` and ``src`` are contiguous 2-D tensors of the same row width,
    ``row_bytes`` the bytes of one row. Destination rows are distinct (a job
    never writes a row twice), so the order of the row copies does not matter.
    Measured on a 2-core VM (``benchmarks/bench_copypath.py``):

    * rows of ``_RUN_BYTES`` or more, runs (rows consecutive on both sides)
      that average that much, or one run: a memcpy per run, all in one
      ``torch._foreach_copy_``, the runs cut into pieces of at most ``_GRAIN``
      elements so that none wakes torch's thread pool (unless torch has one
      thread, where whole runs cost fewer calls). Per-row ``copy_`` calls that
      each wake the pool lose a scheduler tick apiece on a busy machine;
      ``index_copy_`` is an element-wise kernel, slower for large rows even
      from a contiguous source.
    * smaller rows, destination rows one run:
      ``torch.index_select(src, 0, src_idx, out=dst[a:b])``;
    * smaller rows, source rows one run: ``dst.index_copy_(0, dst_idx, src[a:b])``.

    Returns:
        The call, or None for rows under ``_RUN_BYTES`` with neither side
        contiguous and short runs, where a gather into staging and a scatter
        cost less than one torch call per run.
    """
    n = len(dst_rows)
    runs: list[tuple[int, int, int]] | None = None
    if row_bytes * 16 >= _RUN_BYTES:  # shorter rows would need runs of 16+ rows to pay
        runs = _runs(src_rows, dst_rows)
    elif _is_run(src_rows) and _is_run(dst_rows):
        runs = [(src_rows[0], dst_rows[0], n)]
    if runs is not None and (len(runs) == 1 or row_bytes * n >= _RUN_BYTES * len(runs)):
        w = dst.shape[1]
        dflat, sflat = dst.view(-1), src.view(-1)
        dv: list[torch.Tensor] = []
        sv: list[torch.Tensor] = []
        if torch.get_num_threads() == 1:  # no thread pool to keep out of: whole runs
            for s, d, k in runs:
                dv.append(dflat[d * w: (d + k) * w])
                sv.append(sflat[s * w: (s + k) * w])
        else:
            for s, d, k in runs:
                dv += torch.split(dflat[d * w: (d + k) * w], _GRAIN)
                sv += torch.split(sflat[s * w: (s + k) * w], _GRAIN)
        return partial(torch._foreach_copy_, dv, sv)
    if _is_run(dst_rows):
        src_idx = torch.tensor(src_rows, dtype=torch.int64)
        return partial(torch.index_select, src, 0, src_idx, out=dst[dst_rows[0]: dst_rows[0] + n])
    if _is_run(src_rows):
        dst_idx = torch.tensor(dst_rows, dtype=torch.int64)
        return partial(dst.index_copy_, 0, dst_idx, src[src_rows[0]: src_rows[0] + n])
    return None


def _index_tensors(plan: Sequence[tuple[int, list[int], list[int]]]
                   ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """A job plan with int64 index tensors in place of the row lists."""
    return [(g, torch.tensor(ids, dtype=torch.int64), torch.tensor(flat, dtype=torch.int64))
            for g, ids, flat in plan]


def _gather_scatter(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor,
                    stage: torch.Tensor) -> None:
    """The two-pass copy: ``src`` rows gathered into ``stage``, then scattered into ``dst``."""
    torch.index_select(src, 0, src_idx, out=stage)
    dst.index_copy_(0, dst_idx, stage)


class CopyPath:
    """GPU and CPU KV tensors of every group, and the worker's copies between them.

    Args:
        layout: the groups, ``tokens_per_hash`` and ``blocks_per_chunk``.
        gpu_blocks: GPU block pool size, null block (id 0) included.
        cpu_slots: CPU cache capacity in chunk slots.
        mode: ``fingerprint`` (8 bytes per token) or ``realistic`` (the
            layout's bytes per block; every group needs them).
        device: ``auto`` (cuda when torch sees one, else cpu), ``cpu``, ``cuda``
            or ``cuda:N``.
        memory_limit_bytes: refuse when all tensors together would exceed
            this; None: the GPU side must fit free device memory (on cuda) and
            the CPU side available RAM (both sides on cpu).
        single_pass: on the cpu device, copy every byte once (:func:`_one_pass`);
            False: the former gather into staging and scatter for every job (a
            reference for tests and benchmarks). No effect on cuda.

    Raises:
        ValueError: bad argument, or the tensors would not fit (one line with
            the bytes needed, the limit, and what to change).
    """

    def __init__(self, layout: Layout, gpu_blocks: int, cpu_slots: int, *,
                 mode: Literal["fingerprint", "realistic"] = "fingerprint", device: str = "auto",
                 memory_limit_bytes: int | None = None, single_pass: bool = True) -> None:
        if mode not in ("fingerprint", "realistic"):
            raise ValueError(f"copy path mode {mode!r} is unknown; allowed: fingerprint, realistic")
        if gpu_blocks < 1 or cpu_slots < 1:
            raise ValueError(f"copy path: gpu_blocks={gpu_blocks}, cpu_slots={cpu_slots}; allowed: >= 1 each")
        self._device = _resolve_device(device)
        self._dev = torch.device(self._device)
        self._cuda = self._dev.type == "cuda"
        self._single_pass = single_pass
        self.layout = layout
        self.mode = mode
        self.gpu_blocks = gpu_blocks
        self.cpu_slots = cpu_slots
        bpc = layout.blocks_per_chunk
        self._bpc = bpc
        self._tph = layout.tokens_per_hash

        rows: list[int] = []
        for g, spec in enumerate(layout.groups):
            if mode == "fingerprint":
                rows.append(spec.tokens_per_block * FP_WORDS * 8)
                continue
            b = layout.kv_bytes_per_block(g)
            if b is None:
                raise ValueError(f"copy path: realistic mode needs the KV bytes per block of group {g} "
                                 "(a shape or bytes_per_block); allowed: a model with shapes, or "
                                 "mode='fingerprint'")
            if b < spec.tokens_per_block:
                raise ValueError(f"copy path: group {g} has {b} bytes per block for "
                                 f"{spec.tokens_per_block} tokens, under 1 byte per token; "
                                 "allowed: mode='fingerprint'")
            rows.append(b)
        self._check_memory(rows, memory_limit_bytes)

        self._groups: list[_Group] = []
        for g, spec in enumerate(layout.groups):
            self._groups.append(self._allocate(spec.tokens_per_block, rows[g]))
        #: staging for batched copies, grown on demand, reused by every job
        self._stage_host = torch.empty(0, dtype=torch.uint8, pin_memory=self._cuda)
        self._stage_dev = torch.empty(0, dtype=torch.uint8, device=self._dev)
        self._streams: dict[str, Any] = {}
        if self._cuda:
            self._streams = {"h2d": _cuda_stream(self._dev), "d2h": _cuda_stream(self._dev)}

    # -- construction ------------------------------------------------------------

    def _check_memory(self, rows: Sequence[int], limit: int | None) -> None:
        per_row = sum(rows)
        gpu_need = self.gpu_blocks * per_row
        cpu_need = self.cpu_slots * self._bpc * per_row
        fp_row = sum(s.tokens_per_block * FP_WORDS * 8 for s in self.layout.groups)
        fp_need = (self.gpu_blocks + self.cpu_slots * self._bpc) * fp_row
        hint = ("mode='fingerprint' (needs " + _fmt_bytes(fp_need) + ") or " if self.mode == "realistic"
                else "")
        change = f"allowed: {hint}fewer GPU blocks / CPU slots, or a larger memory limit"
        what = f"the copy path ({self.mode} mode) needs {_exact(gpu_need + cpu_need)} " \
               f"(GPU side {_fmt_bytes(gpu_need)} + CPU side {_fmt_bytes(cpu_need)})"
        if limit is not None:
            if gpu_need + cpu_need > limit:
                raise ValueError(f"{what} but memory_limit_bytes is {_exact(limit)}; {change}")
            return
        ram = _available_ram()
        if self._cuda:
            free, _total = torch.cuda.mem_get_info(self._dev)
            if gpu_need > free:
                raise ValueError(f"{what} but {self._device} has {_exact(free)} free; {change}")
            if ram is not None and cpu_need > ram:
                raise ValueError(f"{what} but {_exact(ram)} of RAM is available; {change}")
        elif ram is not None and gpu_need + cpu_need > ram:
            raise ValueError(f"{what} but {_exact(ram)} of RAM is available; {change}")

    def _allocate(self, bs: int, row_bytes: int) -> _Group:
        n, slots, bpc = self.gpu_blocks, self.cpu_slots, self._bpc
        if self.mode == "fingerprint":
            words = bs * FP_WORDS
            gpu = torch.zeros((n, words), dtype=torch.int64, device=self._dev)
            cpu = torch.zeros((slots, bpc, words), dtype=torch.int64, pin_memory=self._cuda)
            tok = gpu.view(n, bs, FP_WORDS)[:, :, 0]
            width = 8
            wdt = torch.int64
        else:
            gpu = torch.zeros((n, row_bytes), dtype=torch.uint8, device=self._dev)
            cpu = torch.zeros((slots, bpc, row_bytes), dtype=torch.uint8, pin_memory=self._cuda)
            s = row_bytes // bs
            width = min(8, s)
            tok = gpu[:, : bs * s].view(n, bs, s)[:, :, :width]
            wdt = _word_dtype(row_bytes)
        gpu_w = gpu.view(wdt)
        cpu_w = cpu.view(slots * bpc, -1).view(wdt)
        return _Group(bs, row_bytes, gpu, cpu, gpu_w, cpu_w, tok, width)

    # -- inspection --------------------------------------------------------------

    @property
    def device(self) -> str:
        """The resolved device: ``cpu``, ``cuda`` or ``cuda:N``."""
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes of the GPU-side and CPU-side tensors (staging buffers excluded)."""
        return sum(g.gpu.nbytes + g.cpu.nbytes for g in self._groups)

    def gpu_tensor(self, group: int) -> torch.Tensor:
        """Group ``group``'s GPU tensor ``[gpu_blocks, row]`` (for tests and debugging)."""
        return self._groups[group].gpu

    def cpu_tensor(self, group: int) -> torch.Tensor:
        """Group ``group``'s CPU tensor ``[cpu_slots, bpc, row]`` (for tests and debugging)."""
        return self._groups[group].cpu

    # -- compute and verify ---------------------------------------------------------

    def _block_ids(self, g: int, blocks: Sequence[int], b_lo: int, b_hi: int, start: int, end: int,
                   what: str) -> list[int]:
        """``blocks[b_lo:b_hi]`` as a list, checked to exist and to be valid ids."""
        if b_hi > len(blocks):
            raise CopyPathError(f"{what}: group {g} has {len(blocks)} blocks but tokens "
                                f"[{start}, {end}) need {b_hi}")
        ids = list(blocks[b_lo:b_hi])
        if ids and (min(ids) < 0 or max(ids) >= self.gpu_blocks):
            raise CopyPathError(f"{what}: group {g} block ids out of [0, {self.gpu_blocks}): {ids}")
        return ids

    def _token_blocks(self, g: int, blocks: Sequence[int], start: int, end: int,
                      what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block id, offset in block, logical block index) of each token in ``[start, end)``."""
        bs = self._groups[g].bs
        b_lo, b_hi = start // bs, cdiv(end, bs)
        ids = torch.tensor(self._block_ids(g, blocks, b_lo, b_hi, start, end, what), dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        bidx = pos // bs
        tok_ids = ids[bidx - b_lo]
        return tok_ids.to(self._dev), (pos % bs).to(self._dev), bidx

    def compute(self, group_blocks: Sequence[Sequence[int]], block_hashes: Sequence[int], salt: int,
                start: int, end: int) -> None:
        """A step computed tokens ``[start, end)`` of a request: write their fingerprints.

        Token ``p`` of group ``g`` goes to block ``group_blocks[g][p // bs_g]`` at
        offset ``p % bs_g``; null-block entries (id 0: outside the window) are
        skipped. One ``index_put_`` per group.

        Args:
            group_blocks: the request's block ids per group.
            block_hashes: the request's complete block hashes.
            salt: request-private salt for the incomplete last hash block.
            start: first computed token.
            end: one past the last computed token.

        Raises:
            CopyPathError: a group's block list does not cover ``end``, or ids are out of range.
        """
        if end <= start:
            return
        self._check_groups(group_blocks, "compute")
        if end - start <= _FEW_TOKENS:
            self._compute_few(group_blocks, block_hashes, salt, start, end)
            return
        groups = range(len(self._groups))
        table = _fingerprint_table(groups, block_hashes, salt, self._tph, start, end, self._dev)
        pos = torch.arange(start, end, dtype=torch.int64)
        for g, grp in enumerate(self._groups):
            bs = grp.bs
            b_lo, b_hi = start // bs, cdiv(end, bs)
            ids = self._block_ids(g, group_blocks[g], b_lo, b_hi, start, end, "compute")
            bidx = pos // bs
            tok_ids = torch.tensor(ids, dtype=torch.int64)[bidx - b_lo]
            off = pos - bidx * bs
            fp = table[g]
            if 0 in ids:  # null entries: outside the window, nothing to write
                keep = tok_ids != 0
                tok_ids, off, fp = tok_ids[keep], off[keep], fp[keep.to(self._dev)]
            index = (tok_ids.to(self._dev), off.to(self._dev))
            if self.mode == "fingerprint":
                grp.tok.index_put_(index, fp)
            else:
                grp.tok.index_put_(index, _low_bytes(fp, grp.width))

    def _compute_few(self, group_blocks: Sequence[Sequence[int]], block_hashes: Sequence[int], salt: int,
                     start: int, end: int) -> None:
        """:meth:`compute` for a few tokens (a decode step): the same words, computed
        in Python ints, since a dozen torch calls on one-element tensors cost more."""
        tph, nh = self._tph, len(block_hashes)
        hs = [_s64(block_hashes[p // tph]) if p // tph < nh else _s64(salt) for p in range(start, end)]
        for g, grp in enumerate(self._groups):
            bs = grp.bs
            b_lo, b_hi = start // bs, cdiv(end, bs)
            ids = self._block_ids(g, group_blocks[g], b_lo, b_hi, start, end, "compute")
            key = _group_key(g)
            rows, offs, words = [], [], []
            for i, p in enumerate(range(start, end)):
                b = ids[p // bs - b_lo]
                if not b:
                    continue  # null entry: outside the window
                if self.mode == "fingerprint":
                    grp.tok[b, p % bs] = _fp_int(key, hs[i], p)
                else:
                    rows.append(b)
                    offs.append(p % bs)
                    words.append(_fp_int(key, hs[i], p))
            if rows:
                index = (torch.tensor(rows, device=self._dev), torch.tensor(offs, device=self._dev))
                fp = torch.tensor(words, dtype=torch.int64, device=self._dev)
                grp.tok.index_put_(index, _low_bytes(fp, grp.width))

    def _read(self, grp: _Group, tok_ids: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        if self.mode == "fingerprint":
            return grp.tok[tok_ids, off]
        return _bytes_to_word(grp.tok[tok_ids, off])

    def verify(self, req_id: str, group_blocks: Sequence[Sequence[int]], block_hashes: Sequence[int],
               salt: int, ranges: Sequence[tuple[int, int]]) -> list[Violation]:
        """Check that the blocks a request is about to read hold its fingerprints.

        Args:
            req_id: the request (copied into each violation).
            group_blocks: the request's block ids per group.
            block_hashes: the request's complete block hashes.
            salt: the request's salt.
            ranges: per group, the tokens ``[lo, hi)`` the request will read
                (window-aware; an empty range checks nothing).

        Returns:
            At most one :class:`Violation` per (group, block): the first
            differing word. A null block inside a range is always a violation.

        Raises:
            CopyPathError: wrong number of groups or ranges, or a range beyond a block list.
        """
        self._check_groups(group_blocks, "verify")
        if len(ranges) != len(self._groups):
            raise CopyPathError(f"verify: {len(ranges)} ranges for {len(self._groups)} groups")
        out: list[Violation] = []
        for g, grp in enumerate(self._groups):
            lo, hi = ranges[g]
            if hi <= lo:
                continue
            tok_ids, off, bidx = self._token_blocks(g, group_blocks[g], lo, hi, "verify")
            found = self._read(grp, tok_ids, off)
            expected = fingerprints(g, block_hashes, salt, self._tph, lo, hi, device=self._dev)
            if grp.width < 8:
                expected = expected & ((1 << (8 * grp.width)) - 1)
            bad = (found != expected) | (tok_ids == 0)
            where = torch.nonzero(bad.cpu()).flatten()
            if len(where) == 0:
                continue
            wb = bidx[where]
            first = torch.ones(len(wb), dtype=torch.bool)
            first[1:] = wb[1:] != wb[:-1]
            sel = where[first]
            ids_l = tok_ids.cpu()[sel].tolist()
            exp_l = expected.cpu()[sel].tolist()
            fnd_l = found.cpu()[sel].tolist()
            for k, i in enumerate(sel.tolist()):
                out.append(Violation(req_id, g, int(bidx[i]), ids_l[k], exp_l[k], fnd_l[k], lo + i))
        return out

    def _check_groups(self, group_blocks: Sequence[Sequence[int]], what: str) -> None:
        if len(group_blocks) != len(self._groups):
            raise CopyPathError(f"{what}: {len(group_blocks)} block lists for {len(self._groups)} groups")

    # -- copies -----------------------------------------------------------------------

    def _plan(self, group_sizes: Sequence[int], block_indices: Sequence[int], gpu_block_ids: Sequence[int],
              cpu_slots: Sequence[int], what: str) -> list[tuple[int, list[int], list[int]]]:
        """Spec §8.2: per group, (group, GPU block ids, flat CPU sub-page indices) of a job.

        Python lists: a job has tens to hundreds of blocks, where list arithmetic
        costs less than torch calls; :func:`_index_tensors` makes index tensors."""
        ng = len(self._groups)
        if len(group_sizes) != ng or len(block_indices) != ng:
            raise CopyPathError(f"{what}: group_sizes {list(group_sizes)} and block_indices "
                                f"{list(block_indices)} for {ng} groups")
        bpc = self._bpc
        spans: list[tuple[int, int, int, int, int]] = []  # (g, n, skip, gpu offset, slot offset)
        goff = soff = 0
        for g in range(ng):
            n, b = group_sizes[g], block_indices[g]
            if n < 0 or b < 0:
                raise CopyPathError(f"{what}: group {g}: size {n}, block index {b}; both must be >= 0")
            if n == 0:
                continue
            skip = b % bpc
            spans.append((g, n, skip, goff, soff))
            goff += n
            soff += cdiv(n + skip, bpc)
        if goff != len(gpu_block_ids) or soff != len(cpu_slots):
            raise CopyPathError(
                f"{what}: group_sizes {list(group_sizes)} / block_indices {list(block_indices)} with "
                f"bpc {bpc} consume {goff} GPU block ids and {soff} CPU slots, but the job has "
                f"{len(gpu_block_ids)} and {len(cpu_slots)}")
        if goff and (min(gpu_block_ids) < 1 or max(gpu_block_ids) >= self.gpu_blocks):
            raise CopyPathError(f"{what}: GPU block ids out of [1, {self.gpu_blocks}): {list(gpu_block_ids)}")
        if soff and (min(cpu_slots) < 0 or max(cpu_slots) >= self.cpu_slots):
            raise CopyPathError(f"{what}: CPU slots out of [0, {self.cpu_slots}): {list(cpu_slots)}")
        ids, slots = list(gpu_block_ids), list(cpu_slots)
        plan = []
        for g, n, skip, go, so in spans:
            if bpc == 1:
                flat = slots[so: so + n]
            else:
                flat = [slots[so + k // bpc] * bpc + k % bpc for k in range(skip, skip + n)]
            plan.append((g, ids[go: go + n], flat))
        return plan

    def _staging(self, plan: Sequence[tuple[int, Any, Any]]) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each group's region; grows the staging buffers to fit."""
        regions = []
        off = 0
        for g, ids, _ in plan:
            size = len(ids) * self._groups[g].row_bytes
            regions.append((off, size))
            off += cdiv(size, 64) * 64  # keep every region aligned for any word view
        if off > self._stage_host.numel():
            self._stage_host = torch.empty(off, dtype=torch.uint8, pin_memory=self._cuda)
            if self._cuda:
                self._stage_dev = torch.empty(off, dtype=torch.uint8, device=self._dev)
        return regions

    def _region(self, buf: torch.Tensor, region: tuple[int, int], grp: _Group, n: int) -> torch.Tensor:
        off, size = region
        assert off + size <= buf.numel(), "staging buffer not grown"
        return buf[off: off + size].view(grp.gpu_w.dtype).view(n, -1)

    def _cpu_copy(self, plan: Sequence[tuple[int, list[int], list[int]]], *, store: bool) -> float:
        """A job's copies on the cpu device: each group's rows in one pass where
        :func:`_one_pass` finds one, else through staging. Only the copy calls are timed."""
        calls: list[Callable[[], object]] = []
        staged: list[tuple[int, list[int], list[int]]] = []
        for g, ids, flat in plan:
            grp = self._groups[g]
            call = None
            if self._single_pass:
                if store:
                    call = _one_pass(grp.cpu_w, flat, grp.gpu_w, ids, grp.row_bytes)
                else:
                    call = _one_pass(grp.gpu_w, ids, grp.cpu_w, flat, grp.row_bytes)
            if call is None:
                staged.append((g, ids, flat))
            else:
                calls.append(call)
        if staged:
            for (g, ids_t, flat_t), region in zip(_index_tensors(staged), self._staging(staged), strict=True):
                grp = self._groups[g]
                buf = self._region(self._stage_host, region, grp, len(ids_t))
                if store:
                    calls.append(partial(_gather_scatter, grp.cpu_w, flat_t, grp.gpu_w, ids_t, buf))
                else:
                    calls.append(partial(_gather_scatter, grp.gpu_w, ids_t, grp.cpu_w, flat_t, buf))
        t0 = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - t0

    def store(self, group_sizes: Sequence[int], block_indices: Sequence[int], gpu_block_ids: Sequence[int],
              cpu_slots: Sequence[int]) -> float:
        """Copy a store job's GPU blocks into CPU sub-pages (GPU -> CPU, spec §8.2).

        Per group ``g`` in order with ``n = group_sizes[g] > 0`` and ``skip =
        block_indices[g] mod bpc``: the next ``n`` GPU block ids and the next
        ``cdiv(n + skip, bpc)`` CPU slots are consumed; block ``i`` goes to slot
        ``slots[(skip + i) // bpc]``, sub-page ``(skip + i) mod bpc``.

        Args:
            group_sizes: GPU blocks per group.
            block_indices: logical index of each group's first block.
            gpu_block_ids: source blocks, flat, group-major.
            cpu_slots: destination slots, flat, group-major.

        Returns:
            The measured seconds of the copy.

        Raises:
            CopyPathError: the lists are not consumed exactly, or an id is out of
                range (checked before anything is copied).
        """
        plan = self._plan(group_sizes, block_indices, gpu_block_ids, cpu_slots, "store")
        if not plan:
            return 0.0
        if not self._cuda:
            return self._cpu_copy(plan, store=True)
        return self._cuda_store(_index_tensors(plan))

    def _cuda_store(self, plan: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> float:
        """:meth:`store` on cuda: device gather, one D2H copy into pinned staging, host scatter."""
        regions = self._staging(plan)
        total = regions[-1][0] + regions[-1][1]
        dev_ids = [ids.to(self._dev) for _, ids, _ in plan]
        stream = self._streams["d2h"]
        stream.wait_stream(torch.cuda.current_stream(self._dev))
        begin, done = _cuda_event(), _cuda_event()
        with torch.cuda.stream(stream):
            begin.record(stream)
            for (g, ids, _), region, did in zip(plan, regions, dev_ids, strict=True):
                grp = self._groups[g]
                stage = self._region(self._stage_dev, region, grp, len(ids))
                torch.index_select(grp.gpu_w, 0, did, out=stage)
            self._stage_host[:total].copy_(self._stage_dev[:total], non_blocking=True)
            done.record(stream)
        done.synchronize()
        t0 = time.perf_counter()
        for (g, ids, flat), region in zip(plan, regions, strict=True):
            grp = self._groups[g]
            grp.cpu_w.index_copy_(0, flat, self._region(self._stage_host, region, grp, len(ids)))
        host_s = time.perf_counter() - t0
        return float(begin.elapsed_time(done)) / 1e3 + host_s

    def load(self, group_sizes: Sequence[int], block_indices: Sequence[int], gpu_block_ids: Sequence[int],
             cpu_slots: Sequence[int]) -> float:
        """Copy a load job's CPU sub-pages into GPU blocks (CPU -> GPU, spec §8.2).

        The same consumption rules as :meth:`store`, with the CPU side as the source.

        Args:
            group_sizes: GPU blocks per group.
            block_indices: logical index of each group's first block.
            gpu_block_ids: destination blocks, flat, group-major.
            cpu_slots: source slots, flat, group-major.

        Returns:
            The measured seconds of the copy.

        Raises:
            CopyPathError: the lists are not consumed exactly, or an id is out of
                range (checked before anything is copied).
        """
        plan = self._plan(group_sizes, block_indices, gpu_block_ids, cpu_slots, "load")
        if not plan:
            return 0.0
        if not self._cuda:
            return self._cpu_copy(plan, store=False)
        return self._cuda_load(_index_tensors(plan))

    def _cuda_load(self, plan: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> float:
        """:meth:`load` on cuda: host gather into pinned staging, one H2D copy, device scatter."""
        regions = self._staging(plan)
        total = regions[-1][0] + regions[-1][1]
        dev_ids = [ids.to(self._dev) for _, ids, _ in plan]
        t0 = time.perf_counter()
        for (g, ids, flat), region in zip(plan, regions, strict=True):
            grp = self._groups[g]
            torch.index_select(grp.cpu_w, 0, flat, out=self._region(self._stage_host, region, grp, len(ids)))
        host_s = time.perf_counter() - t0
        stream = self._streams["h2d"]
        # loads must not overtake work already queued on the compute stream
        stream.wait_stream(torch.cuda.current_stream(self._dev))
        begin, done = _cuda_event(), _cuda_event()
        with torch.cuda.stream(stream):
            begin.record(stream)
            self._stage_dev[:total].copy_(self._stage_host[:total], non_blocking=True)
            for (g, ids, _), region, did in zip(plan, regions, dev_ids, strict=True):
                grp = self._groups[g]
                grp.gpu_w.index_copy_(0, did, self._region(self._stage_dev, region, grp, len(ids)))
            done.record(stream)
        done.synchronize()
        return host_s + float(begin.elapsed_time(done)) / 1e3


# -- calibration ---------------------------------------------------------------------

_KIB, _MIB = 2**10, 2**20
DEFAULT_CHUNK_BYTES = (64 * _KIB, 256 * _KIB, 1 * _MIB, 4 * _MIB, 8 * _MIB)
DEFAULT_BATCH_SIZES = (1, 16, 64, 256)
#: combinations above this many bytes per job are skipped by default
DEFAULT_MAX_JOB_BYTES = 256 * _MIB
#: seconds of timed runs per figure after which a figure stops sampling (at least 3 runs)
DEFAULT_BUDGET_S = 0.2


def _timed_pair(batched: Callable[[], float], contiguous: Callable[[], float], repeats: int,
                budget_s: float) -> tuple[float, float, int]:
    """Medians of interleaved batched and contiguous timings after one warm-up of each.

    Interleaving lets both figures see the same background load. Sampling stops after
    ``repeats`` pairs, or once ``budget_s`` is spent and ``min(3, repeats)`` pairs are in.

    Returns:
        (batched median s, contiguous median s, pairs timed).
    """
    batched()
    contiguous()
    bs: list[float] = []
    cs: list[float] = []
    start = time.perf_counter()
    while len(bs) < repeats:
        bs.append(batched())
        cs.append(contiguous())
        if len(bs) >= min(3, repeats) and time.perf_counter() - start > budget_s:
            break
    return statistics.median(bs), statistics.median(cs), len(bs)


def _contiguous_timers(cp: CopyPath, n: int) -> tuple[Callable[[], float], Callable[[], float]]:
    """Timers of one contiguous copy of ``n`` rows of group 0 of ``cp`` in each
    direction (h2d: CPU rows ``[0, n)`` to GPU rows ``[1, n + 1)``, d2h the reverse).

    The same tensors as the batched copies, so both see the same memory (pinned
    host and device on cuda) and the same caches. On cpu the copy goes as the
    batched copies go (:func:`_one_pass`): one ``copy_`` where torch has one
    thread or the rows hold at most ``_GRAIN`` elements, else in pieces of at
    most ``_GRAIN`` elements on the calling thread. A ``copy_`` that wakes
    torch's thread pool can be faster on an idle machine with many cores, but on
    a busy one it waits a scheduler tick, and the pool's threads, spinning after
    it, slow down the copies timed next; ``benchmarks/bench_copypath.py``
    compares the two.
    """
    grp = cp._groups[0]
    gpu, host = grp.gpu_w[1: n + 1].view(-1), grp.cpu_w[:n].view(-1)

    if cp._cuda:

        def cuda_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
            begin, done = _cuda_event(), _cuda_event()
            begin.record()
            dst.copy_(src, non_blocking=True)
            done.record()
            done.synchronize()
            return float(begin.elapsed_time(done)) / 1e3

        return partial(cuda_copy, gpu, host), partial(cuda_copy, host, gpu)

    def cpu_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        return time.perf_counter() - t0

    if torch.get_num_threads() > 1:
        pg, ph = list(torch.split(gpu, _GRAIN)), list(torch.split(host, _GRAIN))
    else:
        pg, ph = [gpu], [host]
    return partial(cpu_copy, pg, ph), partial(cpu_copy, ph, pg)


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(latency_s, bandwidth B/s) of ``t = latency + bytes / bandwidth``, least squares on
    relative error (weights 1/t^2, so small and large jobs count alike); the latency is
    clamped at 0 (then the bandwidth is refitted through the origin)."""
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    slope = intercept = 0.0
    if len(points) > 1 and det > 0:
        slope = (sw * sxy - sx * sy) / det
        intercept = (sy - slope * sx) / sw
    if slope <= 0 or intercept < 0:
        intercept = 0.0
        slope = sxy / sxx if sxx > 0 else 0.0
    if slope <= 0:
        x, t = max(points)
        slope = t / x
    return intercept, 1.0 / slope


def calibrate(device: str = "auto", chunk_bytes: Sequence[int] = DEFAULT_CHUNK_BYTES,
              batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, repeats: int = 5, *,
              max_job_bytes: int = DEFAULT_MAX_JOB_BYTES, seed: int = 0, budget_s: float = DEFAULT_BUDGET_S,
              single_pass: bool = True) -> dict[str, Any]:
    """Measure batched page copies as :class:`CopyPath` does them against one contiguous copy.

    For each chunk size ``c`` (one block row of one group, ``bpc = 1``) and batch
    size ``n`` (chunks per job), a realistic-mode :class:`CopyPath` stores and
    loads ``n`` chunks between scattered GPU blocks and CPU slots (a seeded
    permutation); one contiguous copy of the same ``n x c`` bytes between the
    same two tensors (rows ``[0, n)``; pinned host <-> device on cuda; on cpu
    a memcpy on the calling thread, like the batched copies, see
    :func:`_contiguous_timers`) is timed in the same run, interleaved with the
    batched copy so that both see the same background load. Each figure is
    the median of ``repeats`` runs after one warm-up, or of fewer (at least 3)
    once ``budget_s`` seconds of runs are spent on it. On cpu "h2d" means the
    load path and "d2h" the store path.

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        chunk_bytes: bytes per chunk to try.
        batch_sizes: chunks per job to try.
        repeats: timed runs per figure (after a warm-up), at most.
        max_job_bytes: combinations above this many bytes per job are skipped.
        seed: seed of the block/slot permutation.
        budget_s: seconds of timed runs per figure after which it stops
            sampling (once 3 runs are in); keeps the defaults under 30 s on a
            busy 2-core machine.
        single_pass: False: time the former gather/scatter copies on cpu
            (``CopyPath(single_pass=False)``), for benchmarks.

    Returns:
        ``rows`` (one dict per combination: ``chunk_bytes``, ``batch``,
        ``job_bytes``, ``h2d_s``/``d2h_s`` and ``contig_h2d_s``/``contig_d2h_s``
        medians, the matching ``*_gbps`` (1e9 B/s) and ``h2d_ratio``/``d2h_ratio``
        = batched / contiguous bandwidth, ``samples``: the fewest runs behind a
        figure of the row), ``skipped`` combinations, and the
        fitted ``h2d_bandwidth``/``d2h_bandwidth`` (B/s),
        ``h2d_latency_s``/``d2h_latency_s``, ``contig_h2d_bandwidth``/
        ``contig_d2h_bandwidth``, ``h2d_ratio``/``d2h_ratio`` (fitted batched /
        fitted contiguous bandwidth) and ``ratio`` (the smaller of the two),
        ``h2d_ratio_largest``/``d2h_ratio_largest`` (the ratio at the largest
        job measured, where caches matter least), ``pool_copy_gbps`` (on cpu with
        more than one torch thread: one ``copy_`` of the largest job split across
        ``pool_threads`` threads, which the batched copies do not do; else None),
        plus ``device``, ``device_name``, ``torch``, ``repeats``, ``budget_s``.

    Raises:
        ValueError: bad argument, unknown or unavailable device, or not enough memory.
    """
    if repeats < 1:
        raise ValueError(f"repeats {repeats}; allowed: >= 1")
    if not budget_s >= 0:
        raise ValueError(f"budget_s {budget_s}; allowed: >= 0")
    if not chunk_bytes or not batch_sizes or min(chunk_bytes) < 1 or min(batch_sizes) < 1:
        raise ValueError(f"chunk sizes {list(chunk_bytes)} and batch sizes {list(batch_sizes)}; "
                         "allowed: non-empty lists of positive integers")
    dev = _resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    skipped: list[tuple[int, int]] = []
    for c in chunk_bytes:
        batches = [n for n in batch_sizes if n * c <= max_job_bytes]
        skipped += [(c, n) for n in batch_sizes if n * c > max_job_bytes]
        if not batches:
            continue
        pool = max(batches)
        layout = Layout.of([GroupSpec(GroupKind.FULL, 16, bytes_per_block=c)], tokens_per_hash=16)
        cp = CopyPath(layout, pool + 1, pool, mode="realistic", device=dev, single_pass=single_pass)
        # real pages, not the kernel's shared zero page (reads of that would flatter the copies)
        cp.gpu_tensor(0).fill_(1)
        cp.cpu_tensor(0).fill_(1)
        for n in batches:
            blocks = (torch.randperm(pool, generator=gen)[:n] + 1).tolist()
            slots = torch.randperm(pool, generator=gen)[:n].tolist()
            h2d, d2h = _contiguous_timers(cp, n)
            job_args = ([n], [0], blocks, slots)
            load_s, ch2d_s, k1 = _timed_pair(partial(cp.load, *job_args), h2d, repeats, budget_s)
            store_s, cd2h_s, k2 = _timed_pair(partial(cp.store, *job_args), d2h, repeats, budget_s)
            del h2d, d2h
            job = n * c
            rows.append({
                "chunk_bytes": c, "batch": n, "job_bytes": job, "samples": min(k1, k2),
                "h2d_s": load_s, "d2h_s": store_s, "contig_h2d_s": ch2d_s, "contig_d2h_s": cd2h_s,
                "h2d_gbps": job / load_s / 1e9, "d2h_gbps": job / store_s / 1e9,
                "contig_h2d_gbps": job / ch2d_s / 1e9, "contig_d2h_gbps": job / cd2h_s / 1e9,
                "h2d_ratio": ch2d_s / load_s, "d2h_ratio": cd2h_s / store_s,
            })
        del cp
    if not rows:
        raise ValueError(f"every combination is above max_job_bytes={max_job_bytes}; "
                         "allowed: smaller chunk or batch sizes")
    out: dict[str, Any] = {
        "device": dev,
        "device_name": torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else "cpu",
        "torch": str(torch.__version__),
        "repeats": repeats,
        "budget_s": budget_s,
        "rows": rows,
        "skipped": skipped,
    }
    for d in ("h2d", "d2h"):
        lat, bw = _fit([(r["job_bytes"], r[f"{d}_s"]) for r in rows])
        _, cbw = _fit([(r["job_bytes"], r[f"contig_{d}_s"]) for r in rows])
        out[f"{d}_latency_s"] = lat
        out[f"{d}_bandwidth"] = bw
        out[f"contig_{d}_bandwidth"] = cbw
        out[f"{d}_ratio"] = bw / cbw
        biggest = max(r["job_bytes"] for r in rows)
        out[f"{d}_ratio_largest"] = statistics.median(
            r[f"{d}_ratio"] for r in rows if r["job_bytes"] == biggest)
    out["ratio"] = min(out["h2d_ratio"], out["d2h_ratio"])
    out["pool_threads"] = torch.get_num_threads() if dev == "cpu" else 0
    out["pool_copy_gbps"] = _pool_copy_gbps(max(r["job_bytes"] for r in rows), repeats) \
        if out["pool_threads"] > 1 else None
    return out


def _pool_copy_gbps(nbytes: int, repeats: int) -> float:
    """GB/s of one ``copy_`` of ``nbytes`` on the cpu that torch splits across its threads
    (median of ``repeats`` after a warm-up): what the calling-thread copies leave on the table."""
    word = _word_dtype(nbytes)
    size = torch.empty(0, dtype=word).element_size()
    a = torch.ones(nbytes // size, dtype=word)
    b = torch.ones(nbytes // size, dtype=word)

    def copy() -> float:
        t0 = time.perf_counter()
        b.copy_(a)
        return time.perf_counter() - t0

    copy()
    return nbytes / statistics.median(copy() for _ in range(repeats)) / 1e9


def calibration_table(result: dict[str, Any]) -> str:
    """The rows of :func:`calibrate` as a fixed-width table."""
    lines = [f"kvsim calibrate: {result['device']} ({result['device_name']}), torch {result['torch']}, "
             f"median of {result['repeats']} runs per figure (fewer past {result['budget_s']:g} s; "
             f"'runs': the fewest in the row)",
             f"{'chunk':>10} {'chunks/job':>10} {'job':>10} {'h2d GB/s':>9} {'d2h GB/s':>9} "
             f"{'contig h2d':>10} {'contig d2h':>10} {'h2d ratio':>9} {'d2h ratio':>9} {'runs':>4}"]
    for r in result["rows"]:
        lines.append(f"{_fmt_bytes(r['chunk_bytes']):>10} {r['batch']:>10} {_fmt_bytes(r['job_bytes']):>10} "
                     f"{r['h2d_gbps']:>9.2f} {r['d2h_gbps']:>9.2f} {r['contig_h2d_gbps']:>10.2f} "
                     f"{r['contig_d2h_gbps']:>10.2f} {r['h2d_ratio']:>9.2f} {r['d2h_ratio']:>9.2f} "
                     f"{r['samples']:>4}")
    for c, n in result["skipped"]:
        lines.append(f"{_fmt_bytes(c):>10} {n:>10} {'skipped (above max job bytes)':>32}")
    lines.append(f"fit t = latency + bytes / bandwidth: h2d {result['h2d_bandwidth'] / 1e9:.2f} GB/s + "
                 f"{result['h2d_latency_s'] * 1e6:.1f} us, d2h {result['d2h_bandwidth'] / 1e9:.2f} GB/s + "
                 f"{result['d2h_latency_s'] * 1e6:.1f} us; contiguous h2d "
                 f"{result['contig_h2d_bandwidth'] / 1e9:.2f} GB/s, d2h "
                 f"{result['contig_d2h_bandwidth'] / 1e9:.2f} GB/s; ratio {result['ratio']:.2f} "
                 f"(largest job: h2d {result['h2d_ratio_largest']:.2f}, "
                 f"d2h {result['d2h_ratio_largest']:.2f})")
    if result.get("pool_copy_gbps"):
        biggest = max(r["job_bytes"] for r in result["rows"])
        lines.append(f"batched and contiguous copies run on the calling thread; one copy_ of "
                     f"{_fmt_bytes(biggest)} on torch's {result['pool_threads']} threads: "
                     f"{result['pool_copy_gbps']:.2f} GB/s")
    return "\n".join(lines)


def hardware_snippet(result: dict[str, Any]) -> str:
    """TOML keys for a ``hardware/1`` file or a run's ``[hardware]`` section.

    The bandwidths and per-job latencies are the batched-copy fit of
    :func:`calibrate` (what :class:`CopyPath` achieves); the contiguous copy at
    the largest job (the practical limit) is in a comment.
    """
    sizes = sorted({r["chunk_bytes"] for r in result["rows"]})
    batches = sorted({r["batch"] for r in result["rows"]})
    biggest = max(result["rows"], key=lambda r: r["job_bytes"])

    def bw(x: float) -> str:
        return f'"{x / 1e9:.3f}GB/s"'

    def lat(x: float) -> str:
        return f"{x:.3e}" if math.isfinite(x) else "0.0"

    return "\n".join([
        f"# kvsim calibrate on {result['device']} ({result['device_name']}), torch {result['torch']}: "
        f"batched page copies as sim.engine.copypath does them,",
        f"# chunks {_fmt_bytes(sizes[0])}..{_fmt_bytes(sizes[-1])} x {batches[0]}..{batches[-1]} per job, "
        f"median of up to {result['repeats']};",
        f"# at the largest job ({_fmt_bytes(biggest['job_bytes'])}) one contiguous copy ran at "
        f"{biggest['contig_h2d_gbps']:.2f} GB/s h2d, {biggest['contig_d2h_gbps']:.2f} GB/s d2h",
        f"# (batched / contiguous there: h2d {biggest['h2d_ratio']:.2f}, d2h {biggest['d2h_ratio']:.2f})",
        f"h2d_bandwidth = {bw(result['h2d_bandwidth'])}",
        f"d2h_bandwidth = {bw(result['d2h_bandwidth'])}",
        f"h2d_latency_s = {lat(result['h2d_latency_s'])}",
        f"d2h_latency_s = {lat(result['d2h_latency_s'])}",
        "",
    ])
