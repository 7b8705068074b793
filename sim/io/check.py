"""``check/1`` scenarios: one request's lookup, allocation and load plan.

A check scenario states a layout, a prompt length, an optional local GPU
prefix hit and the CPU chunk states of the groups, and asks what the modelled
vLLM scheduler does for one new request, under the OLD, NEW and/or LATEST
logic (``window_logic = "both"`` decides OLD and NEW; a file that also states
``[expect.latest]`` has that checked as well, see :func:`evaluate`):
how many tokens it will load (or that it defers), which chunks it passes to
``prepare_load``, which GPU blocks the load fills, and whether an assertion
fires (a *modelled crash*, reported as an outcome).

Nothing here decides an outcome. :func:`run_check` and :func:`evaluate` ask
the decision kernel (:mod:`sim.model.decision`: the scheduler's lookup and
load plan on a read-only chunk-state table and a closed-form allocation).
The reference path, :func:`build_world` / :func:`reference_check`, builds the
scenario's state in the real model objects
(:class:`~sim.model.cpu_cache.CpuChunkCache`,
:class:`~sim.model.gpu_cache.GpuKVCache`, :class:`~sim.model.connector.OffloadingScheduler`)
and executes the model; ``tests/model/test_decision.py`` holds both equal.

State construction (the reference path; the kernel reads the same states)
    * ``present``: ``prepare_store`` + ``complete_store``;
    * ``pending``: ``prepare_store`` only (ref count -1);
    * ``loading``: present, then ``prepare_load`` by another request (ref 1)
      and, with GPU prefix caching, in the scheduler's being-loaded set;
    * ``retry``: absent, and the (asynchronous) tier answers RETRY for it; it
      counts as missing if a load reaches it (vLLM's CPU manager never answers
      RETRY);
    * local hit: the blocks each kind retains at ``gpu_computed_tokens`` are
      cached, hashed GPU blocks found by the GPU prefix cache;
    * ``[[tiers]]`` (secondary tiers behind the CPU cache, vLLM 0.33's
      tiering, :class:`~sim.model.tiers.TieredCache`): each entry's
      ``chunk_states`` says what that tier holds, ``present`` (readable:
      ``prepare_store`` + ``complete_store`` in the tier) or ``pending`` (its
      cascade write in flight: ``prepare_store`` only, a lookup passes over
      it); the CPU states are built without cascading them. A lookup of a
      chunk the CPU cache lacks and a tier holds starts a promotion and
      answers HIT_PENDING (the request defers), as the model does; the
      outcome then lists ``promotions`` (``[tier, group, chunk]``, tier 1 the
      first ``[[tiers]]`` entry, vLLM's label index). The CPU cache must have
      room for every chunk a lookup may promote, so that no promotion evicts
      or fails (``cpu_capacity_chunks`` is checked for it; unset, it is sized
      so).
    Chunks are stored in (group, chunk) order; one worker; the GPU pool is
    large enough never to run out.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import orjson
from pydantic import BaseModel, Field, ValidationError, model_validator

from sim.errors import InputError
from sim.io.schema import (
    MAX_CPU_CHUNKS,
    MAX_GPU_BLOCKS,
    WHY_CPU_CHUNKS,
    WHY_GPU_BLOCKS,
    GroupEntry,
    ProblemError,
    Strict,
    Tokens,
    at_most,
    check_schema,
)
from sim.model.connector import LoadPlan, ModelledCrashError, OffloadingScheduler
from sim.model.cpu_cache import CpuChunkCache, key_parts, offload_key
from sim.model.decision import MISSING, DecisionLayout, decide, decide_codes, decision_layout, state_code
from sim.model.gpu_cache import Block, GpuKVCache
from sim.model.layout import GroupKind, GroupSpec, Layout, LayoutError, cdiv
from sim.model.scheduler import ReproducerSnapshot
from sim.model.tiers import TieredCache, TierSpec
from sim.model.windows import profile

__all__ = [
    "CheckCase",
    "CheckScenario",
    "KernelTable",
    "case_outcomes",
    "case_toml",
    "compare",
    "load_check_file",
    "parse_check",
    "prepare_check",
    "reference_check",
    "run_check",
    "scenario_outcomes",
    "toml_value",
    "write_reproducers",
]

ChunkStateName = Literal["present", "pending", "loading", "retry"]
TierChunkStateName = Literal["present", "pending"]
Logic = Literal["old", "new", "latest"]


#: CheckScenario.layout's cache: (groups, tokens per hash, blocks per chunk) -> Layout
#: (Layout is frozen; a LayoutError is raised before anything is cached)
_MODEL_LAYOUTS: dict[tuple[object, ...], Layout] = {}
_MODEL_LAYOUT_CACHE_SIZE = 4096


class CheckGroup(GroupEntry):
    """One KV cache group of a check scenario (the fields of :class:`~sim.io.schema.GroupEntry`)."""


class Expectation(Strict):
    """Expected outcome under one logic; keys left out are not compared."""

    external_tokens: int | None = Field(None, ge=0, description="tokens to load (not deferred)")
    deferred: bool | None = Field(None, description="the lookup answers 'ask again later'")
    load_async: bool | None = None
    load_keys: list[Annotated[list[int], Field(min_length=2, max_length=2)]] | None = Field(
        None, description="sorted [group, chunk] pairs")
    group_sizes: list[int] | None = None
    block_indices: list[int] | None = None
    crash: Literal["none", "missing_chunk", "chunk_not_ready", "assertion"] | None = None
    hazards: list[Literal["double_load"]] | None = None
    promotions: list[Annotated[list[int], Field(min_length=3, max_length=3)]] | None = Field(
        None, description="sorted [tier, group, chunk] triples the lookup promotes (tier 1: the first "
                          "[[tiers]] entry)")


class CheckTier(Strict):
    """One secondary tier behind the CPU cache (``[[tiers]]``): what it holds."""

    chunk_states: dict[str, dict[str, TierChunkStateName]] = Field(
        default_factory=dict, description="group -> chunk or range -> present | pending (write in flight)")


class CheckScenario(Strict):
    """A ``check/1`` scenario (see the module docstring)."""

    schema_: Literal["check/1"] = Field(alias="schema", description="format and version")
    name: str | None = Field(None, description="optional label")
    window_logic: Literal["old", "new", "latest", "both"] = "both"
    groups: list[CheckGroup] = Field(min_length=1)
    blocks_per_chunk: Annotated[int, at_most(MAX_GPU_BLOCKS, "GPU blocks", WHY_GPU_BLOCKS)] = Field(1, gt=0)
    tokens_per_hash: Tokens = Field(gt=0)
    num_tokens: Tokens = Field(gt=0, description="prompt length in tokens (limit: sim.io.schema.MAX_TOKENS)")
    gpu_computed_tokens: Tokens = Field(0, ge=0, description="local GPU prefix-cache hit")
    prefix_caching: bool = True
    cpu_capacity_chunks: Annotated[int, at_most(MAX_CPU_CHUNKS, "chunks", WHY_CPU_CHUNKS)] | None = Field(
        None, gt=0)
    chunk_states: dict[str, dict[str, ChunkStateName]] = Field(default_factory=dict)
    tiers: list[CheckTier] = Field(default_factory=list, description="secondary tiers, in lookup order")
    expect: dict[Logic, Expectation] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _groups_valid(self) -> CheckScenario:
        self.layout()  # raises LayoutError, turned into a located error by the caller
        return self

    def layout(self) -> Layout:
        """The model layer's layout (one immutable object per distinct layout: a
        batch of scenarios over a few layouts builds each once)."""
        key = (tuple((g.kind, g.tokens_per_block, g.window, g.attention_chunk, g.extra_retained_tokens,
                      g.eagle) for g in self.groups), self.tokens_per_hash, self.blocks_per_chunk)
        layout = _MODEL_LAYOUTS.get(key)
        if layout is None:
            layout = Layout.of([g.spec() for g in self.groups], self.tokens_per_hash, self.blocks_per_chunk)
            if len(_MODEL_LAYOUTS) >= _MODEL_LAYOUT_CACHE_SIZE:
                _MODEL_LAYOUTS.clear()
            _MODEL_LAYOUTS[key] = layout
        return layout

    def case(self, source: str = "<check>") -> CheckCase:
        """The plain :class:`CheckCase` of this (validated) scenario; its expectations are dropped."""
        states = expand_chunk_states(self, self.name or source)
        tier_states = expand_tier_states(self, self.name or source, states)
        return CheckCase(tuple(g.spec() for g in self.groups), self.tokens_per_hash, self.blocks_per_chunk,
                         self.num_tokens, self.gpu_computed_tokens, self.prefix_caching,
                         tuple(sorted((g, j, st) for (g, j), st in states.items())), self.cpu_capacity_chunks,
                         len(self.tiers), tier_states)

    def logics(self) -> tuple[Logic, ...]:
        return ("old", "new") if self.window_logic == "both" else (self.window_logic,)


@dataclass(frozen=True, slots=True)
class CheckCase:
    """One ``check/1`` case as plain data: what ``kvsim check``, the crash
    library, the fuzzer and the reproducers of a run all hand to
    :func:`run_check` (no validation on construction: the fuzzer builds
    millions; :meth:`valid` and :meth:`to_scenario` validate).

    ``states`` lists ``(group, chunk, state)`` sorted by group and chunk;
    chunks not listed are missing. ``cpu_capacity_chunks`` None sizes the CPU
    cache to hold the stated chunks (at least 100) and every chunk a tier
    could promote. ``tiers`` secondary tiers; ``tier_states`` lists
    ``(tier, group, chunk, state)`` (tier 0: the first secondary tier; state
    ``present`` or ``pending``), sorted.
    """

    groups: tuple[GroupSpec, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    num_tokens: int
    gpu_computed_tokens: int = 0
    prefix_caching: bool = True
    states: tuple[tuple[int, int, str], ...] = ()
    cpu_capacity_chunks: int | None = None
    tiers: int = 0
    tier_states: tuple[tuple[int, int, int, str], ...] = ()

    @classmethod
    def from_snapshot(cls, snap: ReproducerSnapshot) -> CheckCase:
        """The case a request met when it crashed or hit a hazard in a run."""
        states = tuple((g, j, r.state) for g, ranges in snap.chunk_states for r in ranges
                       for j in range(r.first, r.last + 1))
        return cls(snap.groups, snap.tokens_per_hash, snap.blocks_per_chunk, snap.num_tokens,
                   snap.local_hit_tokens, snap.prefix_caching, tuple(sorted(states)),
                   snap.cpu_capacity_chunks)

    def layout(self) -> Layout:
        return Layout.of(list(self.groups), self.tokens_per_hash, self.blocks_per_chunk)

    def tpc(self, g: int) -> int:
        return self.groups[g].tokens_per_block * self.blocks_per_chunk

    def valid(self) -> bool:
        """Whether ``check/1`` accepts it (and ``run_check`` can build it)."""
        try:
            self.layout()
        except LayoutError:
            return False
        n = self.num_tokens
        if n < 1 or self.tokens_per_hash < 1:
            return False
        local = self.gpu_computed_tokens
        if local < 0 or local >= n or any(local % g.tokens_per_block for g in self.groups):
            return False
        if local and not self.prefix_caching:
            return False  # a local hit needs the GPU prefix cache
        seen = set()
        for g, j, _ in self.states:
            if g >= len(self.groups) or j < 0 or j >= n // self.tpc(g) or (g, j) in seen:
                return False
            seen.add((g, j))
        tier_seen = set()
        for t, g, j, st in self.tier_states:
            if not 0 <= t < self.tiers or g >= len(self.groups) or j < 0 or j >= n // self.tpc(g) \
                    or (t, g, j) in tier_seen or st not in ("present", "pending"):
                return False
            tier_seen.add((t, g, j))
        cap = self.cpu_capacity_chunks
        return cap is None or len(seen) + len(self.promotable()) <= cap

    def promotable(self) -> set[tuple[int, int]]:
        """The chunks the CPU cache lacks and some tier holds readable: what a lookup may promote."""
        cpu = {(g, j) for g, j, _ in self.states}
        return {(g, j) for _, g, j, st in self.tier_states if st == "present"} - cpu

    def tier_map(self) -> dict[tuple[int, int], int] | None:
        """The kernel's ``tiers``: (group, chunk) -> the first tier holding it
        readable, numbered from 1 (vLLM's label index); None without tiers."""
        if not self.tiers:
            return None
        out: dict[tuple[int, int], int] = {}
        for t, g, j, st in sorted(self.tier_states):
            if st == "present":
                out.setdefault((g, j), t + 1)
        return out

    def size(self) -> int:
        """What shrinking minimises (smaller is simpler)."""
        s = 10_000 * len(self.groups) + self.num_tokens + self.gpu_computed_tokens
        s += 10 * len(self.states) + 3 * sum(st != "present" for _, _, st in self.states)
        s += 50 * self.tiers + 10 * len(self.tier_states)
        s += 10 * self.blocks_per_chunk + (0 if self.prefix_caching else 100)
        for g in self.groups:
            s += g.tokens_per_block + (g.window or 0) + (g.attention_chunk or 0)
            s += g.extra_retained_tokens + (50 if g.eagle else 0)
            s += 0 if g.kind is GroupKind.FULL else 20
        return s

    def state_ranges(self, states: Sequence[tuple[int, int, str]] | None = None) -> dict[str, dict[str, str]]:
        """``chunk_states`` (of ``states``, default the CPU cache's) with runs of one
        state written as ``"a..b"``."""
        out: dict[str, dict[str, str]] = {}
        i = 0
        st = self.states if states is None else states
        while i < len(st):
            g, j, name = st[i]
            k = i
            while k + 1 < len(st) and st[k + 1][0] == g and st[k + 1][1] == st[k][1] + 1 \
                    and st[k + 1][2] == name:
                k += 1
            out.setdefault(str(g), {})[str(j) if k == i else f"{j}..{st[k][1]}"] = name
            i = k + 1
        return out

    def check_data(self, logics: Sequence[Logic] = ("old", "new")) -> dict[str, Any]:
        """The ``check/1`` object (no expectations)."""
        window_logic = "both" if len(set(logics)) > 1 else logics[0]
        data: dict[str, Any] = {
            "schema": "check/1", "window_logic": window_logic,
            "groups": [g.to_dict() for g in self.groups],
            "blocks_per_chunk": self.blocks_per_chunk, "tokens_per_hash": self.tokens_per_hash,
            "num_tokens": self.num_tokens, "gpu_computed_tokens": self.gpu_computed_tokens,
            "prefix_caching": self.prefix_caching, "chunk_states": self.state_ranges()}
        if self.cpu_capacity_chunks is not None:
            data["cpu_capacity_chunks"] = self.cpu_capacity_chunks
        if self.tiers:
            data["tiers"] = [{"chunk_states": self.tier_ranges(t)} for t in range(self.tiers)]
        return data

    def tier_ranges(self, tier: int) -> dict[str, dict[str, str]]:
        """Tier ``tier``'s (0: the first secondary) ``chunk_states`` as ranges."""
        return self.state_ranges([(g, j, st) for t, g, j, st in self.tier_states if t == tier])

    def to_scenario(self, source: str = "<check>") -> CheckScenario:
        """Validated :class:`CheckScenario` (raises :class:`InputError` if invalid)."""
        return parse_check(self.check_data(), source)

    def with_states(self, states: Iterable[tuple[int, int, str]], **changes: Any) -> CheckCase:
        return dataclasses.replace(self, states=tuple(sorted(states)), **changes)


def _parse_chunk_range(text: str) -> range | None:
    lo, sep, hi = text.partition("..")
    try:
        a = int(lo)
        b = int(hi) if sep else a
    except ValueError:
        return None
    if a < 0 or b < a:
        return None
    return range(a, b + 1)


def _expand_table(sc: CheckScenario, source: str, where: str, chunk_states: Mapping[str, Mapping[str, str]]
                  ) -> dict[tuple[int, int], Any]:
    """One ``chunk_states`` table (at ``where``) as {(group, chunk): state}, validated against the layout."""
    layout = sc.layout()
    out: dict[tuple[int, int], Any] = {}
    origin: dict[tuple[int, int], str] = {}  # (group, chunk) -> the range that states it
    for gkey, table in chunk_states.items():
        if not gkey.isdigit() or int(gkey) >= len(sc.groups):
            raise InputError(source, f"{where}.{gkey}", "unknown group",
                             f"a group index 0..{len(sc.groups) - 1}")
        g = int(gkey)
        limit = layout.num_keys(g, sc.num_tokens)
        for ckey, state in table.items():
            rng = _parse_chunk_range(ckey)
            if rng is None:
                raise InputError(source, f"{where}.{gkey}.{ckey}", "not a chunk index or range",
                                 'a chunk index "14" or an inclusive range "118..121"')
            if rng[-1] >= limit:
                raise InputError(source, f"{where}.{gkey}.{ckey}",
                                 f"chunk {rng[-1]} is beyond the prompt's {limit} complete chunks",
                                 f"chunk indices 0..{limit - 1}")
            for j in rng:
                prev = origin.get((g, j))
                if prev is not None:
                    raise InputError(source, f"{where}.{gkey}",
                                     f'ranges "{prev}" ({table[prev]}) and "{ckey}" ({state}) both state '
                                     f"chunk {j}", "ranges that do not overlap: one state per chunk")
                origin[(g, j)] = ckey
                out[(g, j)] = state
    return out


def expand_chunk_states(sc: CheckScenario, source: str) -> dict[tuple[int, int], ChunkStateName]:
    """``chunk_states`` as {(group, chunk): state}, validated against the layout."""
    out = _expand_table(sc, source, "chunk_states", sc.chunk_states)
    cap = sc.cpu_capacity_chunks
    if cap is not None and len(out) > cap:
        raise InputError(source, "cpu_capacity_chunks",
                         f"{len(out)} stated chunks exceed the capacity {cap}",
                         f"at least {len(out)}")
    local = sc.gpu_computed_tokens
    if local >= sc.num_tokens or any(local % g.tokens_per_block for g in sc.groups):
        raise InputError(source, "gpu_computed_tokens", f"{local}",
                         f"below num_tokens={sc.num_tokens} and a multiple of every tokens_per_block")
    if local and not sc.prefix_caching:
        raise InputError(source, "gpu_computed_tokens", f"{local} with prefix_caching = false "
                         "(a local GPU hit needs the GPU prefix cache)",
                         "0 when prefix_caching = false, or prefix_caching = true")
    return out


def expand_tier_states(sc: CheckScenario, source: str, cpu: Mapping[tuple[int, int], str]
                       ) -> tuple[tuple[int, int, int, str], ...]:
    """``[[tiers]]`` as sorted ``(tier, group, chunk, state)`` (tier 0: the first
    entry), validated against the layout; ``cpu`` the expanded CPU states, for
    the capacity check: the CPU cache must hold its stated chunks plus every
    chunk a lookup may promote (no promotion evicts or fails in a check)."""
    out: list[tuple[int, int, int, str]] = []
    readable: set[tuple[int, int]] = set()
    for t, tier in enumerate(sc.tiers):
        for (g, j), st in _expand_table(sc, source, f"tiers.{t}.chunk_states", tier.chunk_states).items():
            out.append((t, g, j, st))
            if st == "present":
                readable.add((g, j))
    promotable = readable - set(cpu)
    cap = sc.cpu_capacity_chunks
    if cap is not None and len(cpu) + len(promotable) > cap:
        raise InputError(source, "cpu_capacity_chunks",
                         f"{len(cpu)} stated chunks and {len(promotable)} chunks only a tier holds exceed "
                         f"the capacity {cap} (a promotion needs a free CPU slot; a check does not evict)",
                         f"at least {len(cpu) + len(promotable)}, or no cpu_capacity_chunks")
    return tuple(sorted(out))


def _located(exc: ValidationError, source: str) -> InputError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        return InputError(source, loc, "unknown key", _allowed_keys(err["loc"]))
    if kind == "missing":
        return InputError(source, loc, "required key missing")
    ctx = err.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, ProblemError):
        return InputError(source, ".".join(p for p in (loc, inner.key) if p), inner.problem, inner.allowed)
    allowed = str(ctx["expected"]) if "expected" in ctx else err["msg"]
    return InputError(source, loc, f"{err.get('input')!r} is invalid", allowed)


def _allowed_keys(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = CheckScenario
    if loc and loc[0] == "groups":
        model = CheckGroup
    elif loc and loc[0] == "expect":
        model = Expectation
    elif loc and loc[0] == "tiers":
        model = CheckTier
    names = [f.alias or n for n, f in model.model_fields.items()]
    return ", ".join(names)


def parse_check(data: Any, source: str) -> CheckScenario:
    """Validate one scenario object; raise :class:`InputError` with its location."""
    return prepare_check(data, source)[0]


class KernelTable(NamedTuple):
    """What :func:`prepare_check` built for the decision kernel while validating
    a scenario: its layout and chunk table (see :func:`_scenario_table`)."""

    layout: DecisionLayout
    codes: list[list[Any]]
    loading: set[tuple[int, int]]


def prepare_check(data: Any, source: str) -> tuple[CheckScenario, KernelTable | None]:
    """:func:`parse_check`, also returning the kernel's table of the scenario
    (None where only the validating reader could read it), for
    :func:`evaluate`: a batch then reads each scenario's chunk states once.
    The table depends on no field that ``window_logic`` copies change."""
    if not isinstance(data, dict):
        raise InputError(source, "", "not a check scenario (a table/object)", 'schema = "check/1"')
    check_schema(data, source, "check/1")
    try:
        sc = CheckScenario.model_validate(data)
    except ValidationError as exc:
        inner = exc.errors()[0].get("ctx", {}).get("error")
        if isinstance(inner, LayoutError):
            raise InputError(source, inner.key, inner.problem, inner.allowed) from None
        raise _located(exc, source) from None
    if sc.gpu_computed_tokens and not sc.prefix_caching:
        expand_chunk_states(sc, source)   # raises the located error
    if sc.tiers:        # the tiers' chunk states and the CPU room for promotions (located errors);
        expand_tier_states(sc, source, expand_chunk_states(sc, source))
        return sc, None  # the kernel reads tiers from the validated case (scenario_outcomes)
    dl = _scenario_layout(sc)
    table = _scenario_table(sc, dl)
    if table is None:
        # a problem (raised, located, by the validating reader), or a form the
        # fast reader is not sure of (a group key such as "00"): valid then
        expand_chunk_states(sc, source)
        return sc, None
    return sc, KernelTable(dl, *table)


def json_dumps(obj: Any) -> str:
    """Compact JSON of check results (no spaces after separators): orjson, about 5x the
    standard library, with non-string keys written as strings as ``json.dumps`` does; what
    orjson cannot write (an integer beyond 64 bits, a subclass it does not know) goes to the
    standard library with the same separators."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(obj, separators=(",", ":"))


def load_check_file(path: Path, jsonl: bool = False) -> tuple[bool, list[Any]]:
    """Read a check file. Returns ``(is_batch, items)``; raises :class:`InputError`
    when the file is not a scenario or a list of them."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(source, "", f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InputError(source, "", f"cannot read: {exc}",
                         "a UTF-8 text file (TOML, JSON or JSON Lines)") from None
    if jsonl:
        items: list[Any] = []
        bad: list[tuple[int, str]] = []   # (line, problem) of each line that is not JSON
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                    continue
                except json.JSONDecodeError as exc:
                    bad.append((n, f"bad JSON: {exc.msg}"))
                except RecursionError:
                    bad.append((n, "bad JSON: nested too deeply"))
                items.append({"__error__": f"{source}:line {n}: {bad[-1][1]}"})
        if items and len(bad) == len(items):
            # not one line is JSON: the file is not JSON Lines at all (a TOML file, say), which
            # is bad input, not a batch whose every item failed
            raise InputError(source, f"line {bad[0][0]}", f"{bad[0][1]} (no line of the file is JSON)",
                             "JSON Lines: one check/1 scenario (a JSON object) per line")
        return True, items
    if path.suffix == ".toml":
        try:
            return False, [tomllib.loads(text)]
        except tomllib.TOMLDecodeError as exc:
            raise InputError(source, "", f"bad TOML: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(source, f"line {exc.lineno}", f"bad JSON: {exc.msg}",
                         "a check/1 scenario or a list of them (TOML or JSON)") from None
    except RecursionError:
        raise InputError(source, "", "bad JSON: nested too deeply",
                         "a check/1 scenario or a list of them (TOML or JSON)") from None
    if isinstance(data, list):
        return True, data
    if isinstance(data, dict):
        return False, [data]
    raise InputError(source, "", "not a scenario or a list of scenarios", "a JSON object or list")


@dataclass(frozen=True, slots=True)
class _CheckRequest:
    req_id: str
    block_hashes: list[int]
    num_tokens: int
    num_prompt_tokens: int


@dataclass(slots=True)
class CheckWorld:
    """The model objects of one check scenario under one logic, before the decision."""

    cpu: CpuChunkCache
    gpu: GpuKVCache
    sched: OffloadingScheduler
    req: _CheckRequest
    local_tokens: int
    local_blocks: tuple[list[Block], ...]
    #: per group, hashes per chunk (a key's chunk index from its hash)
    hashes_per_chunk: tuple[int, ...] = ()

    def decide(self) -> dict[str, Any]:
        """Lookup + allocation + load plan for the request; the outcome (JSON-ready;
        with secondary tiers, ``promotions`` too)."""
        out = self._decide()
        if isinstance(self.cpu, TieredCache):
            out["promotions"] = sorted([job.tier + 1, g, h // self.hashes_per_chunk[g] - 1]
                                       for job in self.cpu.take_jobs() if job.is_promotion
                                       for h, g in map(key_parts, job.keys))
        return out

    def _decide(self) -> dict[str, Any]:
        sched, req, local_tokens = self.sched, self.req, self.local_tokens
        sched.on_new_request(req)
        match = sched.get_num_new_matched_tokens(req, local_tokens)
        out: dict[str, Any] = {
            "external_tokens": match.tokens, "load_async": False, "load_keys": [],
            "group_sizes": [], "block_indices": [], "crash": None, "hazards": [],
        }
        ext = match.tokens
        if not ext:
            return out
        alloc = self.gpu.allocate_new(req.req_id, self.local_blocks, local_tokens, ext,
                                      local_tokens + ext)
        if alloc is None:  # pragma: no cover - the pool is sized never to run out
            raise RuntimeError("GPU pool exhausted in a check")
        try:
            plan = sched.update_state_after_alloc(req, alloc.blocks, ext, alloc.null_prefix)
        except ModelledCrashError as exc:
            out["crash"] = exc.crash.as_dict()
            if exc.attempt is not None:
                _fill_plan(out, exc.attempt)
            return out
        assert plan is not None
        out["load_async"] = True
        _fill_plan(out, plan)
        return out


def _fill_plan(out: dict[str, Any], plan: LoadPlan) -> None:
    out["load_keys"] = sorted([g, j] for g, j in plan.chunks)
    out["group_sizes"] = list(plan.group_sizes)
    out["block_indices"] = list(plan.block_indices)
    out["hazards"] = [{"kind": h.kind, "group": h.group, "chunk": h.chunk} for h in plan.hazards]


def build_world(case: CheckCase, logic: Logic) -> CheckWorld:
    """Build the CPU chunk states, the GPU prefix and the scheduler of a case."""
    layout = case.layout()
    states = {(g, j): st for g, j, st in case.states}
    capacity = case.cpu_capacity_chunks or max(100, len(states) + len(case.promotable()))
    cpu: CpuChunkCache
    scoped = profile(logic).request_scoped_recency
    if case.tiers:
        cpu = TieredCache(capacity, tiers=[TierSpec() for _ in range(case.tiers)], request_scoped=scoped)
    else:
        cpu = CpuChunkCache(capacity, request_scoped=scoped)
    sched = OffloadingScheduler(layout, cpu, profile(logic), prefix_caching=case.prefix_caching)
    hashes = list(range(1, case.num_tokens // case.tokens_per_hash + 1))

    def key(g: int, j: int) -> int:
        return offload_key(hashes[(j + 1) * layout.hashes_per_chunk[g] - 1], g)

    keys = {gj: key(*gj) for gj in states}
    ordered = sorted(states)
    stored = [keys[gj] for gj in ordered if states[gj] in ("present", "pending", "loading")]
    if stored and cpu.prepare_store(stored) is None:  # pragma: no cover - capacity validated
        raise RuntimeError("could not place the stated chunks")
    # the CPU tier's own completion: the stated tier contents are set below, not cascaded
    CpuChunkCache.complete_store(cpu, [keys[gj] for gj in ordered if states[gj] in ("present", "loading")])
    if isinstance(cpu, TieredCache):
        for t, tier in enumerate(cpu.tiers):
            mine = [(key(g, j), st) for i, g, j, st in case.tier_states if i == t]
            if mine and tier.prepare_store([k for k, _ in mine]) is None:  # pragma: no cover - unbounded
                raise RuntimeError("could not place a tier's stated chunks")
            tier.complete_store([k for k, st in mine if st == "present"])
            tier.take_events()
    loading = [keys[gj] for gj in ordered if states[gj] == "loading"]
    if loading:
        cpu.prepare_load(loading)
        if sched.being_loaded is not None:
            sched.being_loaded.update(loading)
    cpu.mark_uncertain([keys[gj] for gj in ordered if states[gj] == "retry"])
    cpu.take_events()

    num_blocks = 2 + 2 * sum(cdiv(case.num_tokens, g.tokens_per_block) for g in case.groups)
    gpu = GpuKVCache(layout, num_blocks, enable_caching=case.prefix_caching)
    local_tokens = case.gpu_computed_tokens
    if local_tokens:
        gpu.seed_prefix(hashes, local_tokens)
    local = gpu.hit_blocks(hashes, local_tokens)   # the case's local hit, as given
    req = _CheckRequest("check", hashes, case.num_tokens, case.num_tokens)
    return CheckWorld(cpu, gpu, sched, req, local_tokens, local, layout.hashes_per_chunk)


def run_check(case: CheckCase, logic: Logic) -> dict[str, Any]:
    """The outcome of one logic (JSON-ready), from the decision kernel.

    The outcome has ``external_tokens`` (None when deferred), ``load_async``,
    ``load_keys`` (sorted [group, chunk]), ``group_sizes``, ``block_indices``,
    ``crash`` (None or {kind, group, chunk, message}) and ``hazards``.
    """
    return case_outcomes(case, (logic,))[logic]


def case_outcomes(case: CheckCase, logics: Sequence[Logic] = ("old", "new")) -> dict[str, dict[str, Any]]:
    """The outcome of each logic (:func:`run_check`'s), decided once per case."""
    dl = decision_layout(case.groups, case.tokens_per_hash, case.blocks_per_chunk)
    return decide(dl, case.states, case.num_tokens, case.gpu_computed_tokens, case.prefix_caching, logics,
                  case.tier_map())


def reference_check(case: CheckCase, logic: Logic) -> dict[str, Any]:
    """:func:`run_check` through the real model objects (:func:`build_world`):
    the reference the decision kernel is tested against."""
    return build_world(case, logic).decide()


def compare(expect: Expectation, outcome: dict[str, Any]) -> list[str]:
    """Differences between an expectation and an outcome, as readable lines."""
    diffs: list[str] = []

    def differ(key: str, want: object, got: object) -> None:
        if want != got:
            diffs.append(f"{key}: expected {json.dumps(want)}, got {json.dumps(got)}")

    if expect.deferred is not None:
        differ("deferred", expect.deferred, outcome["external_tokens"] is None)
    if expect.external_tokens is not None:
        differ("external_tokens", expect.external_tokens, outcome["external_tokens"])
    if expect.load_async is not None:
        differ("load_async", expect.load_async, outcome["load_async"])
    if expect.load_keys is not None:
        differ("load_keys", sorted([g, j] for g, j in expect.load_keys), outcome["load_keys"])
    if expect.group_sizes is not None:
        differ("group_sizes", expect.group_sizes, outcome["group_sizes"])
    if expect.block_indices is not None:
        differ("block_indices", expect.block_indices, outcome["block_indices"])
    if expect.crash is not None:
        crash = outcome["crash"]
        differ("crash", expect.crash, "none" if crash is None else crash["kind"])
    if expect.hazards is not None:
        differ("hazards", sorted(expect.hazards), sorted(h["kind"] for h in outcome["hazards"]))
    if expect.promotions is not None:
        differ("promotions", sorted(expect.promotions), outcome.get("promotions", []))
    return diffs


def evaluate(sc: CheckScenario, source: str, table: KernelTable | None = None
             ) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """Run every logic the scenario asks for; return outcomes and mismatches.

    With ``window_logic = "both"`` an expectation of another logic (e.g.
    ``[expect.latest]``) is checked too; its outcome is not returned."""
    outcomes = scenario_outcomes(sc, source, table)
    mismatches: dict[str, list[str]] = {}
    if sc.expect:
        extra: tuple[Logic, ...] = ()
        if sc.window_logic == "both":
            extra = tuple(lg for lg in sc.expect if lg not in outcomes)
        for logic in (*sc.logics(), *extra):
            exp = sc.expect.get(logic)
            if exp is not None:
                out = outcomes[logic] if logic in outcomes else \
                    scenario_outcomes(sc.model_copy(update={"window_logic": logic}), source, table)[logic]
                diffs = compare(exp, out)
                if diffs:
                    mismatches[logic] = diffs
    return outcomes, mismatches


def scenario_outcomes(sc: CheckScenario, source: str, table: KernelTable | None = None
                      ) -> dict[str, dict[str, Any]]:
    """The outcome of every logic the scenario asks for (:func:`run_check`'s
    on ``sc.case(source)``), without building the :class:`CheckCase`: the
    chunk-state ranges are written straight into the kernel's table (or
    ``table``, which :func:`prepare_check` built for ``sc``). A scenario whose
    states or local hit do not pass that way goes through
    :meth:`CheckScenario.case` (which validates them: :class:`InputError`)."""
    n = sc.num_tokens
    if sc.tiers:        # the validating way, with the tiers' contents
        case = sc.case(source)
        dl = _scenario_layout(sc)
        return decide(dl, case.states, n, sc.gpu_computed_tokens, sc.prefix_caching, sc.logics(),
                      case.tier_map())
    if table is None:
        dl = _scenario_layout(sc)
        t = _scenario_table(sc, dl)
        if t is None:
            states = sc.case(source).states
            return decide(dl, states, n, sc.gpu_computed_tokens, sc.prefix_caching, sc.logics())
        table = KernelTable(dl, *t)
    return decide_codes(table.layout, table.codes, table.loading, n, sc.gpu_computed_tokens,
                        sc.prefix_caching, sc.logics())


_LAYOUTS: dict[tuple[Any, ...], DecisionLayout] = {}
_RANGES: dict[str, tuple[int, int]] = {}  #: parsed chunk_states keys: "118..121" -> (118, 122)
_GROUP_KEYS = {str(g): g for g in range(64)}  #: chunk_states group keys read without int()


def _scenario_layout(sc: CheckScenario) -> DecisionLayout:
    """The kernel's layout of a scenario, cached by the groups' field values
    (no :class:`~sim.model.layout.GroupSpec` built on a hit)."""
    try:
        key: tuple[Any, ...] | None = (sc.tokens_per_hash, sc.blocks_per_chunk,
                                       *[tuple(g.__dict__.values()) for g in sc.groups])
        dl = _LAYOUTS.get(key)  # type: ignore[arg-type]
    except TypeError:  # pragma: no cover - an unhashable field
        key = dl = None
    if dl is None:
        dl = decision_layout([g.spec() for g in sc.groups], sc.tokens_per_hash, sc.blocks_per_chunk)
        if key is not None:
            if len(_LAYOUTS) >= 4096:
                _LAYOUTS.clear()
            _LAYOUTS[key] = dl
    return dl


def _scenario_table(sc: CheckScenario, dl: DecisionLayout
                    ) -> tuple[list[list[Any]], set[tuple[int, int]]] | None:
    """The kernel's chunk table of ``chunk_states`` (as :func:`expand_chunk_states`
    reads it), or None where that function would object (an unknown group, a
    bad or out-of-range chunk range, overlapping ranges, more chunks than the
    CPU capacity, a bad local hit) or where this reader is not sure (a group
    key other than "0".."63"): the caller then goes the validating way."""
    n = sc.num_tokens
    local = sc.gpu_computed_tokens
    if local >= n:
        return None
    for bs in dl.bs:
        if local % bs:
            return None
    codes = [[MISSING] * (n // t) for t in dl.tpc]
    loading: set[tuple[int, int]] = set()
    stated = 0
    ng = dl.ng
    for gkey, table in sc.chunk_states.items():
        g = _GROUP_KEYS.get(gkey, ng)
        if g >= ng:
            return None
        cg = codes[g]
        for ckey, state in table.items():
            ab = _RANGES.get(ckey)
            if ab is None:
                rng = _parse_chunk_range(ckey)
                if rng is None:
                    return None
                if len(_RANGES) >= 4096:
                    _RANGES.clear()
                ab = _RANGES[ckey] = (rng.start, rng.stop)
            a, b = ab
            if b > len(cg):
                return None
            if b - a == 1:
                if cg[a] is not MISSING:
                    return None  # overlapping ranges
                cg[a] = state_code[state]
            else:
                if cg[a:b].count(MISSING) != b - a:
                    return None
                cg[a:b] = [state_code[state]] * (b - a)
            stated += b - a
            if state == "loading":
                loading.update((g, j) for j in range(a, b))
    cap = sc.cpu_capacity_chunks
    if cap is not None and stated > cap:
        return None
    return codes, loading


def summarize(outcome: dict[str, Any]) -> str:
    """One short human line for an outcome."""
    ext = outcome["external_tokens"]
    head = "deferred" if ext is None else f"{ext} tokens"
    promotions = outcome.get("promotions")
    if promotions:
        tiers = sorted({t for t, _, _ in promotions})
        head += (f" (promotes {len(promotions)} {'chunk' if len(promotions) == 1 else 'chunks'} from tier "
                 + ", ".join(str(t) for t in tiers) + ")")
    if outcome["crash"]:
        c = outcome["crash"]
        return f"{head}, CRASH {c['kind']} (group {c['group']}, chunk {c['chunk']})"
    parts = [head]
    if outcome["load_async"]:
        parts.append(f"load {len(outcome['load_keys'])} chunks, sizes {outcome['group_sizes']}")
    if outcome["hazards"]:
        parts.append("hazards: " + ", ".join(f"{h['kind']} g{h['group']}c{h['chunk']}"
                                             for h in outcome["hazards"]))
    return ", ".join(parts)


def iter_check_files(root: Path) -> Iterable[Path]:
    """Every check file under ``root`` (sorted)."""
    return sorted(p for p in root.rglob("*.toml") if p.is_file())


# -- writing check/1 files ------------------------------------------------------------------


def toml_value(v: Any) -> str:
    """An inline TOML value (the subset check/1 files use)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {v!r}")


def case_toml(case: CheckCase, *, name: str, window_logic: str, expect: Mapping[str, Mapping[str, Any]],
              head: Sequence[str] = (), notes: Sequence[str] = ()) -> str:
    """A check/1 file: ``head`` comment lines, the schema line, ``notes`` comment
    lines, the case's keys (defaults left out), its chunk states and the
    ``[expect.<logic>]`` tables. The one writer of check/1 text (the fuzzer's
    library entries and the reproducers of a run)."""
    lines = [f"# {h}" for h in head]
    lines.append('schema = "check/1"')
    lines += [f"# {n}" for n in notes]
    lines += [f"name = {toml_value(name)}",
              f"window_logic = {toml_value(window_logic)}",
              f"blocks_per_chunk = {case.blocks_per_chunk}",
              f"tokens_per_hash = {case.tokens_per_hash}",
              f"num_tokens = {case.num_tokens}"]
    if case.gpu_computed_tokens:
        lines.append(f"gpu_computed_tokens = {case.gpu_computed_tokens}")
    if not case.prefix_caching:
        lines.append("prefix_caching = false")
    if case.cpu_capacity_chunks is not None:
        lines.append(f"cpu_capacity_chunks = {case.cpu_capacity_chunks}")
    lines.append("groups = [")
    lines += [f"  {toml_value(g.to_dict())}," for g in case.groups]
    lines.append("]")
    for g, table in case.state_ranges().items():
        lines += ["", f"[chunk_states.{g}]"]
        lines += [f'"{rng}" = "{st}"' for rng, st in table.items()]
    for t in range(case.tiers):
        lines += ["", "[[tiers]]"]
        for g, table in case.tier_ranges(t).items():
            lines += [f"[tiers.chunk_states.{g}]"]
            lines += [f'"{rng}" = "{st}"' for rng, st in table.items()]
    for logic, exp in expect.items():
        lines += ["", f"[expect.{logic}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in exp.items()]
    return "\n".join(lines) + "\n"


def write_reproducers(folder: Path, snapshots: Sequence[ReproducerSnapshot]) -> dict[str, Any]:
    """Write each modelled crash or hazard of a run as a check/1 file.

    The expectations are what the model gives for the case in isolation
    (:func:`run_check` under OLD and NEW, and LATEST for a LATEST run);
    ``reproduced`` says whether the run's own logic gives the outcome the run
    recorded. (A hazard seen with assertions stripped is a crash in a check,
    which keeps assertions.)

    Returns:
        ``files`` (names written, in order), ``reproduced`` (how many) and ``count``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    written, reproduced = [], 0
    for n, snap in enumerate(snapshots):
        case = CheckCase.from_snapshot(snap)
        expect: dict[str, dict[str, Any]] = {}
        logics: tuple[Logic, ...] = ("old", "new", "latest") if snap.logic == "latest" else ("old", "new")
        for logic in logics:
            out = run_check(case, logic)
            e: dict[str, Any] = {"crash": out["crash"]["kind"] if out["crash"] else "none",
                                 "hazards": sorted({h["kind"] for h in out["hazards"]})}
            if out["external_tokens"] is None:
                e["deferred"] = True
            else:
                e["external_tokens"] = out["external_tokens"]
            expect[logic] = e
        mine = expect[snap.logic]
        ok = (mine["crash"] == snap.detail) if snap.kind == "crash" else (snap.detail in mine["hazards"])
        reproduced += ok
        name = f"{n:03d}-{snap.req_id}-{snap.detail}.toml"
        head = (f"reproducer: {snap.kind} {snap.detail} of request {snap.req_id} at "
                f"t = {snap.t_s:.6f} s ({snap.logic.upper()} logic) in this run",
                f"the states of the request's chunks it met, as a check/1 case: kvsim check {name}",
                f"reproduced in isolation: {'yes' if ok else 'no'}")
        text = case_toml(case, name=f"{snap.req_id}-{snap.detail}", window_logic="both", expect=expect,
                         head=head)
        parse_check(tomllib.loads(text), name)   # the file is a valid check/1 case
        (folder / name).write_text(text)
        written.append(name)
    return {"files": written, "reproduced": reproduced, "count": len(snapshots)}
