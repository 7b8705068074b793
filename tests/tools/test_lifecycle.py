"""The life cycle of results folders (in this process): a failed run, compare,
plot or sweep never destroys the previous result; the temporary folders of dead
processes are removed by the next writer; compare has its own folder; an
unwritable ``--out`` is one line and exit 2; a failed sweep point says why."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import sim
from sim.cli import main
from sim.io import results
from sim.tools import plots as plots_mod
from sim.tools import sweep as sweep_mod
from tests.helpers import ROOT, SWEEP_POLICIES

DEFAULT = ROOT / "scenarios" / "default.toml"
SMALL = ["--set", "workload.sessions=12", "--set", "workload.session_rate_per_s=4", "-q"]

SWEEP = SWEEP_POLICIES


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# -- 1. never destroy a good result --------------------------------------------------------------


def test_failed_run_with_overwrite_keeps_the_previous_run(in_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch):
    out = in_tmp / "results" / "demo"
    assert cli(["run", str(DEFAULT), "--out", str(out), *SMALL], capsys)[0] == 0
    before = tree(out)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulator bug")

    monkeypatch.setattr("sim.tools.run.simulate", boom)
    code, _, err = cli(["run", str(DEFAULT), "--out", str(out), "--overwrite", *SMALL], capsys)
    assert code == 1 and "simulator bug" in err
    assert tree(out) == before
    failed = out.parent / "demo.failed"
    assert str(failed) in err.strip().splitlines()[-1]
    assert json.loads((failed / "summary.json").read_text())["status"] == "failed"
    assert hidden(out.parent) == []


def test_failed_plot_keeps_the_previous_plots(in_tmp: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch):
    out = in_tmp / "run"
    assert cli(["run", str(DEFAULT), "--out", str(out), *SMALL], capsys)[0] == 0
    (out / "plots").mkdir()
    (out / "plots" / "occupancy.png").write_bytes(b"previous")
    (out / "plots" / "mine.txt").write_text("kept")

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("drawing bug")

    monkeypatch.setattr("sim.tools.plots.ttft_cdf", boom)  # drawn after occupancy.png
    with pytest.raises(RuntimeError, match="drawing bug"):
        plots_mod.write_plots(out)
    assert (out / "plots" / "occupancy.png").read_bytes() == b"previous"
    assert hidden(out) == [] and hidden(out / "plots") == []
    monkeypatch.undo()
    written = plots_mod.write_plots(out)
    assert [p.name for p in written] == ["occupancy.png", "link_utilisation.png", "ttft_cdf.png"]
    assert (out / "plots" / "mine.txt").read_text() == "kept"  # only what plot writes is replaced
    assert hidden(out) == [] and hidden(out / "plots") == []


def test_interrupted_sweep_overwrite_keeps_the_previous_sweep(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--out", str(out), "--jobs", "1", "-q"]) == 0
    before = tree(out)
    change = ["--set", "scheduler.max_num_seqs=4"]
    calls: list[int] = []
    real = sweep_mod.run_point

    def second_is_interrupted(task: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr("sim.tools.sweep.run_point", second_is_interrupted)
    capsys.readouterr()
    assert main(["sweep", str(f), "--out", str(out), *change, "--overwrite", "--jobs", "1", "-q"]) == 130
    err = capsys.readouterr().err
    kept = tmp_path / "out.previous"
    assert str(kept) in err and "Traceback" not in err
    assert tree(kept) == before  # the previous sweep, whole
    assert len(sim.load_sweep(out).table) == 1  # the new sweep's finished point ...
    monkeypatch.undo()
    assert main(["sweep", str(f), "--out", str(out), *change, "--overwrite", "--jobs", "1", "-q"]) == 0
    assert "1 skipped" in capsys.readouterr().err  # ... is not run again
    assert sim.load_sweep(out).run(1).scenario["scheduler"]["max_num_seqs"] == 4
    assert hidden(tmp_path) == [] and hidden(out) == [] and hidden(out / "points") == []


def test_a_sweep_overwrite_whose_points_fail_keeps_the_previous_sweep(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--out", str(out), "--jobs", "1", "-q"]) == 0
    before = tree(out)
    bad = tmp_path / "bad.jsonl"   # a trace whose second line is broken: every point fails
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{bad\n')
    capsys.readouterr()
    code = main(["sweep", str(f), "--out", str(out), "--overwrite", "--jobs", "1", "-q",
                 "--set", 'workload.kind="mooncake"', "--set", f'workload.path="{bad}"'])
    err = capsys.readouterr().err
    kept = tmp_path / "out.previous"
    assert code == 1 and f"previous sweep kept in {kept}" in err and "Traceback" not in err
    assert tree(kept) == before   # the good sweep, whole, although every new point replaced one of it
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_overwrite_refuses_a_folder_kvsim_did_not_write(command: str, in_tmp: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    mine = in_tmp / "notes"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.txt").write_text("keep")
    (mine / "sub" / "data.csv").write_text("x")
    before = tree(mine)
    (in_tmp / "s.toml").write_text(SWEEP)
    scenario = str(in_tmp / "s.toml") if command == "sweep" else str(DEFAULT)
    jobs = ["--jobs", "1"] if command != "run" else []
    extra = [*jobs, "-q"] if command == "sweep" else [*SMALL, *jobs]
    code, _, err = cli([command, scenario, "--out", str(mine), "--overwrite", *extra], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "is not a kvsim results folder" in err and "Traceback" not in err
    assert tree(mine) == before and hidden(in_tmp) == []
    # a kvsim results folder is replaced, whatever its kind
    run = in_tmp / "a-run"
    assert cli(["run", str(DEFAULT), "--out", str(run), *SMALL], capsys)[0] == 0
    assert cli([command, scenario, "--out", str(run), "--overwrite", *extra], capsys)[0] == 0


# -- 3. leftovers of dead processes ---------------------------------------------------------------


def test_the_next_writer_removes_the_leftovers_of_dead_processes(in_tmp: Path,
                                                                 capsys: pytest.CaptureFixture[str]):
    dead, me = dead_pid(), os.getpid()
    parent = in_tmp / "results"
    parent.mkdir()
    (parent / "x").mkdir()
    (parent / "x" / "summary.json").write_text("{}")
    for name in (f".demo.tmp-{dead}", f".x-compare.tmp-{dead}", f".y.previous-{dead}", f".other.tmp-{me}"):
        (parent / name).mkdir()
    (parent / f".summary.json.tmp-{dead}").write_text("half")
    (parent / f".x.old-{dead}").mkdir()    # x exists: a leftover of a finished swap
    (parent / f".z.old-{dead}").mkdir()    # z does not: a swap killed half-way, put back
    (parent / f".z.old-{dead}" / "summary.json").write_text("{}")
    assert cli(["run", str(DEFAULT), "--out", str(parent / "demo"), *SMALL], capsys)[0] == 0
    assert hidden(parent) == [f".other.tmp-{me}"]  # a live process's folder is left alone
    assert (parent / "z" / "summary.json").is_file()
    # every writer cleans its parent folder: compare, sweep, plot
    for args in (["compare", str(DEFAULT), "--out", str(parent / "cmp"), "--jobs", "1", *SMALL],
                 ["plot", str(parent / "demo"), "--out", str(parent / "plots")]):
        (parent / f".leftover.tmp-{dead}").mkdir()
        assert cli(args, capsys)[0] == 0
        assert not (parent / f".leftover.tmp-{dead}").exists(), args[0]
    (in_tmp / "s.toml").write_text(SWEEP)
    (parent / f".leftover.tmp-{dead}").mkdir()
    assert main(["sweep", str(in_tmp / "s.toml"), "--out", str(parent / "sw"), "--jobs", "1", "-q"]) == 0
    assert not (parent / f".leftover.tmp-{dead}").exists()
    assert results.clean_leftovers(in_tmp / "nothing-here") == []


# -- 4. compare has its own folder ----------------------------------------------------------------


def test_compare_is_written_beside_the_run_not_inside(in_tmp: Path, capsys: pytest.CaptureFixture[str]):
    assert cli(["compare", str(DEFAULT), "--jobs", "1", *SMALL], capsys)[0] == 0
    cmp = in_tmp / "results" / "default-compare"
    assert (cmp / "compare.json").is_file()
    before = tree(cmp)
    # the run's own folder is free, and replacing it leaves the compare alone
    assert cli(["run", str(DEFAULT), *SMALL], capsys)[0] == 0
    assert cli(["run", str(DEFAULT), "--overwrite", "--plots", *SMALL], capsys)[0] == 0
    assert tree(cmp) == before
    assert sorted(p.name for p in (in_tmp / "results").iterdir()) == ["default", "default-compare"]


# -- 5. an --out that cannot be written -----------------------------------------------------------


@pytest.fixture(scope="module")
def a_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["run", str(DEFAULT), "--out", str(out), *SMALL]) == 0
    return out


def _command(kind: str, out: str, base: Path, a_run: Path) -> list[str]:
    if kind == "run":
        return ["run", str(DEFAULT), "--out", out, *SMALL]
    if kind == "compare":
        return ["compare", str(DEFAULT), "--out", out, "--jobs", "1", *SMALL]
    if kind == "sweep":
        (base / "s.toml").write_text(SWEEP)
        return ["sweep", str(base / "s.toml"), "--out", out, "--jobs", "1", "-q"]
    return ["plot", str(a_run), "--out", out]


@pytest.mark.parametrize("where", ["proc", "file", "erofs"])
@pytest.mark.parametrize("kind", ["run", "compare", "sweep", "plot"])
def test_unwritable_out_is_one_line_exit_2(kind: str, where: str, in_tmp: Path, a_run: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch):
    if where == "proc":
        out = "/proc/kvsim-no-such-folder"
    elif where == "file":
        (in_tmp / "afile").write_text("mine")
        out = str(in_tmp / "afile")
    else:
        out = str(in_tmp / "ro" / "out")
        real = Path.mkdir

        def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
            if str(self).startswith(str(in_tmp / "ro")):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    args = _command(kind, out, in_tmp, a_run)
    before = sorted(p.name for p in in_tmp.iterdir())
    code, _, err = cli(args, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsim: error: ") and out in lines[0], err
    assert sorted(p.name for p in in_tmp.iterdir()) == before  # nothing half written
    if where == "file":
        assert (in_tmp / "afile").read_text() == "mine"
    assert not Path("/proc/kvsim-no-such-folder").exists()


def test_disk_full_during_a_run_keeps_the_previous_run(in_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch):
    out = in_tmp / "demo"
    assert cli(["run", str(DEFAULT), "--out", str(out), *SMALL], capsys)[0] == 0
    before = tree(out)

    def full(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pq.ParquetWriter, "write_batch", full)  # the disk fills up during the run
    code, _, err = cli(["run", str(DEFAULT), "--out", str(out), "--overwrite", *SMALL], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(out) in lines[0], err
    assert tree(out) == before
    assert sorted(p.name for p in in_tmp.iterdir()) == ["demo"]


# -- 6. a failed sweep point says why -------------------------------------------------------------


def test_a_failed_sweep_point_prints_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    good = '{"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1]}\n'
    (tmp_path / "good.jsonl").write_text(good * 4)
    (tmp_path / "bad.jsonl").write_text(good * 2 + '{"timestamp": 5, "input_length": "many"}\n')
    f = tmp_path / "s.toml"
    f.write_text(SWEEP.split("[sweep]")[0] + """[sweep]
grid = { workload = [ { kind = "mooncake", path = "good.jsonl" }, \
{ kind = "mooncake", path = "bad.jsonl" } ] }
""")
    assert main(["sweep", str(f), "--out", str(tmp_path / "out"), "--jobs", "1", "-q"]) == 1
    err = capsys.readouterr().err
    sweep = sim.load_sweep(tmp_path / "out")
    run_id = sweep.table["run_id"][1]
    line = next(x for x in err.splitlines() if run_id in x and "failed:" in x)
    assert "line 3" in line
