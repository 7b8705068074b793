"""The comparisons kvsim fidelity and the differential mode make, without vLLM: two runs of
kvsim's own model.

(The runs against real vLLM are in tests/tools/test_vllm_mode.py.)
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from sim.engine.loop import SimulationResult, simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.io.check import CheckCase, parse_check, run_check
from sim.io.scenario import load_run
from sim.tools.differential import (
    DifferentialReport,
    StepDecisions,
    StepDivergence,
    WatchingRecorder,
    compare_steps,
    describe,
    lookup_reproducer,
    simulate_differential,
    write_lookup_case,
)
from sim.tools.fidelity import REQUEST_FIELDS, FidelityReport, _compare, _rows, format_report
from tests.helpers import QUIET_FULL_ATTENTION

SCENARIO = QUIET_FULL_ATTENTION


def _run(tmp: Path, *sets: str) -> MemorySink:
    path = tmp / "f.toml"
    path.write_text(SCENARIO)
    spec = load_run(path, [("test", s) for s in sets])
    sink = MemorySink()
    simulate(spec.engine_config(), spec.requests(), Recorder(sink))
    return sink


def _report(a: MemorySink, b: MemorySink) -> FidelityReport:
    rep = FidelityReport("f.toml", "x", "new", 0, status={"kvsim": "ok", "vllm": "ok"})
    _compare(a, b, rep)
    return rep


def test_the_same_run_twice_has_no_divergence(tmp_path: Path) -> None:
    a, b = _run(tmp_path), _run(tmp_path)
    rep = _report(a, b)
    transfers = len(_rows(a, "transfers"))
    assert rep.requests == 18 and transfers > 0
    assert rep.decisions == rep.requests * len(REQUEST_FIELDS) + transfers + 1
    assert rep.divergences == [] and rep.first is None and rep.known == {}
    assert format_report(rep).splitlines()[1].startswith(f"0 divergences in {rep.decisions} decisions")


def test_a_smaller_cpu_cache_diverges_first_where_a_hit_is_lost(tmp_path: Path) -> None:
    """A CPU cache of 40 chunks loses hits the 3,000-chunk one has: the report names the
    earliest request that differs, with both values, and counts every field that differs."""
    a, b = _run(tmp_path), _run(tmp_path, "cpu_cache.chunks=40")
    rep = _report(a, b)
    assert rep.divergences
    first = rep.first
    assert first is not None
    assert first.t_s == min(d.t_s for d in rep.divergences)
    hits = {r["req_id"]: r["cpu_hit_tokens"] for r in _rows(a, "requests")}
    small = {r["req_id"]: r["cpu_hit_tokens"] for r in _rows(b, "requests")}
    lost = [rid for rid in hits if hits[rid] != small[rid]]
    assert lost and any(d.what == "cpu_hit_tokens" and d.req_id in lost for d in rep.divergences)
    text = format_report(rep)
    assert "first: t=" in text and "by field: " in text and "cpu_hit_tokens" in text


def test_a_request_rejected_on_one_side_is_a_known_divergence(tmp_path: Path) -> None:
    a = _run(tmp_path)
    b = _run(tmp_path)
    req = b.tables["requests"]
    i = req["req_id"].index(sorted(req["req_id"])[0])
    req["status"][i] = "rejected"
    rep = _report(a, b)
    assert rep.known == {"too_long": 1} and rep.divergences == []


# -- the differential mode's lockstep, with a second run of kvsim's model standing in for vLLM --


def _lockstep(tmp: Path, *other_sets: str,
              folder: Path | None = None) -> tuple[SimulationResult, DifferentialReport]:
    path = tmp / "d.toml"
    path.write_text(SCENARIO)
    spec = load_run(path, [])
    other = load_run(path, [("test", s) for s in other_sets]).engine_config()
    return simulate_differential(spec.engine_config(), spec.requests, WatchingRecorder(MemorySink()),
                                 folder=folder, stand_in=other)


def test_lockstep_of_the_same_run_has_no_divergence(tmp_path: Path) -> None:
    result, rep = _lockstep(tmp_path, folder=tmp_path)
    assert result.status == "ok" and rep.status == {"kvsim": "ok", "vllm": "ok"}
    assert rep.divergence is None and rep.steps > 100 and rep.decisions > 2 * rep.steps
    assert describe(rep.to_dict())[0].endswith(f"0 divergences in {rep.decisions} decisions ({rep.steps} "
                                               "steps; known, from listed simplifications: none)")
    assert not (tmp_path / "divergence.json").exists()


def test_lockstep_stops_at_the_first_divergence(tmp_path: Path) -> None:
    """A 40-chunk CPU cache on the other side: the first store it cannot take whole is the
    divergence (fewer keys stored); both runs stop there (status diverged) and
    divergence.json says why no check/1 case is written."""
    result, rep = _lockstep(tmp_path, "cpu_cache.chunks=40", folder=tmp_path)
    d = rep.divergence
    assert d is not None and result.status == "diverged" and rep.status["vllm"] == "diverged"
    assert d.what == "store_keys" and set(d.vllm or ()) < set(d.kvsim) and d.req_id
    assert d.step == rep.steps - 1
    saved = json.loads((tmp_path / "divergence.json").read_text())
    assert saved["divergences"] == 1 and saved["first"]["what"] == "store_keys"
    assert saved["reproducer"].startswith("none: check/1 states one request's lookup")
    text = describe(saved)
    assert ": 1 divergence in " in text[0] and "first divergence: step" in text[1]


def _step(t: float = 1.0, **reqs: dict[str, Any]) -> StepDecisions:
    return StepDecisions(t, dict(reqs))


def test_compare_steps_field_by_field() -> None:
    """The fields are compared in order; the first that differs is the divergence; a
    request vLLM rejected on arrival is known (too_long), not a divergence."""
    rep = DifferentialReport("x", "new")
    same = {"lookup": (0, 32, True), "load_keys": ((5, 0), (6, 0))}
    assert compare_steps(_step(r1=same), _step(r1=dict(same)), rep) is None
    assert rep.decisions == 1 + 2
    d = compare_steps(_step(r1={"lookup": (0, 32, True), "scheduled": 8}),
                      _step(r1={"lookup": (0, 16, True), "scheduled": 9}), rep)
    assert d is not None and (d.req_id, d.what) == ("r1", "lookup")
    assert (d.kvsim, d.vllm) == ((0, 32, True), (0, 16, True))
    assert d.single
    d = compare_steps(_step(r1={"lookup": (16, 0, False)}), _step(r1={"lookup": (0, 16, False)}), rep)
    assert d is not None and not d.single   # a different local hit: the pool's state, not one lookup
    d = compare_steps(_step(1.0), _step(1.5, r1={"scheduled": 1}), rep)
    assert d is not None and d.what == "step start"
    rep = DifferentialReport("x", "new")
    assert compare_steps(_step(r9={"lookup": (0, 0, False)}), _step(), rep, {"r9"}) is None
    assert rep.known == {"too_long": 1}
    crash = StepDecisions(1.0, {"r1": {"scheduled": 4}}, crashes=(("r1", "missing_chunk"),))
    assert compare_steps(crash, StepDecisions(1.0, {}, crashes=(("r1", "missing_chunk"),)), rep) is None
    d = compare_steps(crash, _step(r1={"scheduled": 4}), rep)
    assert d is not None and d.what == "crashes"
    # vLLM stops at the first crash of a step: kvsim's later crashes in it are not compared,
    # but a different first one, or one vLLM makes alone, is a divergence
    two = StepDecisions(1.0, {}, crashes=(("r1", "missing_chunk"), ("r2", "missing_chunk")))
    assert compare_steps(two, StepDecisions(1.0, {}, crashes=(("r1", "missing_chunk"),)), rep) is None
    d = compare_steps(two, StepDecisions(1.0, {}, crashes=(("r2", "missing_chunk"),)), rep)
    assert d is not None and d.what == "crashes"
    d = compare_steps(_step(), StepDecisions(1.0, {}, crashes=(("r1", "missing_chunk"),)), rep)
    assert d is not None and d.what == "crashes"


def test_a_diverging_lookup_gets_a_check_case_with_vllms_answer(tmp_path: Path) -> None:
    """The reproducer of a lookup divergence: kvsim's model is run again up to that lookup,
    and what it met is a check/1 case expecting the other side's answer; kvsim's model
    gives its own answer on the case, so the case fails until the model agrees."""
    path = tmp_path / "d.toml"
    path.write_text(SCENARIO)
    spec = load_run(path, [])
    a = _run(tmp_path)
    rows = [r for r in _rows(a, "requests") if r["cpu_hit_tokens"] > 0 and r["preemptions"] == 0]
    r = rows[0]
    ext = r["cpu_hit_tokens"]
    div = StepDivergence(3, r["scheduled_s"], r["req_id"], "lookup", (r["gpu_hit_tokens"], ext, True),
                         (r["gpu_hit_tokens"], 0, False))
    snap = lookup_reproducer(spec.engine_config(), spec.requests(), div, MemorySink())
    assert snap is not None and snap.req_id == r["req_id"] and snap.local_hit_tokens == r["gpu_hit_tokens"]
    name = write_lookup_case(tmp_path, snap, div)
    case = parse_check(tomllib.loads((tmp_path / name).read_text()), name)
    assert case.expect["new"].external_tokens == 0
    assert run_check(CheckCase.from_snapshot(snap), "new")["external_tokens"] == ext
