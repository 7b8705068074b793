"""``kvsim compare`` on the Mooncake conversation trace (../shared/traces; must exist in CI).

Two questions a serving engineer asks, on real traffic and the DeepSeek-V4-style layout:
does OLD crash where NEW does not, and is the fix complete? The model's answers (the
scenarios in scenarios/compare/ say why): without MTP neither logic crashes on this trace;
with multi-module MTP (spec §10 E4) both do, and every crash has a reproducer that
``kvsim check`` replays to the same outcome.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.cli import main
from sim.tools.compare import compare_runs
from tests.helpers import ROOT

COMPARE = ROOT / "scenarios" / "compare"


def _check_json(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["check", str(path), "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


@pytest.mark.slow
@pytest.mark.usefixtures("traces_dir")
def test_mtp_layout_crashes_under_both_logics_and_reproducers_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = compare_runs(COMPARE / "mooncake-deepseek-v4-mtp.toml", tmp_path / "c",
                       overrides=["workload.limit=500", 'cpu_cache.capacity="32GiB"'],
                       jobs=2, verify_reproducers=True)
    assert res.status == "ok"  # modelled crashes are recorded outcomes
    runs = res.figures["runs"]
    for logic in ("old", "new"):
        crashes = runs[logic]["crashes"]
        assert crashes["count"] > 0, logic
        assert set(crashes["kinds"]) == {"missing_chunk"}, logic
        assert runs[logic]["tokens"]["cpu_hit"] == 0  # every CPU hit through the 8-token group dies
    reps = res.figures["reproducers"]
    assert len(reps["new"]) == runs["new"]["crashes"]["count"]
    for logic in ("old", "new"):
        for rep in reps[logic]:
            assert rep["detail"] == "missing_chunk"
            assert rep["reproduced_in_run"] and rep["verified"]["reproduces"], rep
            # the 5th 32-token chunk left of a 1024-token segment end: never stored
            assert "(group 2, chunk" in rep["event"]
    # kvsim check on the first NEW reproducer: the same crash at the same chunk, in both logics
    first = reps["new"][0]
    got = _check_json(res.path / "new" / first["file"], capsys)
    for logic in ("old", "new"):
        crash = got[logic]["crash"]
        assert crash["kind"] == "missing_chunk"
        assert f"(group {crash['group']}, chunk {crash['chunk']})" in first["event"]
    md = res.report.read_text()
    assert "diverging requests" in md.lower() or "diverg" in md.lower()
    div = res.figures["diverged"]
    assert div["count"] == len(res.diverged) and 0 < len(div["first"]) <= 20
    for row in div["first"]:   # the report shows the first ones (outcome before timing-only)
        assert row["req_id"] in md


@pytest.mark.slow
@pytest.mark.usefixtures("traces_dir")
def test_without_mtp_neither_logic_crashes_on_the_trace(tmp_path: Path) -> None:
    res = compare_runs(COMPARE / "mooncake-deepseek-v4-evict.toml", tmp_path / "c",
                       overrides=["workload.limit=1500", 'cpu_cache.capacity="32GiB"'], jobs=2)
    runs = res.figures["runs"]
    for logic in ("old", "new"):
        assert runs[logic]["crashes"]["count"] == 0, logic
        assert runs[logic]["hazards"]["count"] == 0, logic
        assert runs[logic]["tokens"]["cpu_hit"] > 0, logic  # the cache is used, and it evicts
    assert res.figures["reproducers"] == {"old": [], "new": []}
