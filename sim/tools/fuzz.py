"""Fuzzers: random check scenarios (OLD vs NEW decisions) and random whole runs.

Decision fuzzer (``kvsim fuzz --budget N --seed S``)
    Draws random ``check/1`` situations (layouts of 1-4 groups of every kind,
    block sizes, windows, attention chunks, ``blocks_per_chunk``, EAGLE,
    ``extra_retained_tokens``, prompt lengths, local GPU hits, prefix caching
    on/off and per-chunk CPU states), biased towards the structure of spec
    §6.5: a boundary that a finer group cuts into a coarser window group's
    chunk grid, stored windows that end there, and the chunk just left of the
    window OLD verifies perturbed (missing, store-pending, being loaded,
    RETRY). Each scenario is decided under both logics by the model itself;
    the pair of outcomes is classified and a *finding* is flagged when the
    logics differ in outcome class (crash kind, hazard, deferral, 0, hit) or
    hit size, when either crashes, when NEW shows a hazard, or when the model
    raises anything but a modelled crash (a simulator bug).

    Findings are grouped by :class:`Condition` (both outcome classes, the
    size relation, and the kind/alignment/EAGLE/extra/misfit of the group the
    crash or hazard names). The first finding of every condition (lowest
    index) is shrunk by greedy delta debugging while its condition is kept,
    re-run through :func:`sim.io.check.reference_check` (the reference path) and
    written as one ``check/1`` library entry with the observed outcomes as
    expectations.

    Speed: the search decides scenarios with :func:`fast_outcomes`, the
    decision kernel (:mod:`sim.model.decision`, which :func:`sim.io.check.run_check`
    uses too): the scheduler's lookup and load plan on a read-only table of
    the stated chunk states and a closed-form GPU allocation, with per-layout
    constants built once per shape. Every ``verify_every``-th scenario and
    every shrunk case are also decided by :func:`reference_outcomes`, the
    real-object path (:func:`sim.io.check.reference_check`: CPU chunk cache,
    per-block GPU cache and scheduler), and a difference is reported as a
    divergence.

Whole-run fuzzer (``kvsim fuzz --runs N --seed S [--copy-path]``)
    Random small ``run/1`` scenarios (inline layouts with real shapes, small
    GPU pools so that requests are preempted, small CPU caches so that chunks
    are evicted, slow links so that jobs overlap, uniform or multi-turn
    workloads of tens of requests), each simulated under OLD, NEW and LATEST
    (:data:`RUN_LOGICS`). A
    finding is an end-of-run :class:`~sim.engine.loop.InvariantViolation` or any
    other exception (a simulator bug) and, with ``--copy-path``, an integrity
    violation under NEW. Each distinct finding is written as a ``run/1`` file
    that ``kvsim run`` replays.

Determinism
    Scenario ``i`` of seed ``s`` is drawn from ``random.Random((s << 40) | i)``
    (its layout from ``(s, i // 8)``: eight neighbours share one), so the
    results do not depend on ``--jobs``: the index space is cut into fixed
    blocks and the per-condition representative is the lowest index,
    whatever process found it. Run ``i`` of the run fuzzer likewise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import signal
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from sim.engine.loop import InvariantViolation, simulate
from sim.engine.metrics import Recorder
from sim.errors import InputError
from sim.io.check import CheckCase, Logic, case_toml, parse_check, reference_check, run_check, summarize
from sim.io.results import out_error
from sim.io.scenario import build_run
from sim.model.connector import ModelledCrashError
from sim.model.decision import DecisionLayout, decide, decision_layout
from sim.model.layout import GroupKind, GroupSpec, Layout, cdiv
from sim.tools.run import owned, pool_map, worker_init

if TYPE_CHECKING:
    from sim.engine.loop import SimulationResult

__all__ = [
    "Condition",
    "FuzzReport",
    "RunFinding",
    "RunFuzzReport",
    "classify",
    "condition_of",
    "fast_outcomes",
    "fuzz_decisions",
    "fuzz_runs",
    "generate",
    "reference_outcomes",
    "scenario_at",
    "shrink",
]

FULL = GroupKind.FULL
SWA = GroupKind.SLIDING_WINDOW
CLA = GroupKind.CHUNKED_LOCAL
MAMBA = GroupKind.MAMBA

_BLOCK = 2048  #: scenarios per work unit (fixed: results do not depend on --jobs)


# ----------------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------------

_TPH = (1, 2, 4, 4, 8, 8, 16)
_MULT = (1, 1, 2, 2, 3, 4, 4, 6, 8, 8, 16, 32)
_STATE_LEFT = ("missing", "missing", "missing", "missing", "pending", "pending", "loading",
               "loading", "retry", "present")
_STATE_ANY = ("missing", "present", "pending", "loading", "retry")
_SHIFT = (0, 0, 0, 0, -1, 1, -2)


def _pick(rng: random.Random, seq: Sequence[Any]) -> Any:
    return seq[int(rng.random() * len(seq))]


@dataclass(frozen=True, slots=True)
class _Shape:
    """The layout part of a generated scenario (shared by ``_SHARE`` neighbours)."""

    groups: tuple[GroupSpec, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    tpcs: tuple[int, ...]
    wchunks: tuple[int, ...]
    layout: Layout


_SHARE = 8  #: consecutive scenarios that share one layout (saves building it)


def generate_shape(rng: random.Random) -> _Shape:
    """A random layout: 1-4 groups of every kind, mixed block sizes, windows and
    attention chunks around the chunk size, sometimes EAGLE or extra tokens."""
    rnd = rng.random

    def ri(lo: int, hi: int) -> int:  # uniform in [lo, hi]; cheaper than randint
        return lo + int(rnd() * (hi - lo + 1))

    tph = _TPH[int(rnd() * len(_TPH))]
    x = rnd()
    bpc = 1 if x < 0.5 else (2 if x < 0.8 else 4)
    x = rnd()
    ng = 1 if x < 0.08 else (2 if x < 0.5 else (3 if x < 0.85 else 4))
    eagle = int(rnd() * ng) if rnd() < 0.2 else -1
    groups: list[GroupSpec] = []
    wchunks: list[int] = []
    mamba_bs = 0
    for gi in range(ng):
        x = rnd()
        if gi == 0:
            kind = FULL if x < 0.8 else (SWA if x < 0.92 else (CLA if x < 0.97 else MAMBA))
        else:
            kind = SWA if x < 0.6 else (FULL if x < 0.72 else (CLA if x < 0.86 else MAMBA))
        bs = tph * _MULT[int(rnd() * len(_MULT))]
        if kind is MAMBA:
            if mamba_bs:
                bs = mamba_bs
            mamba_bs = bs
        t = bs * bpc
        window = chunk = None
        extra = 0
        w = 0
        if kind is SWA:
            x = rnd()
            if x < 0.3:
                window = ri(1, 3 * t)
            elif x < 0.55:
                window = bs * ri(1, 2 * bpc + 2)
            elif x < 0.75:
                window = max(1, t * ri(1, 3) + ri(-2, 2))
            elif x < 0.9:
                window = tph * ri(1, max(1, 3 * t // tph))
            else:
                window = ri(1, 4 * bs)
            if rnd() < 0.1:
                extra = ri(1, bs + 4)
            w = cdiv(window, t)
        elif kind is CLA:
            x = rnd()
            if x < 0.45:
                chunk = t * ri(1, 3)
            elif x < 0.75:
                chunk = bs * ri(1, 3 * bpc + 1)
            elif x < 0.9:
                chunk = tph * ri(1, max(1, 3 * t // tph))
            else:
                chunk = ri(1, 3 * t)
            w = cdiv(chunk, t)
        elif kind is MAMBA:
            w = 1
        groups.append(GroupSpec(kind, bs, window, chunk, extra, gi == eagle))
        wchunks.append(w)
    gt = tuple(groups)
    layout = decision_layout(gt, tph, bpc).layout  # built once, shared with the search
    return _Shape(gt, tph, bpc, layout.tokens_per_chunk, tuple(wchunks), layout)


def generate(rng: random.Random, shape: _Shape | None = None) -> CheckCase:
    """One random scenario on ``shape`` (drawn from ``rng`` when None), biased
    towards the structure of spec §6.5 (see the module docstring). Always valid."""
    if shape is None:
        shape = generate_shape(rng)
    rnd = rng.random

    def ri(lo: int, hi: int) -> int:
        return lo + int(rnd() * (hi - lo + 1))

    groups = shape.groups
    ng = len(groups)
    tpcs = shape.tpcs
    wchunks = shape.wchunks
    kinds = [g.kind for g in groups]
    sizes = [g.tokens_per_block for g in groups]
    eagle = next((i for i, g in enumerate(groups) if g.eagle), -1)
    big, small = max(tpcs), min(tpcs)
    # prompt length: a few chunks of the coarsest group, often one token past a
    # chunk boundary (the -1 token then leaves the boundary aligned), capped so
    # that the finest group has at most ~64 chunks
    x = rnd()
    tail = 1 if x < 0.4 else (0 if x < 0.5 else int(rnd() * big))
    num_tokens = ri(1, 6) * big + tail
    if num_tokens // small > 64:
        num_tokens = small * ri(6, 64) + (1 if rnd() < 0.5 else int(rnd() * small))
    num_tokens = max(1, num_tokens)
    window_groups = [g for g in range(ng) if kinds[g] is not FULL]
    m = max(1, num_tokens - 1 if window_groups else num_tokens)
    # the boundary the stored chunks support: often a finer group's multiple
    # that cuts a coarser window group's chunk grid (spec §6.5)
    x = rnd()
    cut = [g for g in window_groups if tpcs[g] > small]
    if x < 0.6 and cut:
        tg = tpcs[cut[int(rnd() * len(cut))]]
        finer = [t for t in tpcs if t < tg]
        f = finer[int(rnd() * len(finer))]
        boundary = ri(0, max(0, m // tg - 1)) * tg + f * ri(1, max(1, tg // f - 1))
        if boundary > m:
            boundary = f * ri(1, max(1, m // f))
    elif x < 0.85:
        boundary = small * ri(1, max(1, m // small))
    else:
        boundary = ri(1, m)
    boundary = max(1, min(boundary, m))
    states: dict[tuple[int, int], str] = {}
    for g in range(ng):
        t = tpcs[g]
        n = num_tokens // t
        if n == 0:
            continue
        end = min(n, cdiv(boundary, t))
        if kinds[g] is FULL:
            x = rnd()
            stop = end if x < 0.75 else (min(n, boundary // t) if x < 0.9 else n)
            first = 0
        else:
            w = wchunks[g]
            x = rnd()
            k = w if x < 0.45 else (w + 1 if x < 0.7 else (w + 2 if x < 0.8 else end))
            first, stop = max(0, end - k), end
            if g == eagle and end < n and rnd() < 0.8:
                stop += 1  # the EAGLE peek chunk
        for j in range(first, stop):
            states[(g, j)] = "present"
        if rnd() < 0.15:
            states.pop((g, int(rnd() * n)), None)
    if window_groups and rnd() < 0.85:
        # the chunk just left of the window OLD verifies (spec §6.5), or a neighbour
        for _ in range(1 if rnd() < 0.7 else 2):
            g = max(window_groups, key=tpcs.__getitem__) if rnd() < 0.5 else \
                window_groups[int(rnd() * len(window_groups))]
            t = tpcs[g]
            j = cdiv(boundary, t) - wchunks[g] - 1 + _SHIFT[int(rnd() * len(_SHIFT))]
            if 0 <= j < num_tokens // t:
                _set(states, g, j, _STATE_LEFT[int(rnd() * len(_STATE_LEFT))])
    if rnd() < 0.25:
        g = int(rnd() * ng)
        n = num_tokens // tpcs[g]
        if n:
            _set(states, g, int(rnd() * n), _STATE_ANY[int(rnd() * len(_STATE_ANY))])
    prefix_caching = rnd() < 0.92
    local = 0
    if prefix_caching and rnd() < 0.15:
        lcm = math.lcm(*sizes)
        if lcm < num_tokens:
            local = lcm * ri(1, max(1, min(boundary, num_tokens - 1) // lcm))
            if local >= num_tokens:
                local = 0
    return CheckCase(groups, shape.tokens_per_hash, shape.blocks_per_chunk, num_tokens, local,
                        prefix_caching, tuple(sorted([(g, j, s) for (g, j), s in states.items()])))


def _set(states: dict[tuple[int, int], str], g: int, j: int, state: str) -> None:
    if state == "missing":
        states.pop((g, j), None)
    else:
        states[(g, j)] = state


def _rng_for(seed: int, index: int, rng: random.Random | None = None) -> random.Random:
    r = rng or random.Random()
    r.seed((seed << 40) | index)
    return r


def _shape_seed(seed: int, index: int) -> int:
    return ((seed << 40) | (index // _SHARE)) ^ (0x5A17 << 56)


def scenario_at(seed: int, index: int) -> CheckCase:
    """Scenario ``index`` of the decision fuzzer's stream for ``seed``: its
    layout is drawn from ``(seed, index // 8)``, the rest from ``(seed, index)``."""
    shape = generate_shape(random.Random(_shape_seed(seed, index)))
    return generate(_rng_for(seed, index), shape)


# ----------------------------------------------------------------------------------------------
# The fast decision path
# ----------------------------------------------------------------------------------------------

def fast_outcomes(fs: CheckCase, logics: Sequence[Logic] = ("old", "new"),
                  layout: DecisionLayout | None = None) -> dict[str, dict[str, Any]]:
    """The outcome of every logic (the decision kernel, :func:`sim.io.check.run_check`'s);
    ``layout``: the kernel's layout of ``fs`` when the caller has it."""
    if layout is None:
        layout = decision_layout(fs.groups, fs.tokens_per_hash, fs.blocks_per_chunk)
    return decide(layout, fs.states, fs.num_tokens, fs.gpu_computed_tokens, fs.prefix_caching, logics)


def reference_outcomes(fs: CheckCase, logics: Sequence[Logic] = ("old", "new")
                       ) -> dict[str, dict[str, Any]]:
    """The same through the reference path, :func:`sim.io.check.reference_check`
    (validated scenario, real caches and scheduler)."""
    case = fs.to_scenario().case()   # through check/1 validation
    return {logic: reference_check(case, logic) for logic in logics}


# ----------------------------------------------------------------------------------------------
# Classification and conditions
# ----------------------------------------------------------------------------------------------


def classify(outcome: dict[str, Any]) -> str:
    """Outcome class: ``crash:<kind>``, ``defer``, ``zero``, ``hit`` or ``hit+<hazards>``."""
    crash = outcome["crash"]
    if crash is not None:
        return f"crash:{crash['kind']}"
    ext = outcome["external_tokens"]
    if ext is None:
        return "defer"
    if ext == 0:
        return "zero"
    kinds = sorted({h["kind"] for h in outcome["hazards"]})
    return "hit+" + "+".join(kinds) if kinds else "hit"


@dataclass(frozen=True, order=True, slots=True)
class Condition:
    """What a finding is deduplicated by.

    ``a``/``b``: outcome classes under the first/second logic of the pair
    (``error:<Exception>`` for a simulator bug); ``relation``: the second
    logic's hit against the first (``smaller``/``larger``/``same``) when both
    returned a positive hit, else empty; ``kind``: the kind of the group the
    crash (the second logic's first) or hazard names, empty when neither
    names one; ``unaligned``: the boundary ``L + E`` of that logic is not a
    multiple of that group's chunk; ``eagle``/``extra``: that group is an
    EAGLE group / retains extra tokens (no group named: any group);
    ``misfit``: that group is chunked-local with an attention chunk that is
    not a multiple of its chunk.
    """

    logic_a: str
    a: str
    logic_b: str
    b: str
    relation: str = ""
    kind: str = ""
    unaligned: bool = False
    eagle: bool = False
    extra: bool = False
    misfit: bool = False

    @property
    def simulator_bug(self) -> bool:
        return self.a.startswith("error:") or self.b.startswith("error:")

    def words(self) -> str:
        """The condition in words."""
        def desc(cls: str, rel: str) -> str:
            base, _, hz = cls.partition("+")
            if base.startswith("crash:"):
                text = f"crash {base[6:]}"
            elif base.startswith("error:"):
                text = f"simulator error {base[6:]}"
            else:
                text = {"defer": "None (deferred)", "zero": "0", "hit": "a hit"}[base]
            if rel and base == "hit":
                text = {"smaller": "a smaller hit", "larger": "a larger hit", "same": "the same hit"}[rel]
            elif rel and rel != "same":
                text += f" (at a {rel} hit)"
            if hz:
                text += f" with {hz.replace('+', ', ')}"
            return text

        if self.kind:
            where = f"{'unaligned' if self.unaligned else 'aligned'} {_KIND_WORD[self.kind]} hit"
            flags = [f for f, on in (("EAGLE", self.eagle), ("extra_retained_tokens", self.extra),
                                     ("attention chunk not a multiple of the chunk", self.misfit)) if on]
        else:
            where = "no group named"
            flags = [f for f, on in (("EAGLE layout", self.eagle),
                                     ("extra_retained_tokens", self.extra)) if on]
        if flags:
            where += f" ({', '.join(flags)})"
        return (f"{where}: {self.logic_a.upper()} {desc(self.a, '')}, "
                f"{self.logic_b.upper()} {desc(self.b, self.relation)}")

    def slug(self) -> str:
        """A file-name stem."""
        def part(cls: str) -> str:
            return re.sub(r"[^a-z0-9_]+", "-", cls.lower()).strip("-")

        s = f"{self.logic_a}-{part(self.a)}--{self.logic_b}-{part(self.b)}"
        if self.relation and self.relation != "same":
            s += f"-{self.relation}"
        s += f"--{_KIND_SLUG.get(self.kind, 'any')}"
        for name, on in (("unaligned", self.unaligned), ("eagle", self.eagle), ("extra", self.extra),
                         ("misfit", self.misfit)):
            if on:
                s += f"-{name}"
        return s

    def key_line(self) -> str:
        return (f"a={self.a} b={self.b} relation={self.relation or '-'} kind={self.kind or '-'} "
                f"unaligned={int(self.unaligned)} eagle={int(self.eagle)} extra={int(self.extra)} "
                f"misfit={int(self.misfit)}")


_KIND_WORD = {"full": "full-attention", "sliding_window": "sliding-window",
              "chunked_local": "chunked-local", "mamba": "mamba"}
_KIND_SLUG = {"full": "fa", "sliding_window": "swa", "chunked_local": "cla", "mamba": "mamba"}


def condition_of(fs: CheckCase, outcomes: dict[str, dict[str, Any]],
                 logics: Sequence[Logic] = ("old", "new")) -> Condition | None:
    """The condition of a finding, or None when the pair of outcomes is not one."""
    la, lb = logics[0], logics[-1]
    oa, ob = outcomes[la], outcomes[lb]
    ca, cb = classify(oa), classify(ob)
    ea, eb = oa["external_tokens"], ob["external_tokens"]
    relation = ""
    if ea and eb:
        relation = "smaller" if eb < ea else ("larger" if eb > ea else "same")
    new_hazard = any(outcomes[lg]["hazards"] for lg in logics if lg == "new")
    crashed = oa["crash"] is not None or ob["crash"] is not None
    if ca == cb and relation in ("", "same") and not crashed and not new_hazard:
        return None
    focus: tuple[int, dict[str, Any]] | None = None
    for o in (ob, oa):
        if o["crash"] is not None and o["crash"]["group"] is not None:
            focus = (o["crash"]["group"], o)
            break
    if focus is None:
        for o in (ob, oa):
            if o["hazards"]:
                focus = (o["hazards"][0]["group"], o)
                break
    if focus is None:
        return Condition(la, ca, lb, cb, relation, eagle=any(g.eagle for g in fs.groups),
                         extra=any(g.extra_retained_tokens for g in fs.groups))
    g, o = focus
    grp = fs.groups[g]
    t = fs.tpc(g)
    boundary = fs.gpu_computed_tokens + (o["external_tokens"] or 0)
    misfit = grp.kind is CLA and grp.attention_chunk is not None and grp.attention_chunk % t != 0
    return Condition(la, ca, lb, cb, relation, str(grp.kind), boundary % t != 0, grp.eagle,
                     grp.extra_retained_tokens > 0, misfit)


def _error_condition(logics: Sequence[Logic], exc: BaseException) -> Condition:
    name = f"error:{type(exc).__name__}"
    return Condition(logics[0], name, logics[-1], name)


def _key(fs: CheckCase, logics: Sequence[Logic]) -> Condition | None:
    try:
        return condition_of(fs, fast_outcomes(fs, logics), logics)
    except ModelledCrashError:  # pragma: no cover - fast_outcomes records these
        raise
    except Exception as exc:
        return _error_condition(logics, exc)


# ----------------------------------------------------------------------------------------------
# Shrinking
# ----------------------------------------------------------------------------------------------


def _remap_groups(fs: CheckCase, drop: int) -> CheckCase:
    groups = fs.groups[:drop] + fs.groups[drop + 1:]
    states = [(g - (g > drop), j, s) for g, j, s in fs.states if g != drop]
    return fs.with_states(states, groups=groups)


def _split_chunks(states: Iterable[tuple[int, int, str]], group: int | None
                  ) -> list[tuple[int, int, str]]:
    """Chunk ``j`` of ``group`` (None: of every group) becomes chunks ``2j,
    2j+1`` (the same blocks at half the chunk or block size)."""
    out = []
    for g, j, s in states:
        if group is None or g == group:
            out += [(g, 2 * j, s), (g, 2 * j + 1, s)]
        else:
            out.append((g, j, s))
    return out


def _candidates(fs: CheckCase) -> Iterator[CheckCase]:
    """Simpler variants of ``fs``, the larger reductions first."""
    ng = len(fs.groups)
    for g in range(ng):
        if ng > 1:
            yield _remap_groups(fs, g)
    n = fs.num_tokens
    need = max([(j + 1) * fs.tpc(g) for g, j, _ in fs.states], default=1)
    finest = min(fs.tpc(g) for g in range(ng))
    for cand in sorted({need + 1, need, (need + n) // 2, n - 1, n // 2, n - finest}):
        if 1 <= cand < n:
            keep = [(g, j, s) for g, j, s in fs.states if (j + 1) * fs.tpc(g) <= cand]
            yield fs.with_states(keep, num_tokens=cand,
                                 gpu_computed_tokens=fs.gpu_computed_tokens
                                 if fs.gpu_computed_tokens < cand else 0)
    # drop a leading stretch of tokens (a multiple of every chunk size): the
    # stated chunks move left, the ones that fall off are dropped
    step = math.lcm(*(fs.tpc(g) for g in range(ng)))
    first = min([j * fs.tpc(g) for g, j, _ in fs.states], default=0)
    for shift in sorted({first // step * step, first // step // 2 * step, step}, reverse=True):
        if 0 < shift < n:
            moved = [(g, j - shift // fs.tpc(g), s) for g, j, s in fs.states if j * fs.tpc(g) >= shift]
            yield fs.with_states(moved, num_tokens=n - shift,
                                 gpu_computed_tokens=max(0, fs.gpu_computed_tokens - shift))
    states = list(fs.states)
    k = len(states) // 2
    while k >= 1:
        for start in range(0, len(states), k):
            yield fs.with_states(states[:start] + states[start + k:])
        k //= 2
    for i, (g, j, s) in enumerate(states):
        if s != "present":
            yield fs.with_states([*states[:i], (g, j, "present"), *states[i + 1:]])
        if s == "retry":
            yield fs.with_states(states[:i] + states[i + 1:])
    if fs.gpu_computed_tokens:
        yield dataclasses.replace(fs, gpu_computed_tokens=0)
        lcm = math.lcm(*(g.tokens_per_block for g in fs.groups))
        yield dataclasses.replace(fs, gpu_computed_tokens=fs.gpu_computed_tokens - lcm)
    if not fs.prefix_caching:
        yield dataclasses.replace(fs, prefix_caching=True)
    for g, grp in enumerate(fs.groups):
        def with_group(new: GroupSpec, g: int = g) -> CheckCase:
            return dataclasses.replace(fs, groups=(*fs.groups[:g], new, *fs.groups[g + 1:]))

        if grp.eagle:
            yield with_group(dataclasses.replace(grp, eagle=False))
        if grp.extra_retained_tokens:
            yield with_group(dataclasses.replace(grp, extra_retained_tokens=0))
            yield with_group(dataclasses.replace(grp, extra_retained_tokens=grp.extra_retained_tokens // 2))
            yield with_group(dataclasses.replace(grp, extra_retained_tokens=grp.extra_retained_tokens - 1))
        if grp.window is not None:
            for w in sorted({grp.window // 2, grp.window - 1, grp.window - grp.tokens_per_block}):
                if w >= 1:
                    yield with_group(dataclasses.replace(grp, window=w))
        if grp.attention_chunk is not None:
            c = grp.attention_chunk
            for w in sorted({c // 2, c - 1, c - fs.tokens_per_hash, c - grp.tokens_per_block}):
                if w >= 1:
                    yield with_group(dataclasses.replace(grp, attention_chunk=w))
        if grp.kind is not FULL:
            yield with_group(GroupSpec(FULL, grp.tokens_per_block, eagle=grp.eagle))
        half = grp.tokens_per_block // 2
        if grp.kind is not MAMBA and half and half % fs.tokens_per_hash == 0:
            yield dataclasses.replace(with_group(dataclasses.replace(grp, tokens_per_block=half)),
                                      states=tuple(sorted(_split_chunks(fs.states, g))))
    if fs.blocks_per_chunk > 1:
        yield fs.with_states(_split_chunks(fs.states, None),
                             blocks_per_chunk=fs.blocks_per_chunk // 2)
    scaled = _halve(fs)
    if scaled is not None:
        yield scaled


def _halve(fs: CheckCase) -> CheckCase | None:
    """Every length halved (block sizes, windows, chunks, tokens), when exact."""
    lengths = [fs.tokens_per_hash, fs.gpu_computed_tokens]
    for g in fs.groups:
        lengths += [g.tokens_per_block, g.window or 0, g.attention_chunk or 0]
    if any(v % 2 for v in lengths):
        return None
    groups = tuple(dataclasses.replace(
        g, tokens_per_block=g.tokens_per_block // 2,
        window=None if g.window is None else g.window // 2,
        attention_chunk=None if g.attention_chunk is None else g.attention_chunk // 2,
        extra_retained_tokens=cdiv(g.extra_retained_tokens, 2)) for g in fs.groups)
    return dataclasses.replace(fs, groups=groups, tokens_per_hash=fs.tokens_per_hash // 2,
                               num_tokens=cdiv(fs.num_tokens, 2),
                               gpu_computed_tokens=fs.gpu_computed_tokens // 2)


def shrink(fs: CheckCase, target: Condition, logics: Sequence[Logic] = ("old", "new"),
           max_evals: int = 3000) -> tuple[CheckCase, int]:
    """Greedy delta debugging: the smallest variant found whose condition is
    still ``target``. Each pass walks the candidate list of the current
    scenario; after an accepted candidate the (new) list is resumed at the
    same position; passes repeat until one accepts nothing. Returns the
    shrunk scenario and the number of scenarios evaluated."""
    cur = fs
    size = cur.size()
    evals = 0
    while evals < max_evals:
        cands = list(_candidates(cur))
        pos = 0
        accepted = False
        while pos < len(cands) and evals < max_evals:
            cand = cands[pos]
            pos += 1
            csize = cand.size()
            if csize >= size or not cand.valid():
                continue
            evals += 1
            if _key(cand, logics) == target:
                cur, size = cand, csize
                accepted = True
                cands = list(_candidates(cur))
                pos -= 1
        if not accepted:
            break
    return cur, evals


# ----------------------------------------------------------------------------------------------
# The decision search
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Hits:
    """Findings of one work unit, per condition: first index, count, scenario."""

    scanned: int = 0
    findings: int = 0
    cpu_s: float = 0.0
    by_condition: dict[Condition, list[Any]] = field(default_factory=dict)
    divergences: list[tuple[int, str]] = field(default_factory=list)

    def add(self, cond: Condition, index: int, fs: CheckCase) -> None:
        self.findings += 1
        entry = self.by_condition.get(cond)
        if entry is None:
            self.by_condition[cond] = [index, 1, fs]
        else:
            entry[1] += 1
            if index < entry[0]:
                entry[0], entry[2] = index, fs

    def merge(self, other: _Hits) -> None:
        self.scanned += other.scanned
        self.findings += other.findings
        self.cpu_s += other.cpu_s
        for cond, (index, count, fs) in other.by_condition.items():
            entry = self.by_condition.get(cond)
            if entry is None:
                self.by_condition[cond] = [index, count, fs]
            else:
                entry[1] += count
                if index < entry[0]:
                    entry[0], entry[2] = index, fs
        self.divergences += other.divergences


def _search(seed: int, start: int, stop: int, logics: tuple[Logic, ...], verify_every: int) -> _Hits:
    cpu0 = time.process_time()
    hits = _Hits()
    rng = random.Random()
    shape: _Shape | None = None
    dl: DecisionLayout | None = None
    for i in range(start, stop):
        if shape is None or i % _SHARE == 0:
            shape = generate_shape(random.Random(_shape_seed(seed, i)))
            dl = decision_layout(shape.groups, shape.tokens_per_hash, shape.blocks_per_chunk)
        fs = generate(_rng_for(seed, i, rng), shape)
        try:
            outs = fast_outcomes(fs, logics, dl)
        except Exception as exc:
            hits.add(_error_condition(logics, exc), i, fs)
            continue
        cond = condition_of(fs, outs, logics)
        if cond is not None:
            hits.add(cond, i, fs)
        if verify_every and i % verify_every == 0:
            try:
                ref = reference_outcomes(fs, logics)
            except Exception as exc:
                hits.divergences.append((i, f"reference_check raised {type(exc).__name__}: {exc}"))
                continue
            if ref != outs:
                hits.divergences.append((i, f"kernel {outs} != reference_check {ref}"))
    hits.scanned = stop - start
    hits.cpu_s = time.process_time() - cpu0
    return hits


def _search_unit(args: tuple[int, int, int, tuple[Logic, ...], int]) -> _Hits:
    return _search(*args)


def _shrink_unit(args: tuple[CheckCase, Condition, tuple[Logic, ...]]) -> tuple[CheckCase, int]:
    fs, cond, logics = args
    if cond.simulator_bug:
        return fs, 0
    return shrink(fs, cond, logics)


@dataclass
class ConditionResult:
    """One condition found by a decision search."""

    condition: Condition
    first_index: int
    count: int
    found: CheckCase
    shrunk: CheckCase
    evals: int
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: Path | None = None
    status: str = ""  #: written | unchanged | kept existing | not written (...)


@dataclass
class FuzzReport:
    """The result of :func:`fuzz_decisions`."""

    seed: int
    budget: int
    jobs: int
    logics: tuple[Logic, ...]
    scanned: int
    findings: int
    wall_s: float
    search_s: float
    cpu_s: float
    conditions: list[ConditionResult]
    divergences: list[tuple[int, str]]

    @property
    def rate(self) -> float:
        """Scenarios searched per second of wall time (the search phase)."""
        return self.scanned / self.search_s if self.search_s > 0 else float("inf")

    @property
    def cpu_rate(self) -> float:
        """Scenarios per CPU second of the searching processes (one core's rate)."""
        return self.scanned / self.cpu_s if self.cpu_s > 0 else float("inf")

    @property
    def simulator_bugs(self) -> list[ConditionResult]:
        return [c for c in self.conditions if c.condition.simulator_bug]

    def table(self) -> str:
        rows = [("condition", "findings", "first", "file")]
        for c in self.conditions:
            where = f"{c.path} ({c.status})" if c.path is not None else c.status
            rows.append((c.condition.words(), str(c.count), str(c.first_index), where))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2].rjust(widths[2])}  {r[3]}"
                 for r in rows]
        lines.insert(1, "-" * (sum(widths) + 4 + max(len(r[3]) for r in rows) + 2))
        return "\n".join(lines)


def _executor(jobs: int) -> ProcessPoolExecutor | None:
    """A pool whose workers die with this process (none for one job)."""
    if jobs <= 1:
        return None
    return ProcessPoolExecutor(max_workers=jobs, initializer=worker_init, initargs=(os.getpid(),))


#: work units submitted ahead per worker (:func:`~sim.tools.run.pool_map`)
_AHEAD = 4


def fuzz_decisions(budget: int, seed: int, *, logics: tuple[Logic, ...] = ("old", "new"),
                   out: Path | None = None, jobs: int = 1, verify_every: int = 4096,
                   progress: Callable[[int], None] | None = None,
                   command: str = "") -> FuzzReport:
    """Search ``budget`` scenarios of ``seed``; shrink, verify and (with ``out``)
    write one library entry per condition. See the module docstring."""
    t0 = time.perf_counter()
    units = ((seed, a, min(budget, a + _BLOCK), logics, verify_every) for a in range(0, budget, _BLOCK))
    total = _Hits()
    pool = _executor(jobs)
    with owned(pool):
        results: Iterable[_Hits] = (pool_map(pool, _search_unit, units, _AHEAD * jobs) if pool
                                    else map(_search_unit, units))
        for h in results:
            total.merge(h)
            if progress is not None:
                progress(h.scanned)
        search_s = time.perf_counter() - t0
        order = sorted(total.by_condition.items(), key=lambda kv: kv[1][0])
        tasks = [(entry[2], cond, logics) for cond, entry in order]
        shrunk = (list(pool_map(pool, _shrink_unit, tasks, _AHEAD * jobs)) if pool
                  else [_shrink_unit(t) for t in tasks])
    conditions: list[ConditionResult] = []
    divergences = list(total.divergences)
    for (cond, (index, count, found)), (small, evals) in zip(order, shrunk, strict=True):
        cr = ConditionResult(cond, index, count, found, small, evals)
        conditions.append(cr)
        if cond.simulator_bug:
            cr.status = "simulator bug"
            if out is not None:
                cr.path, cr.status = _write_simbug(out, cr, seed, command)
            continue
        try:
            cr.outcomes = reference_outcomes(small, logics)
        except Exception as exc:
            divergences.append((index, f"reference_check raised {type(exc).__name__} on the shrunk case: "
                                       f"{exc}"))
            cr.status = "not written (reference_check raised)"
            continue
        if condition_of(small, cr.outcomes, logics) != cond:
            divergences.append((index, "reference_check: another condition on the shrunk case: "
                                       f"{cr.outcomes}"))
            cr.status = "not written (reference_check disagrees)"
            continue
        if out is not None:
            cr.path, cr.status = _write_case(out, cr, seed, budget, logics, command)
    return FuzzReport(seed, budget, jobs, logics, total.scanned, total.findings,
                      time.perf_counter() - t0, search_s, total.cpu_s, conditions, divergences)


# ----------------------------------------------------------------------------------------------
# Writing library entries
# ----------------------------------------------------------------------------------------------


def expectation(outcome: dict[str, Any]) -> dict[str, Any]:
    """An ``[expect.<logic>]`` table that pins an outcome."""
    ext = outcome["external_tokens"]
    exp: dict[str, Any] = {}
    if ext is not None:
        exp["external_tokens"] = ext
    exp["deferred"] = ext is None
    exp["crash"] = "none" if outcome["crash"] is None else outcome["crash"]["kind"]
    exp["load_async"] = outcome["load_async"]
    exp["load_keys"] = outcome["load_keys"]
    exp["group_sizes"] = outcome["group_sizes"]
    exp["block_indices"] = outcome["block_indices"]
    exp["hazards"] = sorted(h["kind"] for h in outcome["hazards"])
    return exp


def library_entry(cr: ConditionResult, seed: int, logics: Sequence[Logic], origin: str) -> str:
    """The library entry of a condition (check/1 TOML text)."""
    fs = cr.shrunk
    notes = [f"fuzz condition: {cr.condition.words()}",
             f"fuzz key: {cr.condition.key_line()}",
             f"found by {origin} at scenario index {cr.first_index} (seed {seed}; "
             f"{cr.count} findings of this condition); shrunk from {cr.found.num_tokens} tokens, "
             f"{len(cr.found.groups)} groups, {len(cr.found.states)} stated chunks",
             "outcomes observed with kvsim's model (sim.io.check.run_check), not derived by hand"]
    notes += [f"{logic.upper()}: {summarize(cr.outcomes[logic])}" for logic in dict.fromkeys(logics)]
    window_logic = "both" if len(set(logics)) > 1 else logics[0]
    expect: dict[str, dict[str, Any]] = {lg: expectation(cr.outcomes[lg]) for lg in dict.fromkeys(logics)}
    return case_toml(fs, name=f"fuzz-{cr.condition.slug()}", window_logic=window_logic, expect=expect,
                     notes=notes)


def _write_text(path: Path, text: str) -> str:
    """Write unless a file is there: ``written``, ``unchanged`` or ``kept existing``.

    Raises:
        InputError: it cannot be written (one ``--out`` line; no temporary file is left).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        if path.exists():
            return "unchanged" if path.read_text(encoding="utf-8") == text else "kept existing"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except UnicodeDecodeError:
        return "kept existing"
    except OSError as exc:
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
        raise out_error(path, exc) from None
    return "written"


def _write_case(out: Path, cr: ConditionResult, seed: int, budget: int, logics: Sequence[Logic],
                command: str) -> tuple[Path, str]:
    origin = command or f"kvsim fuzz --budget {budget} --seed {seed}"
    text = library_entry(cr, seed, logics, origin)
    # the entry must be a valid check/1 file that reproduces its outcomes
    case = parse_check(tomllib.loads(text), f"{cr.condition.slug()}.toml").case()
    for logic in dict.fromkeys(logics):
        if run_check(case, logic) != cr.outcomes[logic]:  # pragma: no cover - a kvsim bug
            raise RuntimeError(f"written case {cr.condition.slug()} does not reproduce under {logic}")
    path = out / f"{cr.condition.slug()}.toml"
    return path, _write_text(path, text)


def _write_simbug(out: Path, cr: ConditionResult, seed: int, command: str) -> tuple[Path, str]:
    """A simulator bug: the scenario as a check/1 JSON object (not a library
    entry: ``kvsim regress`` reads ``*.toml`` only); ``kvsim check`` shows it."""
    data = cr.found.check_data()
    data["name"] = f"simbug-{cr.condition.slug()}-seed{seed}-i{cr.first_index}"
    path = out / "simbugs" / f"{data['name']}.json"
    return path, _write_text(path, json.dumps(data, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------
# The whole-run fuzzer
# ----------------------------------------------------------------------------------------------


class _NullSink:
    def write(self, table: str, columns: dict[str, list[Any]]) -> None:
        return None


def run_config(rng: random.Random, copy_path: bool = False) -> dict[str, Any]:
    """A random small ``run/1`` scenario (``window_logic`` left to the caller)."""
    rnd = rng.random
    rint = rng.randint
    tph = _pick(rng, (4, 8, 16))
    bpc = _pick(rng, (1, 1, 2, 4))
    ng = _pick(rng, (1, 2, 2, 3))
    groups: list[dict[str, Any]] = []
    mamba_bs = 0
    for gi in range(ng):
        x = rnd()
        kind = "full" if gi == 0 and x < 0.8 else ("sliding_window" if x < 0.6 else (
            "full" if x < 0.75 else ("chunked_local" if x < 0.9 else "mamba")))
        bs = tph * _pick(rng, (1, 1, 2, 4))
        if kind == "mamba":
            bs = mamba_bs or bs
            mamba_bs = bs
        grp: dict[str, Any] = {"kind": kind, "tokens_per_block": bs}
        t = bs * bpc
        if kind == "sliding_window":
            grp["window"] = rint(1, 3 * t)
            if rnd() < 0.05:
                grp["extra_retained_tokens"] = rint(1, bs)
        elif kind == "chunked_local":
            grp["attention_chunk"] = t * rint(1, 3)
        grp.update({"layers": rint(1, 2), "kv_heads": _pick(rng, (1, 2)), "head_size": _pick(rng, (4, 8))})
        groups.append(grp)
    if rnd() < 0.15:
        groups[int(rnd() * ng)]["eagle"] = True
    workload: dict[str, Any]
    if rnd() < 0.3:
        lo = rint(4, 200)
        workload = {"kind": "uniform", "requests": rint(5, 30), "rate_per_s": _pick(rng, (2.0, 10.0, 50.0)),
                    "input_tokens_min": lo, "input_tokens_max": lo + rint(0, 400),
                    "output_tokens_min": 1, "output_tokens_max": rint(1, 48)}
        longest = workload["input_tokens_max"] + workload["output_tokens_max"]
    else:
        # shared system prompts and follow-up turns: prefixes come back after
        # the small GPU pool has forgotten them (CPU hits, loads in flight)
        workload = {"kind": "multiturn", "sessions": rint(4, 12),
                    "session_rate_per_s": _pick(rng, (5.0, 20.0)),
                    "turns_mean": _pick(rng, (2.0, 3.0, 4.0)), "turns_max": rint(2, 6),
                    "system_prompt_tokens": _pick(rng, (0, 64, 200, 400)),
                    "system_prompts": rint(1, 2),
                    "first_user_tokens_mean": float(rint(20, 300)),
                    "followup_user_tokens_mean": float(rint(5, 80)),
                    "output_tokens_mean": float(rint(2, 40)), "max_context_tokens": rint(600, 1500),
                    "think_time_mean_s": _pick(rng, (0.05, 0.3, 1.0))}
        longest = workload["max_context_tokens"] + 400
    # a pool that holds the longest request (or not quite: rejections) a few times
    # at most, so that requests are preempted and the GPU prefix cache forgets
    per_req = sum(cdiv(min(longest, 600), g["tokens_per_block"]) for g in groups)
    gpu_blocks = max(8, int(per_req * _pick(rng, (0.6, 0.9, 1.3, 2.0))))
    data: dict[str, Any] = {
        "schema": "run/1", "seed": rint(0, 10**6), "on_crash": "record",
        "model": {"label": "fuzz", "groups": groups},
        "hardware": {"profile": "h200", "gpu_blocks": gpu_blocks,
                     "h2d_bandwidth": _pick(rng, (2e5, 2e6, 2e8)),
                     "d2h_bandwidth": _pick(rng, (2e5, 2e6, 2e8)),
                     "h2d_latency_s": _pick(rng, (0.0, 1e-3, 2e-2)),
                     "d2h_latency_s": _pick(rng, (0.0, 1e-3, 2e-2))},
        "cpu_cache": {"chunks": rint(2, 300), "policy": "lru" if rnd() < 0.8 else "arc"},
        "scheduler": {"max_num_batched_tokens": _pick(rng, (32, 64, 256, 2048)),
                      "max_num_seqs": rint(1, 8), "prefix_caching": rnd() < 0.7,
                      "blocks_per_chunk": bpc, "tokens_per_hash": tph,
                      "offload_prompt_only": rnd() < 0.7, "fast_forward": rnd() < 0.8},
        "workload": workload,
        "costs": {"step": {"overhead_s": _pick(rng, (1e-3, 5e-3)), "prefill_token_s": 1e-5,
                           "decode_seq_s": 1e-4, "context_token_s": 0.0},
                  "transfer": "hardware"},
        # a generous simulated-time limit: reaching it with requests left is a stall
        "output": {"occupancy_interval_s": 1.0, "max_sim_time_s": 3600.0},
    }
    if copy_path:
        data["copy_path"] = {"enabled": True, "mode": "fingerprint", "device": "cpu"}
    return data


@dataclass
class RunFinding:
    """One distinct whole-run finding."""

    kind: str  #: invariant | error | stall | integrity
    logic: str
    detail: str
    index: int
    count: int
    data: dict[str, Any]
    path: Path | None = None
    status: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        """Deduplication key: kind, logic and the message with numbers and
        addresses blanked."""
        text = re.sub(r"0x[0-9a-fA-F]+", "ADDR", self.detail)
        return (self.kind, self.logic, re.sub(r"\d+", "N", text)[:120])


def _simulate(data: dict[str, Any], source: Path) -> SimulationResult:
    spec = build_run(data, source)
    return simulate(spec.engine_config(), spec.requests(), Recorder(_NullSink()))


COVERAGE = ("preemptions", "load_jobs", "store_rejections", "deferrals", "requests_rejected", "crashes",
             "hazards", "integrity_violations")


class _WallTimeout(BaseException):
    """Raised by the wall-clock guard (a BaseException, so that no handler
    inside the engine swallows it)."""


def _guarded(fn: Callable[[], SimulationResult], seconds: float) -> SimulationResult:
    """``fn()`` under a wall-clock limit (SIGALRM; main thread on POSIX only,
    else unguarded)."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or \
            threading.current_thread() is not threading.main_thread():
        return fn()

    def alarm(signum: int, frame: Any) -> None:
        raise _WallTimeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


COVERAGE = ("preemptions", "load_jobs", "store_rejections", "deferrals", "requests_rejected", "crashes",
             "hazards", "integrity_violations")


#: the logics each whole run is simulated under: the three releases kvsim models
RUN_LOGICS: tuple[Logic, ...] = ("old", "new", "latest")


def _check_run(data: dict[str, Any], logic: str, copy_path: bool, wall_limit_s: float = 10.0
               ) -> tuple[tuple[str, str] | None, dict[str, int]]:
    """(kind, detail) of a finding of one run (or None), and which behaviours
    the run exercised (:data:`COVERAGE` counters, 0/1).

    Kinds: ``invariant`` (an end-of-run invariant failed), ``error`` (any other
    exception), ``stall`` (the simulated time limit or the wall-clock guard
    was reached with requests unfinished: a livelock), ``integrity`` (NEW read
    wrong KV, with the copy path)."""
    run = {**data, "window_logic": logic}
    try:
        res = _guarded(lambda: _simulate(run, Path("fuzz-run.toml")), wall_limit_s)
    except _WallTimeout:
        return ("stall", f"still running after {wall_limit_s:g} s of wall-clock time"), {}
    except InvariantViolation as exc:
        return ("invariant", str(exc)), {}
    except InputError:
        raise
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}"), {}
    s = res.summary
    seen = {f"{logic}:{name}": int(bool(getattr(s, name))) for name in COVERAGE}
    if res.status != "ok":
        done = s.requests_finished + s.requests_rejected
        return ("stall", f"status {res.status} at {s.sim_time_s:g} s simulated: {done} of "
                         f"{s.requests_arrived} requests done, {s.preemptions} preemptions, "
                         f"{s.load_jobs} load jobs"), seen
    if copy_path and logic == "new" and s.integrity_violations:
        return ("integrity", f"{s.integrity_violations} integrity violations under NEW"), seen
    return None, seen


def _run_unit(args: tuple[int, int, int, bool]) -> tuple[int, list[RunFinding], dict[str, int]]:
    seed, start, stop, copy_path = args
    found: list[RunFinding] = []
    seen: dict[str, int] = {}
    rng = random.Random()
    for i in range(start, stop):
        data = run_config(_rng_for(seed, i, rng), copy_path)
        for logic in RUN_LOGICS:
            hit, cov = _check_run(data, logic, copy_path)
            for k, v in cov.items():
                seen[k] = seen.get(k, 0) + v
            if hit is not None:
                found.append(RunFinding(hit[0], logic, hit[1], i, 1, {**data, "window_logic": logic}))
    return stop - start, found, seen


def _shrink_run(f: RunFinding, copy_path: bool, max_tries: int = 10) -> RunFinding:
    """The shortest request stream (``workload.limit``, by bisection) that
    still gives a finding of the same kind; a stall is first tried with a
    60 s simulated-time limit (quicker to replay)."""
    data = f.data
    logic = data["window_logic"]
    if f.kind == "stall":
        quick = {**data, "output": {**data["output"], "max_sim_time_s": 60.0}}
        hit = _check_run(quick, logic, copy_path)[0]
        if hit is not None and hit[0] == "stall":
            data = quick
        else:
            max_tries = 3
    wl = data["workload"]
    n = sum(1 for _ in build_run(data, Path("fuzz-run.toml")).requests())
    lo, hi = 1, n
    best = data
    tries = 0
    while lo < hi and tries < max_tries:
        mid = (lo + hi) // 2
        cand = {**data, "workload": {**wl, "limit": mid}}
        tries += 1
        hit = _check_run(cand, logic, copy_path)[0]
        if hit is not None and hit[0] == f.kind:
            best, hi = cand, mid
        else:
            lo = mid + 1
    return dataclasses.replace(f, data=best)


@dataclass
class RunFuzzReport:
    """The result of :func:`fuzz_runs`."""

    seed: int
    runs: int
    simulations: int
    wall_s: float
    findings: list[RunFinding]
    #: ``logic:behaviour`` -> simulations that showed it (preemptions, loads, ...)
    coverage: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.runs / self.wall_s if self.wall_s > 0 else float("inf")


def run_toml(f: RunFinding, seed: int, origin: str) -> str:
    head = (f"# kvsim fuzz --runs finding: {f.kind} under {f.logic.upper()} (seen in {f.count} run(s))\n"
            f"# found by {origin} at run index {f.index} (seed {seed})\n"
            f"# {f.detail[:300]}\n# replay: kvsim run THIS_FILE\n")
    return head + tomli_w.dumps({**f.data, "name": f"fuzz-run-s{seed}-i{f.index}-{f.logic}"})


def fuzz_runs(runs: int, seed: int, *, copy_path: bool = False, out: Path | None = None, jobs: int = 1,
              progress: Callable[[int], None] | None = None, command: str = "",
              unit: int = 8) -> RunFuzzReport:
    """Simulate ``runs`` random small runs under each of :data:`RUN_LOGICS`; collect findings."""
    if copy_path:
        import torch  # noqa: F401, PLC0415 -- optional extra; fail early, with the caller's message
    t0 = time.perf_counter()
    units = ((seed, a, min(runs, a + unit), copy_path) for a in range(0, runs, unit))
    pool = _executor(jobs)
    distinct: dict[tuple[str, str, str], RunFinding] = {}
    coverage: dict[str, int] = {}
    with owned(pool):
        results = pool_map(pool, _run_unit, units, _AHEAD * jobs) if pool else map(_run_unit, units)
        for done, found, seen in results:
            for k, v in seen.items():
                coverage[k] = coverage.get(k, 0) + v
            for f in found:
                have = distinct.get(f.key)
                if have is None:
                    distinct[f.key] = f
                else:
                    have.count += 1
            if progress is not None:
                progress(done)
    wall = time.perf_counter() - t0
    findings = sorted(distinct.values(), key=lambda f: (f.index, f.logic))
    origin = command or f"kvsim fuzz --runs {runs} --seed {seed}" + (" --copy-path" if copy_path else "")
    findings = [_shrink_run(f, copy_path) for f in findings]
    for f in findings:
        if out is not None:
            f.path = out / f"fuzz-run-s{seed}-i{f.index}-{f.logic}-{f.kind}.toml"
            f.status = _write_text(f.path, run_toml(f, seed, origin))
    return RunFuzzReport(seed, runs, len(RUN_LOGICS) * runs, wall, findings, dict(sorted(coverage.items())))
