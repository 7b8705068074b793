"""`kvsim compare` / :mod:`sim.tools.compare`: OLD and NEW on the same scenario and seed.

Divergence: on the spec §6 layout with plain traces the two logics agree
(an OLD crash needs the left chunk of the window missing while the chunks
around it are present, which the LRU touch order of a real run does not
leave behind). The divergence tests therefore start the engine with the
spec §6.1 CPU cache contents (fa[0..3], swa[15], short[118..121]; swa[14]
missing) through a patched engine constructor, in both runs alike: OLD then
really crashes (missing_chunk, with its reproducer), NEW does not. The patch
lives in this process, so those tests use ``jobs=1``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from sim.cli import main
from sim.errors import InputError
from sim.tools.compare import (
    DIVERGED_COLUMNS,
    compare_runs,
    compare_table,
    describe_divergence,
    list_reproducers,
    load_compare,
    verify_reproducer,
)
from tests.helpers import ROOT

SMALL = """schema = "run/1"
name = "small"
seed = 3
window_logic = "old"
[model]
groups = [
  { kind = "full", tokens_per_block = 16, layers = 2, kv_heads = 2, head_size = 16 },
  { kind = "sliding_window", tokens_per_block = 16, window = 64, layers = 2, kv_heads = 2, head_size = 16 },
]
[hardware]
gpu_blocks = 3000
[cpu_cache]
chunks = 500
[scheduler]
blocks_per_chunk = 4
[workload]
kind = "multiturn"
sessions = 10
limit = 30
think_time_mean_s = 1.0
system_prompt_tokens = 256
first_user_tokens_mean = 600
followup_user_tokens_mean = 150
output_tokens_mean = 60
[costs]
step = { overhead_s = 0.001, prefill_token_s = 1e-6 }
"""

SPEC6 = """schema = "run/1"
name = "spec6-trace"
[model]
name = "spec6"
[hardware]
gpu_blocks = 4000
[cpu_cache]
chunks = 100
[scheduler]
tokens_per_hash = 8
blocks_per_chunk = 4
[workload]
kind = "trace"
path = "trace.csv"
[costs]
step = "zero"
"""

#: b: the 4353-token prompt of spec §6.1 (block ids 0..136 of 32 tokens); c: an unrelated request
TRACE = ("arrival_s,input_tokens,output_tokens,hash_ids,block_tokens\n"
         f"1.0,4353,3,{' '.join(str(i) for i in range(137))},32\n"
         f"2.0,600,3,{' '.join(str(1000 + i) for i in range(19))},32\n")

RUN_FILES = {"requests.parquet", "steps.parquet", "transfers.parquet", "occupancy.parquet",
             "events.parquet", "summary.json", "scenario.toml", "run_info.json"}


def write(folder: Path, text: str, name: str = "s.toml") -> Path:
    p = folder / name
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def spec6(tmp_path: Path) -> Path:
    write(tmp_path, TRACE, "trace.csv")
    return write(tmp_path, SPEC6, "spec6.toml")


@pytest.fixture
def warm_cache(monkeypatch: pytest.MonkeyPatch, spec6: Path) -> None:
    """Every engine of this process starts with the spec §6.1 CPU cache for request b."""
    from sim.engine import loop as engine
    from sim.io.scenario import load_run

    hashes = list(next(iter(load_run(spec6).requests())).block_hashes)
    original = engine.Engine.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        keys = [self.layout.offload_keys(g, hashes[: 4353 // 8]) for g in range(3)]
        plan = self.cpu.prepare_store([*keys[0][0:4], keys[1][15], *keys[2][118:122]])
        self.cpu.complete_store(plan.keys)

    monkeypatch.setattr(engine.Engine, "__init__", init)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def without_timing(folder: Path) -> tuple[dict[str, Any], str]:
    data = json.loads((folder / "compare.json").read_text())
    data.pop("timing")
    md = (folder / "compare.md").read_text()
    return data, md.split("## Timing")[0]


# -- OLD and NEW agree ---------------------------------------------------------------------------


def test_agreeing_scenario_has_no_divergence_and_writes_every_file(tmp_path: Path) -> None:
    res = compare_runs(write(tmp_path, SMALL), tmp_path / "cmp", jobs=1)
    assert res.status == "ok" and res.path == tmp_path / "cmp"
    names = {p.name for p in res.path.iterdir()}
    assert names == {"old", "new", "compare.md", "compare.json", "compare.png", "diverged.parquet"}
    for lg in ("old", "new"):
        assert {p.name for p in (res.path / lg).iterdir()} >= RUN_FILES
        scenario = (res.path / lg / "scenario.toml").read_text()
        assert f'window_logic = "{lg}"' in scenario  # the file's "old" replaced per run
    assert res.diverged.empty and list(res.diverged.columns) == list(DIVERGED_COLUMNS)
    f = res.figures
    assert f["diverged"]["count"] == 0 and f["diverged"]["requests"] > 10
    old, new = f["runs"]["old"], f["runs"]["new"]
    assert old == new and old["crashes"]["count"] == 0 and old["requests"]["finished"] > 10
    assert old["tokens"]["computed"] > 0 and old["bytes"]["d2h"] > 0
    # a valid PNG with two panels' worth of pixels
    import matplotlib.image

    png = res.plot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(res.plot)
    assert img.shape[0] >= 400 and img.shape[1] >= 1000 and img.std() > 0
    md = res.report.read_text()
    assert md.startswith("# kvsim compare: small") and "0 of " in md and "![" in md
    assert "No run wrote a reproducer" in md
    back = load_compare(res.path)
    assert back.figures == json.loads((res.path / "compare.json").read_text())
    assert back.diverged.empty and back.status == "ok"


def test_cli_prints_the_side_by_side_table(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["compare", str(write(in_tmp, SMALL)), "--jobs", "1", "-q"], capsys)
    assert code == 0, err
    for label in ("crashes", "hazards", "integrity violations", "deferrals", "external-hit tokens",
                  "recomputed tokens", "computed tokens", "bytes H2D / D2H", "TTFT p50 / p90 / p99",
                  "TPOT mean / p50", "throughput", "diverging requests"):
        assert label in out, label
    assert "OLD (vLLM 0.29.0)" in out and "NEW (vLLM 0.30.0)" in out
    assert (in_tmp / "results" / "small-compare" / "compare.json").is_file()
    assert sorted(p.name for p in (in_tmp / "results").iterdir()) == ["small-compare"]


# -- OLD and NEW differ -------------------------------------------------------------------------


def test_spec6_trace_alone_does_not_diverge(spec6: Path, tmp_path: Path) -> None:
    res = compare_runs(spec6, tmp_path / "cmp", jobs=1)
    assert res.diverged.empty
    assert res.figures["runs"]["old"]["crashes"]["count"] == 0


@pytest.mark.usefixtures("warm_cache")
def test_old_crash_diverges_with_reproducer(spec6: Path, tmp_path: Path) -> None:
    res = compare_runs(spec6, tmp_path / "cmp", jobs=1, verify_reproducers=True)
    assert res.status == "ok"  # a modelled crash is a recorded outcome
    old, new = res.figures["runs"]["old"], res.figures["runs"]["new"]
    assert old["crashes"] == {"count": 1, "kinds": {"missing_chunk": 1}, "first_s": 1.0}
    assert new["crashes"]["count"] == 0
    d = res.diverged
    assert list(d.req_id) == ["r000000"]  # b diverges, c does not
    row = d.iloc[0]
    assert row.old_crash == "missing_chunk" and row.new_crash is None
    assert row.old_status == row.new_status == "finished"
    assert row.old_cpu_hit_tokens == 0 and row.new_cpu_hit_tokens == 0
    assert row.how == "OLD crashed (missing_chunk), NEW loaded nothing"
    # the parquet file holds the same rows
    back = load_compare(res.path)
    assert list(back.diverged.columns) == list(DIVERGED_COLUMNS)
    assert back.diverged.how.tolist() == d.how.tolist()
    assert repr(back) == (f"CompareResult({str(res.path)!r}, status 'ok', logics old/new; "
                          "diverged rows: old-new 1)")
    # a damaged compare folder is one InputError naming the file, not a raw JSON or Arrow error
    for name, damage in (("compare.json", b"{"), ("compare.json", b"[]"), ("diverged.parquet", b"PAR1")):
        bad = res.path.parent / f"damaged-{name}-{len(damage)}"
        shutil.copytree(res.path, bad)
        (bad / name).write_bytes(damage)
        with pytest.raises(InputError) as info:
            load_compare(bad)
        assert info.value.source == str(bad / name)
    # the OLD run's reproducer is listed, with its event, and verified
    reps = res.figures["reproducers"]
    assert reps["new"] == []
    (rep,) = reps["old"]
    assert rep["req_id"] == "r000000" and rep["kind"] == "crash" and rep["detail"] == "missing_chunk"
    assert rep["event"] == "crash missing_chunk (group 1, chunk 14)"
    assert rep["verified"]["holds"] and rep["verified"]["reproduces"] and rep["reproduced_in_run"]
    assert (res.path / "old" / rep["file"]).is_file()
    md = res.report.read_text()
    assert "1 of 2 requests" in md and "OLD crashed (missing_chunk), NEW loaded nothing" in md
    assert f"`old/{rep['file']}`" in md and "crash missing_chunk (group 1, chunk 14)" in md
    table = compare_table(res.figures)
    assert "1 (missing_chunk 1; first at 1.000 s)" in table
    assert "r000000: OLD crashed (missing_chunk), NEW loaded nothing" in table


@pytest.mark.usefixtures("warm_cache")
def test_cli_exit_0_when_old_crashes(spec6: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["compare", str(spec6), "--out", str(tmp_path / "c"), "--jobs", "1", "-q",
                            "--verify-reproducers"], capsys)
    assert code == 0
    assert "diverging requests" in out and "1 of 2" in out
    assert "1 (1 verified to reproduce)" in out


def test_failed_run_exits_1_and_still_writes_the_compare(in_tmp: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from sim.tools import run

    original = run.simulate

    def simulate(config: Any, *args: Any, **kwargs: Any) -> Any:
        if str(config.window_logic) == "old":
            raise RuntimeError("simulated simulator bug")
        return original(config, *args, **kwargs)

    monkeypatch.setattr(run, "simulate", simulate)  # where the run lifecycle looks it up
    code, out, err = run_cli(["compare", str(write(in_tmp, SMALL)), "--out", "c", "--jobs", "1", "-q"],
                             capsys)
    assert code == 1
    assert "simulated simulator bug" in err and "OLD run failed" in err
    res = load_compare(in_tmp / "c")
    assert res.status == "failed" and res.figures["runs"]["old"]["status"] == "failed"
    assert res.figures["runs"]["new"]["status"] == "ok"
    assert json.loads((in_tmp / "c" / "old" / "summary.json").read_text())["status"] == "failed"
    assert "The OLD run failed" in (in_tmp / "c" / "compare.md").read_text()
    assert "FAILED" in out


# -- words -------------------------------------------------------------------------------------


def _req(**kw: Any) -> dict[str, Any]:
    base = {"status": "finished", "crash": None, "cpu_hit_tokens": 0, "cpu_reload_tokens": 0,
            "computed_tokens": 100, "deferrals": 0, "first_token_s": 1.0, "finish_s": 2.0}
    return {**base, **kw}


@pytest.mark.parametrize(("old", "new", "how"), [
    (_req(crash="missing_chunk"), _req(cpu_hit_tokens=3904),
     "OLD crashed (missing_chunk), NEW loaded 3904 tokens"),
    (_req(), _req(deferrals=3), "NEW deferred 3 times"),
    (_req(deferrals=1), _req(deferrals=2), "OLD deferred once, NEW 2 times"),
    (_req(cpu_hit_tokens=1024), _req(cpu_hit_tokens=2048), "different CPU hit (OLD 1024, NEW 2048 tokens)"),
    (_req(), _req(first_token_s=1.5), "different TTFT only"),
    (_req(), _req(finish_s=2.5), "different finish time only"),
    (_req(), _req(computed_tokens=90), "different computed tokens (OLD 100, NEW 90)"),
    (_req(), _req(status="unfinished"), "OLD finished, NEW unfinished"),
    (_req(), {"status": "absent"}, "only in OLD (finished); NEW never recorded it"),
])
def test_how_in_words(old: dict[str, Any], new: dict[str, Any], how: str) -> None:
    assert describe_divergence(old, new) == how


# -- bad input: exit 2, nothing created -----------------------------------------------------------


def test_bad_scenario_exits_2_and_creates_nothing(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(in_tmp, SMALL.replace("[cpu_cache]", "[cpu_cache]\ncolour = 1"))
    code, out, err = run_cli(["compare", str(f), "--jobs", "1"], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"kvsim: error: {f}:cpu_cache.colour: unknown key; allowed: "
                                        + err.split("allowed: ", 1)[1].strip()]
    assert sorted(p.name for p in in_tmp.iterdir()) == ["s.toml"]
    code, _, err = run_cli(["compare", str(write(in_tmp, SMALL)), "--set", "seed=-1"], capsys)
    assert code == 2 and err.startswith("kvsim: error: --set:seed")
    code, _, err = run_cli(["compare", "nope.toml"], capsys)
    assert code == 2 and "nope.toml" in err
    assert sorted(p.name for p in in_tmp.iterdir()) == ["s.toml"]
    with pytest.raises(InputError):
        compare_runs(in_tmp / "s.toml", jobs=0)


def test_bad_trace_line_found_while_running_leaves_nothing(in_tmp: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    write(in_tmp, TRACE + "3.0,0,3,,\n", "trace.csv")
    f = write(in_tmp, SPEC6)
    code, _, err = run_cli(["compare", str(f), "-q"], capsys)  # two processes
    assert code == 2
    assert err.startswith("kvsim: error: ") and "line 4" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in in_tmp.iterdir()) == ["s.toml", "trace.csv"]


def test_non_empty_target_is_refused_unless_overwrite(in_tmp: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    target = in_tmp / "c"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    f = write(in_tmp, SMALL)
    code, _, err = run_cli(["compare", str(f), "--out", str(target), "--jobs", "1", "-q"], capsys)
    assert code == 2 and "not empty" in err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert not [p for p in in_tmp.iterdir() if p.name.startswith(".")]
    code, _, err = run_cli(["compare", str(f), "--out", str(target), "--jobs", "1", "-q", "--overwrite"],
                           capsys)   # not a kvsim folder: --overwrite would delete the user's file
    assert code == 2 and "not a kvsim results folder" in err
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    (target / "keep.txt").unlink()
    assert run_cli(["compare", str(f), "--out", str(target), "--jobs", "1", "-q"], capsys)[0] == 0
    (target / "compare.md").write_text("edited")
    code, _, _ = run_cli(["compare", str(f), "--out", str(target), "--jobs", "1", "-q", "--overwrite"],
                         capsys)
    assert code == 0 and (target / "compare.md").read_text() != "edited"
    assert (target / "compare.json").is_file()
    assert not [p for p in in_tmp.iterdir() if p.name.startswith(".")]


# -- determinism ---------------------------------------------------------------------------------


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in ("run_info.json", "compare.json", "compare.md")}


@pytest.mark.slow
def test_jobs_1_equals_jobs_2_and_reruns_are_identical(tmp_path: Path) -> None:
    f = write(tmp_path, SMALL)
    one = compare_runs(f, tmp_path / "one", jobs=1)
    two = compare_runs(f, tmp_path / "two", jobs=2)
    again = compare_runs(f, tmp_path / "again", jobs=1)
    assert two.figures["timing"]["jobs"] == 2 and one.figures["timing"]["jobs"] == 1
    ref = without_timing(one.path)
    assert without_timing(two.path) == ref == without_timing(again.path)
    assert _files(one.path) == _files(two.path) == _files(again.path)
    assert "compare.png" in _files(one.path) and "diverged.parquet" in _files(one.path)
    # a different seed gives different runs: the comparison above can fail
    other = compare_runs(f, tmp_path / "other", overrides=["seed=4"], jobs=1)
    assert without_timing(other.path)[0]["runs"] != ref[0]["runs"]


# -- reproducers ----------------------------------------------------------------------------------


def test_reproducer_folder_absent_or_present(tmp_path: Path) -> None:
    assert list_reproducers(tmp_path) == []
    (tmp_path / "reproducers").mkdir()
    src = ROOT / "scenarios" / "crash" / "s6-b3904-left-missing.toml"
    head = ("# reproducer: crash missing_chunk of request r7 at t = 2.500000 s (OLD logic) in this run\n"
            "# the states of the request's chunks it met, as a check/1 case: kvsim check x\n"
            "# reproduced in isolation: yes\n")
    (tmp_path / "reproducers" / "000-r7-missing_chunk.toml").write_text(head + src.read_text())
    shutil.copy(src, tmp_path / "reproducers" / "001-r9-chunk_not_ready.toml")
    a, b = list_reproducers(tmp_path)
    assert (a["req_id"], a["kind"], a["detail"], a["t_s"], a["reproduced_in_run"]) == (
        "r7", "crash", "missing_chunk", 2.5, True)
    assert (b["req_id"], b["detail"], b["reproduced_in_run"]) == ("r9", "chunk_not_ready", None)
    v = verify_reproducer(tmp_path / a["file"], "old", "crash", "missing_chunk")
    assert v["holds"] and v["reproduces"] and v["error"] is None
    v = verify_reproducer(tmp_path / a["file"], "new", "crash", "missing_chunk")
    assert v["holds"] and not v["reproduces"]  # NEW does not crash there
    (tmp_path / "reproducers" / "002-bad-x.toml").write_text("schema = 'check/1'\nnum_tokens = 'x'\n")
    assert verify_reproducer(tmp_path / "reproducers" / "002-bad-x.toml", "old", "crash", "x")["error"]


def test_outcome_differences_are_counted_and_listed_before_timing_only() -> None:
    import pandas as pd

    from sim.tools.compare import _diverged_figures

    frame = pd.DataFrame({"req_id": ["a", "b", "c", "d"],
                          "how": ["different finish time only",
                                  "OLD crashed (missing_chunk), NEW loaded nothing",
                                  "different TTFT only", "NEW deferred 2 times"]})
    d = _diverged_figures(frame, 10)
    assert (d["count"], d["requests"], d["outcome"], d["timing_only"]) == (4, 10, 2, 2)
    assert [x["req_id"] for x in d["first"]] == ["b", "d", "a", "c"]
