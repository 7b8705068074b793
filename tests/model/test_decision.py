"""The decision kernel (:mod:`sim.model.decision`) against the reference path.

``sim.io.check.run_check``, ``evaluate`` (``kvsim check``, ``--json``,
``regress``) and the fuzzer decide with the kernel; the reference builds the
real CPU chunk cache, per-block GPU cache and scheduler per case
(``reference_check``). Both must give equal outcome dicts under both logics:
on the fuzzer's random scenarios (every group kind, EAGLE,
``extra_retained_tokens``, local hits, prefix caching off, every chunk
state), on the property tests' scenarios and on every case of the crash
library.
"""

from __future__ import annotations

import dataclasses
import random
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.io.check import (
    CheckCase,
    CheckScenario,
    case_outcomes,
    case_toml,
    evaluate,
    expand_chunk_states,
    load_check_file,
    parse_check,
    prepare_check,
    reference_check,
    run_check,
    scenario_outcomes,
)
from sim.model.decision import decision_layout
from sim.model.layout import GroupKind, GroupSpec
from sim.tools.fuzz import generate, scenario_at
from tests.cases import build_case

ROOT = Path(__file__).resolve().parents[2]
CRASH = ROOT / "scenarios" / "crash"
BOTH = ("old", "new")
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def reference(case: CheckCase) -> dict[str, dict[str, Any]]:
    return {logic: reference_check(case, logic) for logic in BOTH}


def assert_same(case: CheckCase) -> None:
    want = reference(case)
    assert case_outcomes(case) == want, case
    # through the validated scenario: the kernel fed straight from chunk_states
    sc = case.to_scenario()
    assert scenario_outcomes(sc, "<case>") == want, case


@SETTINGS
@given(st.integers(0, 2**20), st.integers(0, 2**30))
def test_kernel_equals_the_reference_on_the_fuzzers_stream(seed: int, index: int) -> None:
    assert_same(scenario_at(seed, index))


@SETTINGS
@given(st.randoms(use_true_random=False))
def test_kernel_equals_the_reference_on_fresh_layouts(rng: random.Random) -> None:
    assert_same(generate(rng))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_kernel_equals_the_reference_on_the_property_tests_cases(seed: int) -> None:
    assert_same(build_case(seed).scenario.case())


def test_a_fixed_stream_covers_every_outcome_class() -> None:
    """Non-vacuity: the differential tests meet crashes of every kind,
    deferrals, hazards, zeros and loads (and compare them all)."""
    seen: set[str] = set()
    for i in range(1500):
        case = scenario_at(5, i)
        outs = case_outcomes(case)
        if i % 5 == 0:
            assert outs == reference(case), i
        for o in outs.values():
            if o["crash"] is not None:
                seen.add(o["crash"]["kind"])
            elif o["external_tokens"] is None:
                seen.add("defer")
            elif o["external_tokens"] == 0:
                seen.add("zero")
            else:
                seen.add("load")
            seen.update(h["kind"] for h in o["hazards"])
    assert seen >= {"missing_chunk", "chunk_not_ready", "assertion", "defer", "zero", "load", "double_load"}


LIBRARY = sorted(CRASH.rglob("*.toml"))


@pytest.mark.parametrize("path", LIBRARY, ids=[str(p.relative_to(CRASH)) for p in LIBRARY])
def test_kernel_equals_the_reference_on_the_crash_library(path: Path) -> None:
    _, items = load_check_file(path)
    sc = parse_check(items[0], str(path))
    case = sc.case(str(path))
    want = reference(case)
    assert case_outcomes(case) == want
    both = sc.model_copy(update={"window_logic": "both"})
    assert scenario_outcomes(both, str(path)) == want
    outcomes, mismatches = evaluate(sc, str(path))
    assert outcomes == {logic: want[logic] for logic in sc.logics()}
    assert not mismatches
    for logic in BOTH:
        assert run_check(case, logic) == want[logic]


def test_the_library_is_there() -> None:
    assert len(LIBRARY) >= 30


S6: dict[str, Any] = {
    "schema": "check/1", "blocks_per_chunk": 4, "tokens_per_hash": 8, "num_tokens": 4353,
    "groups": [{"kind": "full", "tokens_per_block": 256},
               {"kind": "sliding_window", "tokens_per_block": 64, "window": 128},
               {"kind": "sliding_window", "tokens_per_block": 8, "window": 128}],
    "chunk_states": {"0": {"0..3": "present"}, "1": {"14..15": "present"},
                     "2": {"118..121": "present"}},
}


def test_ranges_of_every_state_straight_into_the_table() -> None:
    data = {**S6, "chunk_states": {"0": {"0..3": "present"},
                                   "1": {"10..11": "loading", "14": "present", "12..13": "pending"},
                                   "2": {"110..115": "retry", "116..118": "present", "119": "loading",
                                         "120..121": "present"}}}
    sc = parse_check(data, "ranges")
    case = sc.case("ranges")
    want = reference(case)
    assert scenario_outcomes(sc, "ranges") == want == case_outcomes(case)
    no_pc = parse_check({**data, "prefix_caching": False}, "no-pc")
    assert scenario_outcomes(no_pc, "no-pc") == reference(no_pc.case("no-pc"))


@pytest.mark.parametrize(("change", "where"), [
    ({"chunk_states": {"1": {"14..99": "present"}}}, r"chunk_states\.1\.14\.\.99"),
    ({"chunk_states": {"7": {"1": "present"}}}, r"chunk_states\.7"),
    ({"chunk_states": {"x": {"1": "present"}}}, r"chunk_states\.x"),
    ({"chunk_states": {"1": {"3..1": "present"}}}, r"chunk_states\.1\.3\.\.1"),
    ({"chunk_states": {"1": {"1..4": "present", "4": "pending"}}}, r"chunk_states\.1"),
    ({"cpu_capacity_chunks": 2}, "cpu_capacity_chunks"),
    ({"gpu_computed_tokens": 100}, "gpu_computed_tokens"),
    ({"gpu_computed_tokens": 4353}, "gpu_computed_tokens"),
])
def test_unvalidated_chunk_states_raise_the_located_error(change: dict[str, Any], where: str) -> None:
    """A scenario built without parse_check: evaluate still refuses what
    parse_check refuses, with its error."""
    bad = CheckScenario.model_validate({**S6, **change})
    with pytest.raises(InputError, match=where) as got:
        evaluate(bad, "bad")
    with pytest.raises(InputError) as want:
        parse_check({**S6, **change}, "bad")
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize(("change", "where"), [
    ({"chunk_states": {"1": {"14..99": "present"}}}, r"chunk_states\.1\.14\.\.99"),
    ({"chunk_states": {"7": {"1": "present"}}}, r"chunk_states\.7"),
    ({"chunk_states": {"1": {"1..4": "present", "4": "pending"}}}, r"chunk_states\.1"),
    ({"cpu_capacity_chunks": 2}, "cpu_capacity_chunks"),
    ({"gpu_computed_tokens": 64, "prefix_caching": False}, "gpu_computed_tokens"),
    ({"gpu_computed_tokens": 4353}, "gpu_computed_tokens"),
])
def test_prepare_check_refuses_with_the_validating_readers_error(change: dict[str, Any], where: str) -> None:
    """prepare_check reads chunk_states with the kernel's fast reader; what it
    refuses, and the words, are the validating reader's (expand_chunk_states)."""
    unchecked = CheckScenario.model_validate({**S6, **change})
    with pytest.raises(InputError, match=where) as want:
        expand_chunk_states(unchecked, "bad")
    with pytest.raises(InputError) as got:
        prepare_check({**S6, **change}, "bad")
    assert str(got.value) == str(want.value)


@SETTINGS
@given(st.integers(0, 2**20), st.integers(0, 2**30))
def test_the_prepared_table_is_the_validating_readers(seed: int, i: int) -> None:
    """The table prepare_check builds while validating gives the outcomes of the
    validated case (every logic, and an expectation of another logic)."""
    data = scenario_at(seed, i).check_data(("old", "new"))
    data["expect"] = {"latest": {"crash": "none"}}
    sc, table = prepare_check(data, "p")
    assert table is not None
    assert sorted((g, j) for g, j, _ in sc.case("p").states) == sorted(expand_chunk_states(sc, "p"))
    assert evaluate(sc, "p", table) == evaluate(sc, "p")
    for logic in ("old", "new", "latest"):
        one = sc.model_copy(update={"window_logic": logic})
        assert scenario_outcomes(one, "p", table) == scenario_outcomes(one, "p")
    # a form only the validating reader reads ("00" names group 0): no table, same outcomes
    if data["chunk_states"].get("0"):
        data["chunk_states"] = {"00" if k == "0" else k: v for k, v in data["chunk_states"].items()}
        sc2, table2 = prepare_check(data, "p")
        assert table2 is None
        assert evaluate(sc2, "p") == evaluate(sc, "p", table)


def test_layouts_are_cached() -> None:
    case = scenario_at(1, 0)
    a = decision_layout(case.groups, case.tokens_per_hash, case.blocks_per_chunk)
    b = decision_layout(list(case.groups), case.tokens_per_hash, case.blocks_per_chunk)
    assert a is b
    assert a.layout == case.layout()


def test_a_local_hit_without_prefix_caching_is_refused() -> None:
    """check/1 lets it through; the reference raises too (no local hit is found)."""
    case = CheckCase((GroupSpec(GroupKind.FULL, 16),), 4, 1, 64, 16, False, ((0, 0, "present"),))
    with pytest.raises(ValueError, match="prefix caching"):
        case_outcomes(case)
    with pytest.raises(RuntimeError):
        reference_check(case, "old")


# -- secondary tiers: a lookup that misses the CPU cache and hits a tier promotes and defers --


def with_tiers(case: CheckCase, rng: random.Random) -> CheckCase:
    """``case`` with one or two secondary tiers holding random chunks (present or
    with their write in flight), some of the CPU's present chunks moved out of
    the CPU (so that a lookup may promote them), and the CPU sized by default."""
    n = case.num_tokens
    tiers = rng.choice([1, 1, 2])
    share = rng.choice([0.2, 0.5, 0.9])
    held = [(t, g, j, "present" if rng.random() < 0.85 else "pending")
            for t in range(tiers) for g in range(len(case.groups))
            for j in range(n // case.tpc(g)) if rng.random() < share]
    states = tuple(s for s in case.states if not (s[2] == "present" and rng.random() < 0.4))
    return dataclasses.replace(case, states=states, tiers=tiers, tier_states=tuple(sorted(held)),
                               cpu_capacity_chunks=None)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**20), st.integers(0, 2**30))
def test_kernel_equals_the_reference_with_tiers(seed: int, index: int) -> None:
    """The kernel's promotions (a table whose lookups promote) against the real
    TieredCache behind the real scheduler: the same outcomes and the same
    promotions, under both logics, also through the validated scenario."""
    case = with_tiers(scenario_at(seed, index), random.Random(index))
    assert case.valid()
    assert_same(case)
    assert case.to_scenario().case() == case          # check_data round-trips the tiers


def test_tiers_non_vacuity() -> None:
    """The tiered stream meets promotions that defer, promotions whose deferral
    a later shrink of the hit dropped, loads, and crashes (a crash on a chunk
    only a tier holds, OLD's never-looked-up chunk: the tiered example file)."""
    seen: set[str] = set()
    for i in range(900):       # crashes are rare here: most tier-held chunks defer the lookup
        case = with_tiers(scenario_at(11, i), random.Random(i))
        outs = case_outcomes(case)
        if i % 4 == 0:
            assert outs == reference(case), i
        for o in outs.values():
            if o["promotions"]:
                seen.add("promote_defer" if o["external_tokens"] is None else "promote_then_answer")
            elif o["load_async"]:
                seen.add("load")
            if o["crash"] is not None:
                seen.add("crash")
    assert seen >= {"promote_defer", "promote_then_answer", "load", "crash"}, seen


def test_a_chunk_only_a_tier_holds_is_promoted_and_the_request_defers() -> None:
    full = (GroupSpec(GroupKind.FULL, 16),)
    # 4 chunks of 16 tokens: 0, 1 in CPU memory, 2 only on the tier, 3 nowhere
    case = CheckCase(full, 16, 1, 70, states=((0, 0, "present"), (0, 1, "present")), tiers=1,
                     tier_states=((0, 0, 2, "present"), (0, 0, 3, "pending")))
    want = {"external_tokens": None, "load_async": False, "load_keys": [], "group_sizes": [],
            "block_indices": [], "crash": None, "hazards": [], "promotions": [[1, 0, 2]]}
    assert case_outcomes(case) == reference(case) == {"old": want, "new": want}
    # the same chunk in CPU memory: a plain hit of 3 chunks, no promotion
    cpu = dataclasses.replace(case, states=((0, 0, "present"), (0, 1, "present"), (0, 2, "present")))
    plain = case_outcomes(cpu)["new"]
    assert plain["external_tokens"] == 48 and plain["promotions"] == []
    # a second tier behind the first: the first that holds a chunk promotes it
    two = dataclasses.replace(case, tiers=2, tier_states=((0, 0, 2, "pending"), (1, 0, 2, "present")))
    assert case_outcomes(two)["old"]["promotions"] == [[2, 0, 2]] == reference(two)["old"]["promotions"]
    # without tiers the outcome has no promotions key at all (kvsim check output unchanged)
    assert "promotions" not in case_outcomes(dataclasses.replace(case, tiers=0, tier_states=()))["old"]


TIERED = ROOT / "scenarios" / "check" / "tiers-s6-left-chunk-on-nvme.toml"


def test_the_tiered_example_holds_its_hand_worked_expectations() -> None:
    _, items = load_check_file(TIERED)
    sc = parse_check(items[0], str(TIERED))
    case = sc.case(str(TIERED))
    assert case.tiers == 1 and case.tier_states == ((0, 1, 14, "present"),)
    outcomes, mismatches = evaluate(sc, str(TIERED))
    assert not mismatches and outcomes == reference(case)
    assert outcomes["new"]["promotions"] == [[1, 1, 14]]
    assert outcomes["old"]["crash"]["kind"] == "missing_chunk"
    text = case_toml(case, name="x", window_logic="both", expect={})
    assert parse_check(tomllib.loads(text), "x").case("x") == case      # the writer states the tiers


@pytest.mark.parametrize(("tiers", "where"), [
    ([{"chunk_states": {"1": {"14": "loading"}}}], r"tiers\.0\.chunk_states\.1\.14: 'loading' is invalid"),
    ([{"chunk_states": {"5": {"14": "present"}}}], r"tiers\.0\.chunk_states\.5: unknown group"),
    ([{"chunk_states": {"1": {"14..99": "present"}}}], r"tiers\.0\.chunk_states\.1\.14\.\.99: chunk 99"),
    ([{}, {"chunk_states": {"1": {"1..4": "present", "4": "pending"}}}],
     r"tiers\.1\.chunk_states\.1: ranges"),
    ([{"colour": 1}], r"tiers\.0\.colour: unknown key; allowed: chunk_states"),
    ([{"chunk_states": {"1": {"0..13": "present"}}}], r"cpu_capacity_chunks: 9 stated chunks and 14 chunks"),
])
def test_bad_tier_contents_are_one_located_line(tiers: list[dict[str, Any]], where: str) -> None:
    data = {**S6, "chunk_states": {"0": {"0..3": "present"}, "1": {"15": "present"},
                                   "2": {"118..121": "present"}},
            "cpu_capacity_chunks": 20, "tiers": tiers}
    with pytest.raises(InputError, match=where) as info:
        parse_check(data, "bad")
    assert "\n" not in str(info.value)
