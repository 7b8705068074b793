"""kvsim sweep: sweep/1 expansion and validation, the tidy table, resume after
SIGKILL and Ctrl-C, failing points, determinism, the Ray backend, and every
shipped what-if in its smoke mode."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import sim
from sim.cli import _n, main
from sim.errors import InputError
from sim.io.columns import flat_summary
from sim.io.validate import validate_file
from sim.tools.sweep import HEAD_COLUMNS, RESOLVED_COLUMNS, read_sweep, run_sweep
from tests.helpers import SWEEP_BASE

ROOT = Path(__file__).resolve().parents[2]
WHATIF = ROOT / "scenarios" / "whatif"
CPU12 = WHATIF / "cpu-ram-12.toml"
#: a lighter base for the 12-point sweep in tests (about 0.7 s a point)
SMALL = ["--set", "workload.sessions=20"]
CAPACITIES = ["0GiB", "512MiB", "1GiB", "2GiB", "4GiB", "8GiB"]
METRICS = ("cpu_hit_rate", "gpu_hit_rate", "recompute_saved", "ttft_s_p50", "ttft_s_p90", "ttft_s_p99",
           "tpot_s_p50", "requests_finished", "crashes_count", "hazards_count", "integrity_violations",
           "transfers_h2d_utilisation", "transfers_d2h_utilisation", "tokens_cpu_hit", "sim_time_s",
           "throughput_requests_per_s", "overloaded", "load_overloaded")

BASE = SWEEP_BASE


def write(tmp: Path, text: str, name: str = "s.toml") -> Path:
    p = tmp / name
    p.write_text(text)
    return p


def kvsim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def finished(folder: Path) -> list[str]:
    points = folder / "points"
    return sorted(p.name for p in points.iterdir() if not p.name.startswith(".")) if points.is_dir() else []


@pytest.fixture(scope="module")
def local12(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 12-point what-if, run once with the local backend and --jobs 2."""
    out = tmp_path_factory.mktemp("local") / "sweep"
    assert main(["sweep", str(CPU12), "--jobs", "2", "--out", str(out), "-q", *SMALL]) == 0
    return out


# -- the file -------------------------------------------------------------------------------------


def test_grid_order_points_crossed_and_smoke_selection(tmp_path: Path):
    f = write(tmp_path, BASE + """[sweep]
points = [ { seed = 1 }, { seed = 2, "scheduler.max_num_seqs" = 8 } ]
grid = { "cpu_cache.policy" = ["lru", "arc"], "scheduler.blocks_per_chunk" = [1, 2, 4] }
set = { "workload.limit" = 10 }
[smoke]
points = 3
set = { "workload.limit" = 5 }
""")
    sw = read_sweep(f)
    assert sw.total == len(sw.points) == 12
    assert sw.swept == ("seed", "scheduler.max_num_seqs", "cpu_cache.policy", "scheduler.blocks_per_chunk")
    assert sw.keys == ("scheduler.max_num_seqs", "cpu_cache.policy", "scheduler.blocks_per_chunk")
    first, last = sw.points[0], sw.points[11]
    assert first.values == {"seed": 1, "cpu_cache.policy": "lru", "scheduler.blocks_per_chunk": 1}
    assert sw.points[1].values["scheduler.blocks_per_chunk"] == 2      # the last grid key varies fastest
    assert sw.points[3].values["cpu_cache.policy"] == "arc"
    assert last.values == {"seed": 2, "scheduler.max_num_seqs": 8, "cpu_cache.policy": "arc",
                           "scheduler.blocks_per_chunk": 4}
    assert first.run_id == "000-seed_1-policy_lru-blocks_per_chunk_1"
    assert [p.index for p in sw.points] == list(range(12))
    spec = last.spec.scenario
    assert (spec.seed, spec.scheduler.max_num_seqs, spec.cpu_cache.policy, spec.scheduler.blocks_per_chunk,
            spec.workload.limit, spec.name) == (2, 8, "arc", 4, 10, last.run_id)
    smoke = read_sweep(f, smoke=True)
    assert [p.index for p in smoke.points] == [0, 5, 11]
    assert [p.run_id for p in smoke.points] == [sw.points[i].run_id for i in (0, 5, 11)]
    assert all(p.spec.scenario.workload.limit == 5 for p in smoke.points)
    # --set wins over the file's sweep.set and smoke.set, as over its base (it was ignored silently)
    assert all(p.spec.scenario.workload.limit == 7 for p in read_sweep(f, ["workload.limit=7"]).points)
    overridden = read_sweep(f, ["workload.limit=7"], smoke=True)
    assert all(p.spec.scenario.workload.limit == 7 for p in overridden.points)
    recorded = tmp_path / "recorded.toml"   # what the sweep folder keeps reruns the same points
    recorded.write_text(overridden.text)
    assert [p.resolved_toml for p in read_sweep(recorded, smoke=True).points] == \
        [p.resolved_toml for p in overridden.points]
    assert validate_file(f) == ("sweep/1: 't', 12 points over seed, scheduler.max_num_seqs, "
                                "cpu_cache.policy, scheduler.blocks_per_chunk; smoke: 3 points")


def test_nested_grid_and_whole_table_values(tmp_path: Path):
    f = write(tmp_path, BASE + """[sweep.grid]
cpu_cache.capacity = ["0GiB", "2GiB"]
workload = [ { kind = "uniform", requests = 5 }, { kind = "multiturn", sessions = 3 } ]
""")
    sw = read_sweep(f)
    assert sw.swept == ("cpu_cache.capacity", "workload")
    kinds = [p.spec.scenario.workload.kind for p in sw.points]
    assert kinds == ["uniform", "multiturn", "uniform", "multiturn"]
    assert sw.points[1].spec.scenario.workload.sessions == 3        # the table replaced the base's
    assert [p.resolved_columns()["cpu_cache_bytes"] for p in sw.points] == [0, 0, 2 << 30, 2 << 30]
    assert sw.points[3].run_id == "003-capacity_2GiB-workload_multiturn"


BAD = [
    ('[sweep]\ngrid = { "cpu_cache.capcity" = ["1GiB"] }\n', 'sweep.grid."cpu_cache.capcity"', "unknown key"),
    ('[sweep]\ngrid = { "cpu_cache.policy" = ["lru", "fifo"] }\n', 'sweep.grid."cpu_cache.policy"',
     "'fifo' is invalid"),
    ('[sweep]\ngrid = { "cpu_cache.policy" = "lru" }\n', 'sweep.grid."cpu_cache.policy"', "not a list"),
    ('[sweep]\ngrid = { "cpu_cache.policy" = ["lru", "lru"] }\n', 'sweep.grid."cpu_cache.policy"',
     "appears twice"),
    ('[sweep]\npoints = [ { seed = 1 }, { "cpu_cache.capacity" = "12 furlongs" } ]\n',
     'sweep.points[1]."cpu_cache.capacity"', "unknown unit"),
    ('[sweep]\npoints = [ { name = "x" } ]\n', "sweep.points[0].name", "cannot be swept"),
    ('[sweep]\npoints = [ { seed = 1 } ]\ngrid = { seed = [2] }\n', "sweep.points[0].seed", "also a key"),
    ('[sweep]\ngrid = { seed = [1] }\nrepeat = 2\n', "sweep.repeat", "unknown key"),
    ('[sweep]\n', "sweep", "neither grid nor points"),
    ('', "sweep", "required table missing"),
    ('[sweep]\ngrid = { seed = [1] }\n[smoke]\npoints = 0\n', "smoke.points", "invalid"),
]


@pytest.mark.parametrize(("tail", "key", "problem"), BAD)
def test_bad_sweep_is_one_line_exit_2_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       tail: str, key: str, problem: str):
    f = write(tmp_path, BASE + tail)
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--out", str(out), "--smoke", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvsim: error: {f}:{key}: "), err
    assert problem in err[0]
    assert not out.exists()
    with pytest.raises(InputError):
        validate_file(f)


def test_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    f = write(tmp_path, BASE + '[sweep]\ngrid = { "cpu_cache.policy" = ["lru", "arc"] }\n')
    out = tmp_path / "out"
    for args, where in ((["--set", "cpu_cache.policy=arc"], "--set:cpu_cache.policy: swept"),
                        (["--set", "cpu_cache=1"], "--set:cpu_cache: swept"),
                        (["--jobs", "0"], "argument:--jobs"),
                        (["--address", "127.0.0.1:1"], "argument:--address: only with --backend ray")):
        assert main(["sweep", str(f), "--out", str(out), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"kvsim: error: {where}"), err
    assert not out.exists()


def test_ray_backend_without_ray_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    f = write(tmp_path, BASE + '[sweep]\ngrid = { seed = [1, 2] }\n')
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--backend", "ray", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvsim: error: argument:--backend: ray is not installed; "
                   "allowed: pip install 'kvsim[ray]', or --backend local"]
    assert not out.exists()


# -- failing points, a changed sweep ----------------------------------------------------------------


def test_failing_point_is_recorded_and_the_others_finish(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    good = '{"timestamp": 0, "input_length": 300, "output_length": 4, "hash_ids": [1]}\n'
    (tmp_path / "good.jsonl").write_text(good * 4)
    (tmp_path / "bad.jsonl").write_text(good * 2 + '{"timestamp": 5, "input_length": "many"}\n')
    f = write(tmp_path, BASE + """[sweep]
grid = { workload = [ { kind = "mooncake", path = "good.jsonl" }, \
{ kind = "mooncake", path = "bad.jsonl" } ], "cpu_cache.policy" = ["lru", "arc"] }
""")
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--out", str(out), "--jobs", "1", "-q"]) == 1
    t = sim.load_sweep(out).table
    assert list(t["status"]) == ["ok", "ok", "failed", "failed"]
    assert list(t["workload"]) == ["good.jsonl", "good.jsonl", "bad.jsonl", "bad.jsonl"]
    assert (t["error"][:2] == "").all()
    assert all("line 3" in e for e in t["error"][2:])
    assert t["cpu_hit_rate"][2:].isna().all() and t["requests_finished"][:2].tolist() == [4, 4]
    summary = json.loads((out / t["run_dir"][3] / "summary.json").read_text())
    assert summary["status"] == "failed" and "line 3" in summary["error"]
    assert "2 point(s) failed" in capsys.readouterr().err

    # a re-run keeps the ok points and runs the failed ones again
    assert main(["sweep", str(f), "--out", str(out), "--jobs", "1", "-q"]) == 1
    assert "2 skipped" in capsys.readouterr().err

    # the definition changed: refused in one line, nothing touched; --overwrite replaces
    before = (out / "sweep.parquet").read_bytes()
    change = ["--set", "scheduler.max_num_seqs=4"]
    assert main(["sweep", str(f), "--out", str(out), *change, "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the sweep changed: points/000-" in err[0] and "--overwrite" in err[0]
    assert (out / "sweep.parquet").read_bytes() == before
    assert main(["sweep", str(f), "--out", str(out), *change, "--overwrite", "-q"]) == 1
    assert "0 skipped" in capsys.readouterr().err
    assert sim.load_sweep(out).run(0).scenario["scheduler"]["max_num_seqs"] == 4


# -- the 12-point what-if -----------------------------------------------------------------------


@pytest.mark.slow
def test_twelve_points_tidy_table(local12: Path):
    res = sim.load_sweep(local12)
    t = res.table
    assert len(t) == 12 and list(t["point"]) == list(range(12))
    assert list(t.columns[:5]) == list(HEAD_COLUMNS)
    assert list(t.columns[5:7]) == ["cpu_cache.capacity", "cpu_cache.policy"]
    assert list(t.columns[7:17]) == list(RESOLVED_COLUMNS)
    for col in (*METRICS, "crashes_kinds_missing_chunk", "engine_deferral_reasons_being_loaded"):
        assert col in t.columns, col
    assert not any("wall" in c for c in t.columns)
    assert (t["status"] == "ok").all() and (t["error"] == "").all()
    assert list(t["cpu_cache.capacity"]) == [c for c in CAPACITIES for _ in (0, 1)]
    assert list(t["cpu_cache.policy"]) == ["lru", "arc"] * 6
    assert list(t["cpu_cache_policy"]) == ["lru", "arc"] * 6
    assert list(t["cpu_cache_bytes"][::2]) == [0, 512 << 20, 1 << 30, 2 << 30, 4 << 30, 8 << 30]
    assert set(t["model"]) == {"hybrid-demo"} and set(t["hardware"]) == {"h200"}
    assert set(t["workload"]) == {"multiturn"} and set(t["blocks_per_chunk"]) == {4}
    assert set(t["h2d_bytes_per_s"]) == {55e9} and set(t["seed"]) == {0}
    assert (t["crashes_kinds_missing_chunk"] == 0).all() and t["overloaded"].dtype == bool
    assert (t["cpu_hit_rate"][:2] == 0).all() and t["cpu_hit_rate"].iloc[-1] > 0.05
    for row in t.itertuples():
        assert (local12 / row.run_dir / "summary.json").is_file()
    assert res.spec["schema"] == "sweep/1" and len(res.spec["resolved"]["points"]) == 12
    assert res.run(3).summary["cpu_hit_rate"] == t["cpu_hit_rate"][3]
    assert res.run(t["run_id"][3]).path == local12 / t["run_dir"][3]


def test_sweep_times_reads_every_points_wall_time(local12: Path):
    """benchmarks/sweep_times.py joins the table with each point's run_info.json."""
    script = str(ROOT / "benchmarks" / "sweep_times.py")
    out = subprocess.run([sys.executable, script, str(local12), "--points"],
                         capture_output=True, text=True, check=True).stdout
    walls = [json.loads((local12 / d / "run_info.json").read_text())["wall_clock_s"]
             for d in sim.load_sweep(local12).table["run_dir"]]
    assert out.count("\n") >= 12 + 4
    assert "12 points (" in out
    assert f"{sum(walls) / 60:.1f} min of point wall time" in out
    # no point of this sweep has a queue limit: none stopped at one
    assert "stopped" in out.splitlines()[0] and ", 0 stopped at their queue limit," in out


def test_sweep_times_refuses_a_folder_without_a_sweep(tmp_path: Path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_times.py"), str(tmp_path)],
                         check=False, capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"sweep_times: {tmp_path}: not a sweep folder (no sweep.parquet)"


@pytest.mark.slow
@pytest.mark.parametrize("point", [5, 8])
def test_points_equal_kvsim_run_one_by_one(local12: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           point: int):
    data = CPU12.read_text().replace('schema = "sweep/1"', 'schema = "run/1"').split("[sweep]")[0]
    base = write(tmp_path, data, "base.toml")
    capacity, policy = CAPACITIES[point // 2], ["lru", "arc"][point % 2]
    out = tmp_path / "run"
    assert main(["run", str(base), "--out", str(out), "-q", *SMALL,
                 "--set", f'cpu_cache.capacity="{capacity}"', "--set", f"cpu_cache.policy={policy}"]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    row = sim.load_sweep(local12).table.iloc[point]
    assert (row["cpu_cache.capacity"], row["cpu_cache.policy"]) == (capacity, policy)
    flat = flat_summary(summary)
    for col in METRICS:
        assert row[col] == flat[col], col
    assert flat["ttft_s_p50"] == summary["ttft_s"]["p50"]
    assert flat["requests_finished"] == summary["requests"]["finished"]


def _wait_for(folder: Path, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while len(finished(folder)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_interrupted_sweep_resumes_only_the_rest(local12: Path, tmp_path: Path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "sim.cli", "sweep", str(CPU12), "--out", str(out), "-q", *SMALL]

    # SIGKILL after 4 points: at most the point in flight is lost
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": tmp_path}
    proc = subprocess.Popen([*cmd, "--jobs", "1"], **pipes)
    _wait_for(out, 4, proc)
    proc.kill()
    proc.communicate()
    done = finished(out)
    assert 4 <= len(done) < 12
    infos = {name: (out / "points" / name / "run_info.json").read_bytes() for name in done}

    # Ctrl-C (SIGINT to the process group, as a terminal does) with a process pool, after 8 points
    proc = subprocess.Popen([*cmd, "--jobs", "2"], start_new_session=True, **pipes)
    _wait_for(out, max(8, len(done) + 1), proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert f"{len(done)} skipped" in err and "interrupted" in err
    done2 = finished(out)
    assert len(sim.load_sweep(out).table) == len(done2) < 12
    infos.update({n: (out / "points" / n / "run_info.json").read_bytes() for n in done2 if n not in infos})

    # the re-run runs only the remaining points
    result = kvsim("sweep", str(CPU12), "--out", str(out), "-q", "--jobs", "1", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{len(done2)} skipped (finished earlier), {12 - len(done2)} to run" in result.stderr
    for name, info in infos.items():
        assert (out / "points" / name / "run_info.json").read_bytes() == info, name
    assert len(finished(out)) == 12 and not [p for p in (out / "points").iterdir() if p.name.startswith(".")]
    assert len(sim.load_sweep(out).table) == 12
    # determinism: interrupted twice, other job counts, same bytes
    assert (out / "sweep.parquet").read_bytes() == (local12 / "sweep.parquet").read_bytes()


def test_point_finished_but_unreported_at_interrupt_is_in_the_table(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """A worker puts its point in place, then Ctrl-C arrives before the parent hears of it: the table
    must still list the point (a re-run skips it), as the process-pool test can hit by chance."""
    import sim.tools.sweep as sweep_mod

    def run_then_interrupt(tasks, done):
        sweep_mod.run_point({**tasks[0], "parent_pid": None})  # in place, never reported
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_mod, "_run_here", run_then_interrupt)
    sw = read_sweep(CPU12, overrides=["workload.sessions=20"])
    report = run_sweep(sw, tmp_path / "out", jobs=1)
    assert report.interrupted is not None
    assert finished(tmp_path / "out") == [sw.points[0].run_id]
    t = sim.load_sweep(tmp_path / "out").table
    assert list(t["run_id"]) == [sw.points[0].run_id] and (t["status"] == "ok").all()


# -- Ray ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ray_head() -> Iterator[str]:
    """A local Ray head started like a user would (``ray start --head``), stopped afterwards."""
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed in CI (pip install -e '.[test,ray]')")
        pytest.skip("ray not installed")
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_bin is not None
    port = _free_port()
    temp = Path(f"/tmp/kvsim-ray-{os.getpid()}")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--port", str(port),
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                   check=True, capture_output=True, env=env, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, env=env, timeout=120, check=False)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_joins_a_cluster_that_uses_the_token_of_an_earlier_local_ray(local12: Path, tmp_path: Path):
    """Recent Ray (2.60 here): once any local ``ray.init()`` (a sweep's own instance included) has
    written ``~/.ray/auth_token``, ``ray start --head`` turns token authentication on; the
    sweep must join it with that token (it failed to: "Authentication token is missing").
    Both processes run with their own HOME holding a token, and no RAY_AUTH_MODE."""
    pytest.importorskip("ray")
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_bin is not None
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("kvsim-test-" + os.urandom(16).hex())
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env |= {"HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    port, temp = _free_port(), Path(f"/tmp/kvsim-ray-{os.getpid()}-token")   # a short path: Ray's sockets
    started = subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--port", str(port),
                              "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                             capture_output=True, text=True, env=env, timeout=120, check=False)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        out = tmp_path / "sweep"
        done = subprocess.run([sys.executable, "-m", "sim.cli", "sweep", str(CPU12), "--backend", "ray",
                               "--address", f"127.0.0.1:{port}", "--out", str(out), "-q", *SMALL],
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Token authentication" not in done.stderr
        assert (out / "sweep.parquet").read_bytes() == (local12 / "sweep.parquet").read_bytes()
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, env=env, timeout=120, check=False)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_backend_equals_local(local12: Path, ray_head: str, tmp_path: Path):
    out = tmp_path / "ray"
    assert main(["sweep", str(CPU12), "--backend", "ray", "--address", ray_head, "--out", str(out), "-q",
                 *SMALL]) == 0
    ray_t, local_t = sim.load_sweep(out).table, sim.load_sweep(local12).table
    assert ray_t.equals(local_t)
    assert (out / "sweep.parquet").read_bytes() == (local12 / "sweep.parquet").read_bytes()
    assert read_sweep(CPU12, SMALL[1:]).text == (out / "sweep.toml").read_text()


# -- the shipped what-ifs -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in WHATIF.glob("*.toml")))
def test_whatif_validates_and_runs_in_smoke_mode(name: str, tmp_path: Path, request: pytest.FixtureRequest):
    path = WHATIF / name
    if "shared/traces" in path.read_text() or 'trace = "' in path.read_text():   # a trace by name
        request.getfixturevalue("traces_dir")  # fails in CI when the traces are missing
    assert validate_file(path).startswith("sweep/1:")
    data = tomllib.loads(path.read_text())
    assert "smoke" in data and data["smoke"]["set"]["workload.limit"] <= 100
    sw = read_sweep(path, smoke=True)
    assert 1 <= len(sw.points) <= 4
    report = run_sweep(sw, tmp_path / "out", jobs=1)
    assert report.failed == [] and report.interrupted is None and report.ran == len(sw.points)
    t = sim.load_sweep(tmp_path / "out").table
    assert len(t) == len(sw.points) and (t["status"] == "ok").all()
    assert (t["requests_finished"] > 0).all()


def test_points_stopped_at_their_queue_limit_are_told_apart(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]):
    """A sweep run with ``output.stop_at_waiting``: the points whose queue reached it end
    with ``queue_limit``, are overloaded, and the closing warning counts them."""
    out = tmp_path / "sweep"
    assert main(["sweep", str(CPU12), "--smoke", "--out", str(out), "-q", *SMALL,
                 "--set", "output.stop_at_waiting=2"]) == 0
    err = capsys.readouterr().err
    table = sim.load_sweep(out).table
    stopped = table[table["end"] == "queue_limit"]
    assert len(stopped) >= 1 and stopped["overloaded"].all()
    said = f"{_n(len(stopped), 'point')} of them stopped when their queue reached output.stop_at_waiting"
    assert said in err


def test_a_finished_sweep_starts_no_ray_instance(local12: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    """Re-running a finished sweep with --backend ray runs nothing, so it starts no Ray instance."""
    import sim.tools.sweep as sweep_mod

    pytest.importorskip("ray")
    out = tmp_path / "again"
    shutil.copytree(local12, out)

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Ray instance was started for a finished sweep")

    monkeypatch.setattr(sweep_mod, "_run_ray", no_ray)
    assert main(["sweep", str(CPU12), "--backend", "ray", "--out", str(out), "-q", *SMALL]) == 0
    assert (out / "sweep.parquet").read_bytes() == (local12 / "sweep.parquet").read_bytes()
