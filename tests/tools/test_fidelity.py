"""The comparison kvsim fidelity makes, without vLLM: two runs of kvsim's own model.

(The runs against real vLLM are in tests/tools/test_vllm_mode.py.)
"""

from __future__ import annotations

from pathlib import Path

from sim.engine.loop import simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.io.scenario import load_run
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
