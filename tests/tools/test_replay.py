"""The crash library replayed with real copies: NEW reads nothing bad; OLD with
assertions stripped reads bad data exactly where OLD with assertions crashes on
a not-ready chunk, and still dies on a missing one (AttributeError in vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.cli import main
from sim.io.check import load_check_file, parse_check
from sim.tools.replay import replay_check
from tests.helpers import ROOT

CASES = sorted((ROOT / "scenarios" / "crash").rglob("*.toml"))


def _scenario(path: Path):  # type: ignore[no-untyped-def]
    _, items = load_check_file(path)
    return parse_check(items[0], str(path))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_crash_library_with_the_copy_path(path: Path) -> None:
    sc = _scenario(path)
    new = replay_check(sc, "new")
    assert new["integrity_violations"] == 0 and new["violations"] == []
    on = replay_check(sc, "old")
    off = replay_check(sc, "old", assertions=False)
    assert on["integrity_violations"] == 0     # with assertions OLD stops before reading
    crash = on["crash"]
    if crash is None:
        assert off["crash"] is None and off["violations"] == []
    elif crash["kind"] == "chunk_not_ready":
        if off["crash"] is None:
            # stripped: it proceeds, and the first bad read is the chunk it crashed on
            assert off["violations"][0] == [crash["group"], crash["chunk"]]
            assert ["unsafe_read", crash["group"], crash["chunk"]] in off["hazards"]
        else:
            # unless a key after it in load order is missing: vLLM -O still dies in
            # prepare_load, before any load job runs (nothing is read)
            assert off["crash"]["kind"] == "missing_chunk" and off["violations"] == []
            assert "AttributeError" in off["crash"]["message"]
            assert (off["crash"]["group"], off["crash"]["chunk"]) > (crash["group"], crash["chunk"])
    elif crash["kind"] == "missing_chunk":
        assert off["crash"] is not None and off["crash"]["kind"] == "missing_chunk"
        assert (off["crash"]["group"], off["crash"]["chunk"]) == (crash["group"], crash["chunk"])
        assert "AttributeError" in off["crash"]["message"]
    else:   # the scheduler's own assertions are kept
        assert off["crash"] == crash


def test_the_library_exercises_both_stripped_outcomes() -> None:
    kinds = {replay_check(_scenario(p), "old")["crash"]["kind"]
             for p in CASES if replay_check(_scenario(p), "old")["crash"]}
    assert {"chunk_not_ready", "missing_chunk"} <= kinds


def test_check_copy_path_cli(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "scenarios" / "crash" / "s6-b3904-left-pending.toml"
    assert main(["check", str(path), "--copy-path"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3
    assert "[new] 3904 tokens loaded, no crash, integrity violations: none" in out[0]
    assert "[old] 0 tokens loaded, CRASH chunk_not_ready (group 1, chunk 14)" in out[1]
    assert "[old-O] 3904 tokens loaded, no crash, integrity violations: (group 1, chunk 14)" in out[2]
