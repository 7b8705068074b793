"""KV cache group layouts: kinds, block and chunk sizes, offload keys, bytes.

What it models
    vLLM's hybrid KV cache manager splits a model's attention layers into KV
    cache *groups*. Each group has an attention kind (full, sliding window,
    chunked local, mamba), a GPU block size in tokens, and, for the
    OffloadingConnector, an offload *chunk* of ``blocks_per_chunk`` GPU blocks
    (one number for all groups, so groups with different block sizes have
    different chunk sizes in tokens). Spec §1-§2.

    The offload key of chunk ``j`` of group ``g`` is the pair
    ``(block_hashes[(j + 1) * hashes_per_chunk - 1], g)`` (spec §1.3): the hash
    of the chunk's last hash block names the whole prefix ending with the
    chunk, and the group index keeps groups apart.

Simplifications
    * Decode context parallelism is not modelled (block size x DCP = block size).
    * The Mamba "align" cache mode is the only Mamba mode modelled for the
      lookup's alignment rounding (``mamba_align``); partial tails (spec §7.5)
      are not modelled.

Invariants (checked at construction, raising :class:`LayoutError`)
    * every ``tokens_per_block`` is a positive multiple of ``tokens_per_hash``;
    * windows and attention chunks are positive and given only for their kind;
    * ``extra_retained_tokens`` is only given for sliding-window groups.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from sim.model.cpu_cache import KEY_GROUPS, offload_key

__all__ = [
    "GroupKind",
    "GroupSpec",
    "KVShape",
    "Layout",
    "LayoutError",
    "cdiv",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


class LayoutError(ValueError):
    """An invalid layout. ``key`` names the offending field, ``allowed`` what is accepted."""

    def __init__(self, key: str, problem: str, allowed: str) -> None:
        super().__init__(f"{key}: {problem}; allowed: {allowed}")
        self.key = key
        self.problem = problem
        self.allowed = allowed


class GroupKind(enum.StrEnum):
    """Attention kind of a KV cache group (spec §2)."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"


DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "float8": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-group tensor shape, to derive KV bytes per GPU block (spec §8.4).

    ``bytes per block = tokens_per_block x layers x (1 if mla else 2) x kv_heads
    x head_size x dtype_bytes``.
    """

    layers: int
    kv_heads: int
    head_size: int
    dtype_bytes: int = 2
    mla: bool = False

    def bytes_per_block(self, tokens_per_block: int) -> int:
        """KV bytes of one GPU block of this group on one worker."""
        kv = 1 if self.mla else 2
        return tokens_per_block * self.layers * kv * self.kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group as the connector sees it.

    Attributes:
        kind: attention kind.
        tokens_per_block: GPU block size in tokens (``bs_g``).
        window: sliding window ``W`` in tokens (sliding_window only).
        attention_chunk: attention chunk ``C`` in tokens (chunked_local only).
        extra_retained_tokens: ``e``; the GPU keeps ``e`` more tokens left of
            the window (multi-module MTP). Sliding window only.
        eagle: the group holds EAGLE/MTP draft KV (volatile last chunk).
        shape: optional tensor shape, for bytes per block.
        bytes_per_block: optional KV bytes per block given directly.
    """

    kind: GroupKind
    tokens_per_block: int
    window: int | None = None
    attention_chunk: int | None = None
    extra_retained_tokens: int = 0
    eagle: bool = False
    shape: KVShape | None = None
    bytes_per_block: int | None = None

    def to_dict(self) -> dict[str, object]:
        """The group as the ``groups`` entries of ``check/1`` files (defaults left out)."""
        d: dict[str, object] = {"kind": str(self.kind), "tokens_per_block": self.tokens_per_block}
        if self.window is not None:
            d["window"] = self.window
        if self.attention_chunk is not None:
            d["attention_chunk"] = self.attention_chunk
        if self.extra_retained_tokens:
            d["extra_retained_tokens"] = self.extra_retained_tokens
        if self.eagle:
            d["eagle"] = True
        return d

    @property
    def attention_key(self) -> tuple[object, ...]:
        """What of vLLM's KV cache spec the group sets apart from its per-layer shape: kind,
        block size, window, attention chunk, ``extra_retained_tokens``
        (:attr:`Layout.spec_classes` adds the shape)."""
        return (self.kind, self.tokens_per_block, self.window, self.attention_chunk,
                self.extra_retained_tokens)

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens before the retained window at boundary ``num_computed`` (spec §5.1)."""
        kind = self.kind
        if kind is GroupKind.FULL:
            return 0
        if kind is GroupKind.SLIDING_WINDOW:
            assert self.window is not None
            return max(0, num_computed - self.window + 1 - self.extra_retained_tokens)
        if kind is GroupKind.CHUNKED_LOCAL:
            assert self.attention_chunk is not None
            return (num_computed // self.attention_chunk) * self.attention_chunk
        return num_computed - 1  # mamba keeps the single state at N


@dataclass(frozen=True)
class Layout:
    """The offloading view of all KV cache groups of a model.

    Attributes:
        groups: the groups in KV cache config order (index = group id).
        tokens_per_hash: prefix-cache hash granularity in tokens.
        blocks_per_chunk: GPU blocks per offload chunk (``bpc``), shared.
    """

    groups: tuple[GroupSpec, ...]
    tokens_per_hash: int
    blocks_per_chunk: int = 1
    #: derived per-group tables, filled in ``__post_init__`` for fast access
    tokens_per_chunk: tuple[int, ...] = field(init=False)
    hashes_per_chunk: tuple[int, ...] = field(init=False)
    window_chunks: tuple[int | None, ...] = field(init=False)

    def __post_init__(self) -> None:
        self._validate()
        bpc = self.blocks_per_chunk
        tpc = tuple(g.tokens_per_block * bpc for g in self.groups)
        object.__setattr__(self, "tokens_per_chunk", tpc)
        object.__setattr__(self, "hashes_per_chunk", tuple(t // self.tokens_per_hash for t in tpc))
        object.__setattr__(
            self, "window_chunks", tuple(self._window_in_chunks(i) for i in range(len(self.groups)))
        )

    @classmethod
    def of(
        cls,
        groups: Sequence[GroupSpec],
        tokens_per_hash: int,
        blocks_per_chunk: int = 1,
    ) -> Layout:
        """Build a layout from any sequence of groups."""
        return cls(tuple(groups), tokens_per_hash, blocks_per_chunk)

    # -- validation ---------------------------------------------------------------

    def _validate(self) -> None:
        if not isinstance(self.tokens_per_hash, int) or self.tokens_per_hash <= 0:
            raise LayoutError("tokens_per_hash", f"{self.tokens_per_hash!r}", "a positive integer")
        if not isinstance(self.blocks_per_chunk, int) or self.blocks_per_chunk <= 0:
            raise LayoutError("blocks_per_chunk", f"{self.blocks_per_chunk!r}", "a positive integer")
        if not self.groups:
            raise LayoutError("groups", "empty", "at least one group")
        if len(self.groups) > KEY_GROUPS:
            raise LayoutError("groups", f"{len(self.groups)} groups",
                              f"at most {KEY_GROUPS} (the groups an offload key can name)")
        for i, g in enumerate(self.groups):
            self._validate_group(i, g)

    def _validate_group(self, i: int, g: GroupSpec) -> None:
        key = f"groups.{i}"
        if not isinstance(g.kind, GroupKind):
            raise LayoutError(f"{key}.kind", f"{g.kind!r}", ", ".join(k.value for k in GroupKind))
        bs = g.tokens_per_block
        if not isinstance(bs, int) or bs <= 0 or bs % self.tokens_per_hash:
            raise LayoutError(
                f"{key}.tokens_per_block",
                f"{bs!r} is not a positive multiple of tokens_per_hash={self.tokens_per_hash}",
                f"a positive multiple of {self.tokens_per_hash}",
            )
        sw = g.kind is GroupKind.SLIDING_WINDOW
        cla = g.kind is GroupKind.CHUNKED_LOCAL
        if sw != (g.window is not None):
            problem = "missing" if sw else f"given for kind {g.kind.value}"
            raise LayoutError(f"{key}.window", problem, "a positive integer for sliding_window only")
        if sw and (not isinstance(g.window, int) or g.window <= 0):
            raise LayoutError(f"{key}.window", f"{g.window!r}", "a positive integer")
        if cla != (g.attention_chunk is not None):
            problem = "missing" if cla else f"given for kind {g.kind.value}"
            raise LayoutError(
                f"{key}.attention_chunk", problem, "a positive integer for chunked_local only"
            )
        if cla and (not isinstance(g.attention_chunk, int) or g.attention_chunk <= 0):
            raise LayoutError(f"{key}.attention_chunk", f"{g.attention_chunk!r}", "a positive integer")
        e = g.extra_retained_tokens
        if not isinstance(e, int) or e < 0 or (e and not sw):
            raise LayoutError(
                f"{key}.extra_retained_tokens", f"{e!r}", "a non-negative integer, sliding_window only"
            )
        if g.bytes_per_block is not None and g.bytes_per_block <= 0:
            raise LayoutError(f"{key}.bytes_per_block", f"{g.bytes_per_block!r}", "a positive integer")

    # -- derived quantities ---------------------------------------------------------

    def _window_in_chunks(self, i: int) -> int | None:
        """``w_g``: the lookup window in chunks (spec §2 table), None for full attention."""
        g = self.groups[i]
        tpc = g.tokens_per_block * self.blocks_per_chunk
        if g.kind is GroupKind.FULL:
            return None
        if g.kind is GroupKind.SLIDING_WINDOW:
            assert g.window is not None
            return cdiv(g.window, tpc)
        if g.kind is GroupKind.CHUNKED_LOCAL:
            assert g.attention_chunk is not None
            return cdiv(g.attention_chunk, tpc)
        return 1

    @cached_property
    def lookup_order(self) -> tuple[int, ...]:
        """Full-attention groups in index order, then window-type groups by ``w_g``
        descending (stable, so ties keep index order). Spec §2."""
        fa = [i for i, w in enumerate(self.window_chunks) if w is None]
        sw = [i for i, w in enumerate(self.window_chunks) if w is not None]
        sw.sort(key=lambda i: -(self.window_chunks[i] or 0))
        return tuple(fa + sw)

    @cached_property
    def window_groups(self) -> tuple[int, ...]:
        """Window-type groups in lookup order."""
        return tuple(i for i in self.lookup_order if self.window_chunks[i] is not None)

    @cached_property
    def mamba_align(self) -> int | None:
        """Tokens per chunk of the Mamba groups (all must agree), else None."""
        sizes = {self.tokens_per_chunk[i] for i, g in enumerate(self.groups)
                 if g.kind is GroupKind.MAMBA}
        if len(sizes) > 1:
            raise LayoutError("groups", "mamba groups with different chunk sizes",
                              "one tokens_per_block for all mamba groups")
        return sizes.pop() if sizes else None

    @cached_property
    def alignment_tokens(self) -> int | None:
        """Chunk grid that complete-chunk hits end on: the full-attention ``tpc``
        when all full-attention groups agree (spec §7.3)."""
        fa = {self.tokens_per_chunk[i] for i, w in enumerate(self.window_chunks) if w is None}
        return fa.pop() if len(fa) == 1 else None

    @cached_property
    def spec_classes(self) -> tuple[int, ...]:
        """Per group, the index of its class of groups vLLM deems the same KV cache spec
        (numbered by first appearance): same kind, block size, window, attention chunk and
        ``extra_retained_tokens``, and the same per-layer shape (KV heads, head size, dtype,
        MLA; or the same ``bytes_per_block`` when no shape is given). vLLM's hybrid
        coordinator looks such groups up as one, and marks them all EAGLE when one is."""
        keys: dict[tuple[object, ...], int] = {}
        out = []
        for g in self.groups:
            s = g.shape
            per_layer = ((s.kv_heads, s.head_size, s.dtype_bytes, s.mla) if s is not None
                         else g.bytes_per_block)
            out.append(keys.setdefault((*g.attention_key, per_layer), len(keys)))
        return tuple(out)

    @cached_property
    def hit_groups(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """The groups of vLLM's prefix-cache lookup (its coordinator's "attention groups"):
        the members of each spec class (:attr:`spec_classes`) and whether the class drops
        the EAGLE block (one member is an EAGLE group), full-attention classes first, else
        in group order (0.29 to 0.33)."""
        classes: dict[int, list[int]] = {}
        for g, c in enumerate(self.spec_classes):
            classes.setdefault(c, []).append(g)
        out = [(tuple(m), any(self.groups[g].eagle for g in m)) for m in classes.values()]
        out.sort(key=lambda x: self.groups[x[0][0]].kind is not GroupKind.FULL)
        return tuple(out)

    @cached_property
    def eagle_hit(self) -> tuple[bool, ...]:
        """Per group: vLLM caches and looks it up as an EAGLE group (the last matched block
        dropped, one block more hashed): an EAGLE group, or one of the same spec class."""
        out = [False] * len(self.groups)
        for members, eagle in self.hit_groups:
            for g in members:
                out[g] = eagle
        return tuple(out)

    @cached_property
    def scheduler_block_size(self) -> int:
        """vLLM's scheduler block size: the groups' least common block size (one group: its
        block size), the grid a hybrid prefix-cache hit is aligned to."""
        return math.lcm(*(g.tokens_per_block for g in self.groups))

    @cached_property
    def gpu_cache_align(self) -> int | None:
        """The token multiple a request's blocks are hashed up to in vLLM's prefix cache:
        with more than one group, vLLM's hybrid coordinator caches only up to the computed
        tokens rounded down to the scheduler block size (the groups' least common multiple;
        ``_align_cacheable``, 0.29 to 0.33), an EAGLE group one block further; None (one
        group, or a Mamba group, where vLLM may hash finer): every complete block."""
        if len(self.groups) < 2 or any(g.kind is GroupKind.MAMBA for g in self.groups):
            return None
        return self.scheduler_block_size

    def cacheable_tokens(self, g: int, num_tokens: int) -> int:
        """Of ``num_tokens`` computed tokens, how many group ``g``'s prefix cache hashes
        (:attr:`gpu_cache_align`)."""
        align = self.gpu_cache_align
        if align is None:
            return num_tokens
        aligned = num_tokens - num_tokens % align
        if self.eagle_hit[g] and aligned > 0:
            return min(num_tokens, aligned + self.groups[g].tokens_per_block)
        return aligned

    @cached_property
    def gpu_cache_masks(self) -> tuple[tuple[int, int, int] | None, ...]:
        """Per group, which complete GPU blocks vLLM's prefix cache hashes (``cache_blocks``
        with its dense retention): None, every block; else ``(per_segment, need, shift)``: a
        sliding-window block ``i`` is hashed iff ``i >= shift`` and ``(i - shift) % per_segment
        >= per_segment - need``, the ``need`` blocks a hit needs before every boundary of the
        scheduler block size (the groups' least common multiple). The same in 0.29 to 0.33."""
        align = self.scheduler_block_size
        out: list[tuple[int, int, int] | None] = []
        for i, g in enumerate(self.groups):
            bs = g.tokens_per_block
            if g.kind is not GroupKind.SLIDING_WINDOW or g.window is None or align % bs:
                out.append(None)
                continue
            eagle = int(self.eagle_hit[i])
            need = cdiv(g.window - 1, bs) + eagle
            per_segment = align // bs
            out.append(None if need >= per_segment else (per_segment, need, eagle))
        return tuple(out)

    def hit_first_block(self, group: int, num_tokens: int) -> int:
        """The first block a GPU prefix-cache hit of ``num_tokens`` needs in
        ``group``: the first block the group retains at ``num_tokens``, except
        that a sliding window's hit needs its window alone, without
        ``extra_retained_tokens`` (vLLM's ``_contiguous_blocks_for_hit``,
        ``cdiv(W - 1, block size)`` blocks, 0.29 to 0.33)."""
        spec = self.groups[group]
        bs = spec.tokens_per_block
        if spec.kind is GroupKind.SLIDING_WINDOW and spec.extra_retained_tokens:
            assert spec.window is not None
            return max(0, num_tokens - spec.window + 1) // bs
        if spec.kind is GroupKind.MAMBA:
            return max(0, (num_tokens - 1) // bs)
        return spec.skipped_tokens(num_tokens) // bs

    def num_keys(self, group: int, num_tokens: int) -> int:
        """Number of complete chunks (keys) of ``group`` for a sequence of ``num_tokens``."""
        return num_tokens // self.tokens_per_chunk[group]

    def offload_keys(self, group: int, block_hashes: Sequence[int]) -> list[int]:
        """Keys of every complete chunk of ``group`` (spec §1.3; the encoding of
        :func:`sim.model.cpu_cache.offload_key`)."""
        hpc = self.hashes_per_chunk[group]
        return [offload_key(h, group) for h in block_hashes[hpc - 1 :: hpc]]

    def kv_bytes_per_block(self, group: int) -> int | None:
        """KV bytes of one GPU block of ``group`` (given, or from its shape)."""
        g = self.groups[group]
        if g.bytes_per_block is not None:
            return g.bytes_per_block
        if g.shape is not None:
            return g.shape.bytes_per_block(g.tokens_per_block)
        return None

    def chunk_bytes(self, group: int) -> int | None:
        """KV bytes of one full chunk of ``group``."""
        b = self.kv_bytes_per_block(group)
        return None if b is None else b * self.blocks_per_chunk
