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

import random
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
