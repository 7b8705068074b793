"""Every modelled crash or hazard of a run becomes a check/1 case that
``kvsim check`` reproduces in isolation."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sim.cli import main
from sim.engine.loop import Engine, EngineConfig, SimulationResult
from sim.engine.metrics import MemorySink, Recorder
from sim.io.check import CheckCase, write_reproducers
from sim.model.costs import StepCostModel
from tests.engine.worlds import SPEC6, crash_world, req


def _loading_world(logic: str) -> SimulationResult:
    """Spec §6.1 with the left key swa[14] present but being loaded by another
    request (a load that completes at t = 2): OLD loads it a second time."""
    b = req("b", 1.0, 4353, 3, prefix=5, tph=8)
    cfg = EngineConfig(layout=SPEC6, gpu_blocks=4000, cpu_capacity_chunks=100, window_logic=logic,  # type: ignore[arg-type]
                       step_cost=StepCostModel(0.01, 1e-5))
    eng = Engine(cfg, [b], Recorder(MemorySink()))
    cpu, conn = eng.cpu, eng.conn
    assert cpu is not None and conn is not None and conn.being_loaded is not None
    keys = [SPEC6.offload_keys(g, b.block_hashes[: 4353 // 8]) for g in range(3)]
    stored = [*keys[0][0:4], keys[1][14], keys[1][15], *keys[2][118:122]]
    plan = cpu.prepare_store(stored)
    assert plan is not None
    cpu.complete_store(plan.keys)
    cpu.prepare_load([keys[1][14]])
    conn.being_loaded.add(keys[1][14])

    def other_load_done():  # type: ignore[no-untyped-def]
        yield eng.env.timeout(2.0)
        cpu.complete_load([keys[1][14]])
        conn.being_loaded.discard(keys[1][14])
        eng.kick()

    eng.env.process(other_load_done())
    return eng.run()


def test_crash_reproducer_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, res = crash_world("record", "old")
    assert len(res.reproducers) == 1
    info = write_reproducers(tmp_path, res.reproducers)
    assert info == {"files": ["000-b-missing_chunk.toml"], "reproduced": 1, "count": 1}
    path = tmp_path / "000-b-missing_chunk.toml"
    case = tomllib.loads(path.read_text())
    assert case["chunk_states"] == {"0": {"0..3": "present"}, "1": {"15": "present"},
                                    "2": {"118..121": "present"}}
    assert case["expect"]["old"] == {"crash": "missing_chunk", "hazards": [], "external_tokens": 3904}
    assert case["expect"]["new"] == {"crash": "none", "hazards": [], "external_tokens": 0}
    assert "reproduced in isolation: yes" in path.read_text()
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[old] 3904 tokens, CRASH missing_chunk (group 1, chunk 14)  ok" in out


def test_hazard_reproducer_states_the_chunk_as_loading(tmp_path: Path) -> None:
    res = _loading_world("old")
    assert res.summary.hazards >= 1 and res.reproducers
    snap = res.reproducers[0]
    assert snap.kind == "hazard" and snap.detail == "double_load"
    # the request's own load does not count: swa[14] was loading before, the rest present
    assert CheckCase.from_snapshot(snap).state_ranges()["1"] == {"14": "loading", "15": "present"}
    write_reproducers(tmp_path, res.reproducers)
    path = next(tmp_path.glob("*.toml"))
    assert "reproduced in isolation: yes" in path.read_text()
    assert main(["check", str(path)]) == 0
    new = _loading_world("new")
    assert new.summary.hazards == 0 and new.reproducers == []
