"""The notebooks in ``notebooks/``: committed without outputs, and each runs top to bottom.

Each notebook is executed with nbclient on the ``python3`` kernel (ipykernel) in SMALL
mode (``KVSIM_NOTEBOOK_SMALL=1``: tiny inputs), started in ``notebooks/`` as Jupyter
would; its results go to a temporary folder (``KVSIM_NOTEBOOK_RESULTS``). Besides "no
cell raised", each notebook writes ``key_numbers.json`` and the test checks those numbers
against facts that hold whatever the simulator's exact figures: notebook 01 (the planner's
sweep, on ``../shared/traces``, which must exist in CI) reports every overloaded point, never
recommends from one, and its recommended size meets the target at the chosen percentile; the
per-request rows add up to the summary; the crash library has OLD crashes; the MTP compare
crashes under both logics; and each notebook ends with a takeaway computed from its numbers.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import sim
from tests.helpers import ROOT, TRACES

NOTEBOOKS = ROOT / "notebooks"
NAMES = ("01_capacity_planning", "02_one_run_in_depth", "03_old_vs_new")


def _execute(name: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    import nbclient  # the test extra installs nbclient, nbformat and ipykernel
    import nbformat
    monkeypatch.setenv("KVSIM_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("KVSIM_NOTEBOOK_RESULTS", str(out))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    numbers: dict[str, Any] = json.loads((out / name / "key_numbers.json").read_text(encoding="utf-8"))
    return nb, numbers


def _images(nb: Any) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_three_notebooks_are_committed() -> None:
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs(path: Path) -> None:
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{path.name} cell {i} has outputs: strip them before committing"
            assert cell["execution_count"] is None, f"{path.name} cell {i} has an execution count"
    first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert "KVSIM_NOTEBOOK_SMALL" in "".join(first_code["source"])  # the parameters cell comes first
    assert "parameters" in first_code["metadata"].get("tags", [])


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_use_the_public_api_only(path: Path) -> None:
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert not re.search(r"\bsim(\.\w+)*\._\w", code), "a private sim name"
    assert not re.search(r"from sim[\w.]* import[^\n]*\b_\w", code), "a private sim name"


def _code_cells(name: str) -> list[str]:
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_01_takes_its_question_from_the_parameters_cell_only() -> None:
    cells = _code_cells("01_capacity_planning")
    for name in ("TTFT_PERCENTILE", "TTFT_TARGET_S", "SWEEP_FILE"):
        assigned = [i for i, src in enumerate(cells) if re.search(rf"^\s*{name}\s*=", src, re.MULTILINE)]
        assert assigned == [0], f"{name} is set outside the parameters cell (cells {assigned})"
    sweep_file = re.search(r'^SWEEP_FILE = "([^"]+)"', cells[0], re.MULTILINE)
    assert sweep_file and sweep_file.group(1) == "scenarios/whatif/planner-llama70b-h100-mooncake.toml"
    assert (ROOT / sweep_file.group(1)).is_file()


@pytest.mark.slow
def test_01_capacity_planning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, traces_dir: Path) -> None:
    nb, k = _execute("01_capacity_planning", tmp_path, monkeypatch)
    # SMALL: the planner sweep's --smoke form (4 points of 100 requests), judged on p50 <= 3.5 s
    assert k["small"] and k["failed"] == 0 and k["points"] == 4 and k["verdict_known"]
    assert k["ttft_percentile"] == "p50" and k["target_ttft_s"] == 3.5
    assert k["target_drawn"] == {"x_s": 3.5, "quantile": 0.5}          # the target is on the TTFT CDF figure
    assert k["group_keys"] == ["workload.rate_scale"]   # the second swept key is never averaged
    assert k["sizes_gib"] == [0.0, 1536.0]
    table = sim.load_sweep(k["sweep_dir"]).table.set_index("point")
    overloaded = sorted(int(p) for p in table.index[table["overloaded"].astype(bool)])
    assert overloaded and k["overloaded_points"] == overloaded        # the real rate overloads the replica
    metric = f"ttft_s_{k['ttft_percentile']}"
    recommended = 0
    for config, c in k["configs"].items():
        assert sorted(c["overloaded_points"] + c["stable_points"]) == sorted(
            int(p) for p in table.index[table["workload.rate_scale"].astype(str) == config.split(" = ")[1]])
        if not c["stable_points"]:
            assert c["recommended_gib"] is None                      # all overloaded: no answer
        if c["recommended_gib"] is None:
            continue
        recommended += 1
        assert c["recommended_points"]
        for p in c["recommended_points"]:
            assert not table.loc[p, "overloaded"]                     # never from an overloaded point
            assert table.loc[p, metric] <= k["target_ttft_s"]         # and it meets the target
            assert table.loc[p, "cpu_cache_bytes"] / 2**30 == c["recommended_gib"]
        for p in c["stable_points"]:                                  # so does every larger stable size
            if table.loc[p, "cpu_cache_bytes"] / 2**30 >= c["recommended_gib"]:
                assert table.loc[p, metric] <= k["target_ttft_s"]
    assert recommended >= 1
    answer = k["answer"]
    for p in overloaded:                                              # the answer names each one, and why
        assert f"point {p} (" in answer
    assert "not considered" in answer and "rejected" in answer and "among stable points" in answer
    # the tiers what-if, SMALL: its --smoke form (the first and the last of its 36 points)
    t = k["tiers"]
    assert t["points"] == 2 and t["failed"] == 0
    assert set(t["best_hit_rate"]) == {"64 GiB", "512 GiB"}
    assert t["best_hit_rate"]["64 GiB"].keys() == {"no tier"}
    assert t["best_hit_rate"]["512 GiB"].keys() == {"pm1743 4TiB"}
    assert _images(nb) == 3  # hit rate vs CPU RAM, TTFT CDFs, the tiers what-if
    assert (tmp_path / "01_capacity_planning" / "hit_rate_vs_cpu.png").is_file()
    assert (tmp_path / "01_capacity_planning" / "tiers_whatif.png").is_file()


@pytest.mark.slow
def test_02_one_run_in_depth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb, k = _execute("02_one_run_in_depth", tmp_path, monkeypatch)
    assert k["small"] and k["status"] == "ok" and k["requests"] > 20
    assert k["cpu_hit_rate_rows"] == pytest.approx(k["cpu_hit_rate_summary"], rel=1e-12)
    assert k["transfers"].get("d2h", 0) > 0
    assert all(q >= 0 for q in k["max_queue_s"].values())
    assert sum(k["ttft_parts_mean_ms"].values()) == pytest.approx(k["ttft_mean_ms"], rel=1e-9)
    assert _images(nb) >= 5  # hits, transfers, queueing, occupancy, link utilisation
    takeaway = k["takeaway"]                                          # computed, not hand-written
    assert f"{k['cpu_hit_rate_summary']:.1%}" in takeaway and f"mean {k['ttft_mean_ms']:.0f} ms" in takeaway
    assert "**stable**" in takeaway or "**overloaded**" in takeaway


@pytest.mark.slow
def test_03_old_vs_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    have_traces = (TRACES / "conversation_trace.jsonl").is_file()
    if not have_traces and os.environ.get("CI"):
        pytest.fail(f"{TRACES} is missing in CI: notebook 03's MTP compare needs it")
    nb, k = _execute("03_old_vs_new", tmp_path, monkeypatch)
    lib = k["library"]
    assert lib["cases"] > 30 and lib["hold"] == lib["cases"]
    assert lib["old_crashes"] > lib["new_crashes"] > 0
    assert k["case"] == {"old": {"external_tokens": 3904, "crash": "missing_chunk"},
                         "new": {"external_tokens": 0, "crash": None}}
    assert k["default"]["status"] == "ok"
    assert k["default"]["crashes"] == {"old": 0, "new": 0} and k["default"]["diverged"] == 0
    if have_traces:
        mtp = k["mtp"]
        assert mtp is not None and mtp["status"] == "ok"
        for logic in ("old", "new"):  # spec §10 E4: multi-module MTP crashes under both logics
            assert mtp["crashes"][logic] > 0
            assert set(mtp["crash_kinds"][logic]) == {"missing_chunk"}
            assert mtp["reproducers"][logic] == mtp["crashes"][logic]
    else:
        assert k["mtp"] is None
    assert _images(nb) >= 1 + have_traces
    takeaway = k["takeaway"]                                          # computed, not hand-written
    assert f"OLD crashes in {lib['old_crashes']}, NEW in {lib['new_crashes']}" in takeaway
    if have_traces:
        assert all(isinstance(v, bool) for v in mtp["overloaded"].values())
        if any(mtp["overloaded"].values()):                            # docs/metrics.md: compare decisions
            assert "**overloaded**" in takeaway and "not on TTFT" in takeaway
