"""decisions = "vllm" and kvsim fidelity: whole runs decided by the real vLLM releases.

Each test runs kvsim inside a real vLLM environment (``$KVSIM_VLLM_VENVS``,
see tests/tools/test_real_vllm.py; .ci/run installs 0.29.0, 0.30.0, 0.33.0
with kvsim's own dependencies), except the install-hint test, which needs an
environment without vLLM (kvsim's own).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sim.tools.fidelity import REQUEST_FIELDS
from tests.helpers import QUIET_FULL_ATTENTION, ROOT, VLLM_LOGIC_OF

#: full attention, no admission contention: the real schedulers and kvsim's model must agree
AGREE = QUIET_FULL_ATTENTION

#: the spec's hybrid layout (section 6): three groups, two sliding windows
HYBRID = """
schema = "run/1"
name = "hybrid"
[model]
name = "spec6"
[hardware]
gpu_blocks = 3000
[cpu_cache]
chunks = 2000
[scheduler]
blocks_per_chunk = 4
tokens_per_hash = 8
[workload]
kind = "multiturn"
sessions = 6
[costs]
step = { overhead_s = 0.005, prefill_token_s = 1e-5, decode_seq_s = 1e-4, context_token_s = 1e-7 }
transfer = "hardware"
"""


def _kvsim(python: Path | str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(python), "-m", "sim.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900, check=False)


def _write(tmp: Path, text: str, name: str) -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(text)
    return p


def _fuzzed(tmp: Path, seed: int, run: int, version: str,
            max_sim_time_s: float | None = None) -> tuple[Path, dict[str, Any]]:
    """The run fuzzer's configuration ``run`` of ``seed`` under the logic of vLLM ``version``,
    written as a scenario in ``tmp``; the path and the configuration."""
    import tomli_w

    from sim.tools import fuzz

    data = {**fuzz.run_config(fuzz._rng_for(seed, run)), "window_logic": VLLM_LOGIC_OF[version]}
    if max_sim_time_s is not None:
        data["output"]["max_sim_time_s"] = max_sim_time_s
    scenario = tmp / f"fuzz-s{seed}-i{run}.toml"
    scenario.write_text(tomli_w.dumps(data))
    return scenario, data


def _lockstep(python: Path | str, scenario: Path, tmp: Path,
              *sets: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """``kvsim run SCENARIO --decisions differential`` in a vLLM environment (``sets``: its
    ``--set`` values); the run must exit 0. Returns the process, summary.json and the run folder."""
    out = tmp / "diff"
    args = [a for kv in sets for a in ("--set", kv)]
    r = _kvsim(python, "run", str(scenario), "--decisions", "differential", "--out", str(out), "-q", *args,
               cwd=tmp)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r, json.loads((out / "summary.json").read_text()), out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_mode_is_one_line_and_exit_2(tmp_path: Path) -> None:
    scenario = _write(tmp_path, AGREE, "agree")
    for args in (["run", str(scenario), "--decisions", "vllm", "--out", str(tmp_path / "out")],
                 ["run", str(scenario), "--decisions", "differential", "--out", str(tmp_path / "out")],
                 ["fidelity", str(scenario)]):
        r = _kvsim(sys.executable, *args, cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "decisions" in lines[0] and "install-vllm-cpu.sh" in lines[0], r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


def test_a_run_decided_by_real_vllm(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    """The hybrid layout, vLLM deciding: the run completes, says which vLLM decided, every
    request is accounted for, and the GPU and CPU hits are those of kvsim's model."""
    version, python = vllm_python
    scenario = _write(tmp_path, HYBRID, "hybrid")
    out = tmp_path / "real"
    r = _kvsim(python, "run", str(scenario), "--decisions", "vllm", "--out", str(out), "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    info = json.loads((out / "run_info.json").read_text())
    assert summary["status"] == "ok" and summary["end"] == "ok"
    assert summary["run"]["decisions"] == "vllm" and summary["run"]["vllm_version"] == version
    assert info["versions"]["vllm"] == version
    assert "decisions = \"vllm\"" in (out / "scenario.toml").read_text()
    real = pd.read_parquet(out / "requests.parquet")
    transfers = pd.read_parquet(out / "transfers.parquet")
    assert len(real) == summary["requests"]["arrived"] == summary["requests"]["finished"] > 0
    assert (transfers["direction"] == "d2h").sum() > 0 and (transfers["bytes"] > 0).all()
    assert (real["ttft_s"] > 0).all()

    model_out = tmp_path / "model"
    m = _kvsim(sys.executable, "run", str(scenario), "--logic", VLLM_LOGIC_OF[version], "--out",
               str(model_out), "-q", cwd=tmp_path)
    assert m.returncode == 0, m.stderr[-3000:]
    model = pd.read_parquet(model_out / "requests.parquet")
    both = real.merge(model, on="req_id", suffixes=("_vllm", "_kvsim"))
    assert len(both) == len(real)
    for col in ("gpu_hit_tokens", "cpu_hit_tokens", "computed_tokens"):
        assert (both[f"{col}_vllm"] == both[f"{col}_kvsim"]).all(), col


def test_fidelity_agrees_on_full_attention(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    """kvsim fidelity: 0 divergences where kvsim's model is complete (full attention, no
    admission contention), with CPU hits in the run (so loads are compared too)."""
    version, python = vllm_python
    scenario = _write(tmp_path, AGREE, "agree")
    r = _kvsim(python, "fidelity", str(scenario), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["vllm_version"] == version and rep["logic"] == VLLM_LOGIC_OF[version]
    assert rep["status"] == {"kvsim": "ok", "vllm": "ok"}
    assert rep["requests"] == 18 and rep["decisions"] >= rep["requests"] * len(REQUEST_FIELDS)
    assert rep["divergences"] == 0 and rep["first"] is None
    lock = rep["lockstep"]
    assert lock["divergences"] == 0 and lock["first"] is None and lock["decisions"] > rep["decisions"]
    model = _kvsim(sys.executable, "run", str(scenario), "--out", str(tmp_path / "m"), "-q", cwd=tmp_path)
    assert model.returncode == 0
    assert pd.read_parquet(tmp_path / "m" / "requests.parquet")["cpu_hit_tokens"].sum() > 0


def test_fidelity_on_the_hybrid_layout(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    """The spec §6 hybrid layout (two sliding windows, three block sizes), with zero and with
    real step and transfer times: every decision agrees with each release (admission,
    hits, loads, stores, flushes, times; docs/vllm.md for what it took)."""
    version, python = vllm_python
    scenario = _write(tmp_path, HYBRID, "hybrid")
    for costs in (["--set", "costs.step=zero", "--set", "costs.transfer=zero"], []):
        r = _kvsim(python, "fidelity", str(scenario), "--set", "workload.sessions=10", *costs, cwd=tmp_path)
        lines = r.stdout.strip().splitlines()
        assert lines[0].startswith("fidelity: ") and f"vs vLLM {version}, 13 requests" in lines[0], r.stdout
        assert lines[1].startswith("differential: ") and ": 0 divergences in " in lines[1], r.stdout
        assert r.returncode == 0 and lines[3].startswith("0 divergences in 227 decisions"), r.stdout


def test_a_differential_run(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    """decisions = "differential": kvsim's model and vLLM in lockstep on the hybrid layout
    with timed transfers; 0 divergences, recorded in summary.json, printed, exit 0; kvsim's
    rows are the run's."""
    version, python = vllm_python
    r, summary, out = _lockstep(python, _write(tmp_path, HYBRID, "hybrid"), tmp_path)
    diff = summary["differential"]
    assert summary["end"] == "ok" and summary["run"]["decisions"] == "differential"
    assert diff["vllm_version"] == version and diff["logic"] == VLLM_LOGIC_OF[version]
    assert diff["divergences"] == 0 and diff["decisions"] > 1000
    assert diff["status"] == {"kvsim": "ok", "vllm": "ok"}
    assert f"0 divergences in {diff['decisions']} decisions" in r.stdout
    assert not (out / "divergence.json").exists()
    assert len(pd.read_parquet(out / "requests.parquet")) == summary["requests"]["finished"] == 8


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_differential_run_with_cpu_evictions(vllm_python: tuple[str, Path], tmp_path: Path,
                                               policy: str) -> None:
    """The default study cut to 20 sessions with a 1 GiB CPU cache, so that the CPU
    cache evicts early and often: 0 divergences, evictions included (vLLM 0.33's
    request-scoped LRU and ARC under LATEST, 0.29/0.30's touch-based ones before)."""
    _version, python = vllm_python
    _, summary, _ = _lockstep(python, ROOT / "scenarios" / "default.toml", tmp_path, "workload.sessions=20",
                              'cpu_cache.capacity="1GiB"', f'cpu_cache.policy="{policy}"')
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    # far more stored than fits: the CPU cache evicted
    assert summary["transfers"]["d2h_bytes"] > 4 * 2**30


def test_the_mtp_crash_is_a_recorded_outcome(vllm_python: tuple[str, Path], tmp_path: Path,
                                             traces_dir: Path) -> None:
    """The DeepSeek-V4-style MTP compare scenario under real vLLM: 0.29 and 0.30 crash
    (a recorded crash: events row, request column, the run stopped), 0.33 does not."""
    version, python = vllm_python
    scenario = ROOT / "scenarios" / "compare" / "mooncake-deepseek-v4-mtp.toml"
    out = tmp_path / "mtp"
    r = _kvsim(python, "run", str(scenario), "--decisions", "vllm", "--set", "workload.limit=300",
               "--out", str(out), "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    events = pd.read_parquet(out / "events.parquet")
    crashes = events[events["kind"] == "crash"]
    requests = pd.read_parquet(out / "requests.parquet")
    if VLLM_LOGIC_OF[version] in ("old", "new"):
        assert summary["end"] == "stopped_on_crash"
        assert len(crashes) == 1 and crashes.iloc[0]["detail"] == "missing_chunk"
        assert f"vllm {version}" in crashes.iloc[0]["message"]
        crashed = requests[requests["crash"].notna()]
        assert list(crashed["req_id"]) == [crashes.iloc[0]["req_id"]]
    else:
        assert summary["end"] == "ok" and crashes.empty


#: the gemma-3-27b what-if point that found vLLM 0.33's waiting-queue order (docs/vllm.md,
#: finding 12): the first 150 Mooncake requests overload one H200, so requests defer their
#: lookups while others are preempted
GEMMA_MOONCAKE = """
schema = "run/1"
name = "gemma-mooncake"
[model]
name = "gemma-3-27b"
[hardware]
profile = "h200"
[cpu_cache]
capacity = "8GiB"
policy = "lru"
[scheduler]
blocks_per_chunk = 4
tokens_per_hash = 8
[workload]
kind = "mooncake"
trace = "mooncake-conversation"
limit = 150
[costs]
step = "auto"
transfer = "hardware"
"""


def test_a_preempted_request_goes_before_deferred_ones(vllm_python: tuple[str, Path], tmp_path: Path,
                                                       traces_dir: Path) -> None:
    """Lockstep on the gemma-3-27b point: 0 divergences in every release, with lookups
    deferred and a request preempted while they wait (so the queues' order is exercised:
    under 0.33 the preempted request goes in front of the deferred ones)."""
    _version, python = vllm_python
    _, summary, _ = _lockstep(python, _write(tmp_path, GEMMA_MOONCAKE, "gemma"), tmp_path)
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["engine"]["preemptions"] >= 1
    assert sum(summary["engine"]["deferral_reasons"].values()) > 100


def test_a_finished_request_keeps_its_final_store(vllm_python: tuple[str, Path], tmp_path: Path,
                                                   traces_dir: Path) -> None:
    """Lockstep on the gemma-3-27b point with ARC: 0 divergences in every release. Under
    0.29 request r000033 finishes at t = 39.92 s in the same update in which its last store
    job completes, after an offer the full cache refused; vLLM keeps it until its final
    store is built the next step (``finished_signaled``) and stores its 609 chunks then
    (docs/vllm.md, finding 15; before the fix kvsim forgot it and stored nothing)."""
    _version, python = vllm_python
    _, summary, _ = _lockstep(python, _write(tmp_path, GEMMA_MOONCAKE, "gemma"), tmp_path,
                              'cpu_cache.policy="arc"')
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["differential"]["decisions"] > 1000


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mamba_groups_agree_in_the_modelled_cache_modes(vllm_python: tuple[str, Path], tmp_path: Path,
                                                        traces_dir: Path, prefix_caching: bool) -> None:
    """Lockstep on qwen3-next-80b-a3b (three Mamba groups and a full-attention group,
    544-token blocks), the first 60 Mooncake requests: kvsim's Mamba model is vLLM's
    ``mamba_cache_mode = "all"`` (0.29, 0.30; the driver sets it) and ``"none"``
    (without prefix caching), and agrees in both. vLLM 0.33 has only ``"align"`` for
    prefix caching, which kvsim does not model: there the first step differs
    (docs/vllm.md, finding 13)."""
    version, python = vllm_python
    scenario = _write(tmp_path, GEMMA_MOONCAKE.replace('name = "gemma-3-27b"', 'name = "qwen3-next-80b-a3b"')
                      .replace("limit = 150", "limit = 60") + "tensor_parallel = 2\n", "qwen3next")
    sets = [f"scheduler.prefix_caching={str(prefix_caching).lower()}"]
    if prefix_caching and VLLM_LOGIC_OF[version] == "latest":
        out = tmp_path / "diff"
        r = _kvsim(python, "run", str(scenario), "--decisions", "differential", "--out", str(out), "-q",
                   "--set", sets[0], cwd=tmp_path)
        assert "Traceback" not in r.stderr
        first = json.loads((out / "divergence.json").read_text())["first"]
        assert first["step"] == 0 and first["what"] == "scheduled", first
        return
    _, summary, _ = _lockstep(python, scenario, tmp_path, *sets)
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["differential"]["decisions"] > 5000


@pytest.mark.slow
def test_the_default_study_agrees_with_every_release(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    """Lockstep on the default study (``scenarios/default.toml``, unchanged but for its seed):
    0 divergences in every release, with preemptions and reloads from the CPU after them
    under every release's logic. Seed 4: since the scheduler's per-block time (2026-12-06)
    the file's seed 0 has no CPU reload under 0.33's logic (it agreed with every release
    then too). With seed 0 and the model of 2026-12-05 this run found finding 14 (a
    preempted request resumed with a GPU hit and an asynchronous load right after another
    load was admitted, where vLLM holds the first back for the second's prefill,
    docs/vllm.md)."""
    _version, python = vllm_python
    _, summary, _ = _lockstep(python, ROOT / "scenarios" / "default.toml", tmp_path, "seed=4")
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["engine"]["preemptions"] >= 1 and summary["tokens"]["cpu_reload"] > 0


@pytest.mark.parametrize(("seed", "run"), [(5, 523), (6, 594)])
def test_fuzzed_runs_agree_with_every_release(vllm_python: tuple[str, Path], tmp_path: Path,
                                              seed: int, run: int) -> None:
    """Two runs of the run fuzzer's generator (tiny pools, slow links), in lockstep under
    each release's logic: 0 divergences, none of them known ones. Seed 6 run 594 has
    requests longer than ``max_model_len``: vLLM refuses them on arrival, and kvsim's model
    used to queue them (under 0.33's logic, which puts a skipped request back at the head of
    the queue, the run then thrashed for the whole simulated hour: 41,154 preemptions).
    Seed 5 run 523 diverged at its step 161: after a step that only released a finished
    request, kvsim's engine took another step at the same time, repeating the lookups."""
    version, python = vllm_python
    scenario, _ = _fuzzed(tmp_path, seed, run, version)
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    diff = summary["differential"]
    assert diff["divergences"] == 0 and not diff["known"] and diff["decisions"] > 1000, diff
    assert summary["end"] == "ok" and summary["engine"]["preemptions"] < 10
    assert summary["requests"]["rejected"] == (29 if (seed, run) == (6, 594) else 0)


def test_a_configuration_vllm_refuses_is_one_line_and_exit_2(vllm_python: tuple[str, Path],
                                                             tmp_path: Path) -> None:
    """A hybrid Mamba layout without prefix caching whose Mamba block size does not divide
    the hash block size vLLM derives: every release asserts while building its scheduler.
    That is bad input for the vLLM modes (one line naming the release and vLLM's reason,
    exit 2, no run folder), not a traceback."""
    version, python = vllm_python
    scenario = _write(tmp_path, """
schema = "run/1"
[model]
label = "refused"
groups = [{kind = "full", tokens_per_block = 64, layers = 1, kv_heads = 1, head_size = 4},
          {kind = "mamba", tokens_per_block = 32, layers = 1, kv_heads = 1, head_size = 8},
          {kind = "mamba", tokens_per_block = 32, layers = 1, kv_heads = 1, head_size = 8}]
[hardware]
gpu_blocks = 96
[cpu_cache]
chunks = 100
[scheduler]
prefix_caching = false
tokens_per_hash = 16
blocks_per_chunk = 1
[workload]
kind = "uniform"
requests = 3
[costs]
step = "zero"
""", "refused")
    for mode in ("vllm", "differential"):
        out = tmp_path / mode
        r = _kvsim(python, "run", str(scenario), "--decisions", mode, "--out", str(out), cwd=tmp_path)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not out.exists()
        line = next(x for x in r.stderr.splitlines() if x.startswith("kvsim: error:"))
        assert f"decisions: vLLM {version} refuses this configuration: " in line
        assert "need --enable-prefix-caching" in line



@pytest.mark.parametrize("run", [11, 34])
def test_a_chunked_local_layout_vllm_asserts_on_crashes_alike(vllm_python: tuple[str, Path], tmp_path: Path,
                                                               run: int) -> None:
    """Runs 11 and 34 of the run fuzzer's seed 7 (prefix caching on; a chunked-local group whose
    block size is not the layout's common multiple: 16 in 64, 8 in 16): every release asserts
    at the first local lookup; kvsim's model records the same crash at the same step, and the
    lockstep agrees up to where vLLM stops."""
    version, python = vllm_python
    scenario, _ = _fuzzed(tmp_path, 7, run, version)
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["end"] == "stopped_on_crash" and summary["crashes"]["kinds"] == {"assertion": 1}


@pytest.mark.parametrize(("seed", "run"), [(7, 22), (8, 70)])
def test_fuzzed_mamba_runs_with_prefix_caching_agree(vllm_python: tuple[str, Path], tmp_path: Path,
                                                      seed: int, run: int) -> None:
    """Mamba groups with prefix caching (vLLM's ``mamba_cache_mode = "all"``), from the run
    fuzzer's generator: 0 divergences with 0.29 and 0.30. Seed 7 run 22 (full attention, a
    sliding window, a Mamba group): a request whose local hit ends on a Mamba state block
    cached in the same step waits (vLLM's ``cached_blocks_this_step``, finding 20). Seed 8 run
    70 (one Mamba group of 8-token blocks in a 20-block pool): ``max_model_len`` counts a
    state block per block, so 9 of the 10 requests are refused on arrival on both sides
    (kvsim counted two blocks and queued them). Under 0.33 (``"align"`` mode only, not
    modelled) the first step differs, as docs/vllm.md finding 13 says."""
    version, python = vllm_python
    scenario, _ = _fuzzed(tmp_path, seed, run, version)
    if VLLM_LOGIC_OF[version] == "latest":
        out = tmp_path / "diff"
        r = _kvsim(python, "run", str(scenario), "--decisions", "differential", "--out", str(out), "-q",
                   cwd=tmp_path)
        assert "Traceback" not in r.stderr
        first = json.loads((out / "divergence.json").read_text())["first"]
        assert first["step"] == 0, first
        return
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["end"] == "ok"
    assert summary["requests"]["rejected"] == (9 if run == 70 else 0)



@pytest.mark.parametrize(("seed", "run"), [(7, 5), (8, 59), (9, 41), (9, 46)])
def test_fuzzed_eagle_runs_agree_with_every_release(vllm_python: tuple[str, Path], tmp_path: Path,
                                                     seed: int, run: int) -> None:
    """Layouts with an EAGLE group, from the run fuzzer's generator: 0 divergences with every
    release. vLLM drops the last block an EAGLE group's lookup matches (letting a hybrid
    lookup first match one block past the candidate), and looks up groups of one spec as
    one (docs/vllm.md finding 22); kvsim's hit used to be one block longer. Seed 7 run 5:
    two full-attention groups of 4-token blocks, one EAGLE; seed 8 run 59: one EAGLE group
    (the unitary lookup); seed 9 run 41: an EAGLE sliding window; seed 9 run 46: two full
    groups of one block size and different shapes, one EAGLE."""
    version, python = vllm_python
    scenario, data = _fuzzed(tmp_path, seed, run, version)
    assert any(g.get("eagle") for g in data["model"]["groups"])
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    diff = summary["differential"]
    assert diff["divergences"] == 0 and not diff["known"] and diff["decisions"] > 200, diff
    assert summary["end"] == "ok"


def test_an_eagle_chunked_local_group_crashes_alike(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    """Seed 9 run 44 of the run fuzzer (an EAGLE chunked-local group, prefix caching on): vLLM's
    chunked-local finder refuses to drop an EAGLE block and asserts at the first lookup, in
    every release; kvsim's model records the same crash at the same step."""
    version, python = vllm_python
    scenario, data = _fuzzed(tmp_path, 9, 44, version)
    assert any(g.get("eagle") and g["kind"] == "chunked_local" for g in data["model"]["groups"])
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    assert summary["differential"]["divergences"] == 0, summary["differential"]
    assert summary["end"] == "stopped_on_crash" and summary["crashes"]["kinds"] == {"assertion": 1}


@pytest.mark.parametrize(("seed", "run"), [(7, 14), (7, 30), (9, 12), (9, 26), (9, 35), (12, 40)])
def test_fuzzed_window_runs_agree_with_every_release(vllm_python: tuple[str, Path], tmp_path: Path,
                                                            seed: int, run: int) -> None:
    """Sliding-window store masks, from the run fuzzer's generator: 0 divergences with every
    release. Seed 7 runs 14 and 30 (a chunked-local and a sliding-window group, no full
    attention): 0.30 and 0.33 judge the window's store mask on the largest chunk when no
    full-attention group sets the grid (docs/vllm.md finding 24). Seed 9 runs 12 and 26: at a
    finished request's last store 0.30 and 0.33 look again at the window's final partial
    segment and store a chunk the decode frontier skipped (finding 25). Seed 9 run 35 and seed
    12 run 40 have a sliding window of one token, whose local hit vLLM ends on a cached block
    (finding 27: kvsim hit the whole prompt)."""
    version, python = vllm_python
    scenario, _ = _fuzzed(tmp_path, seed, run, version)
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    diff = summary["differential"]
    assert diff["divergences"] == 0 and not diff["known"] and diff["decisions"] > 150, diff
    assert summary["end"] == "ok"


@pytest.mark.parametrize(("seed", "run"), [(8, 13), (9, 9), (14, 10)])
def test_a_step_that_only_submits_stores_is_no_work(vllm_python: tuple[str, Path], tmp_path: Path,
                                                     seed: int, run: int) -> None:
    """After a finished request's last store, with nothing running, vLLM's worker submits
    that store at the next step; kvsim's vLLM engine counted the submission as work and took
    yet another step at once, kvsim's engine waited for an event (docs/vllm.md finding 26).
    Seed 8 run 13 (one EAGLE group, no prefix caching) diverged so under 0.33.0, seed 9 run 9
    (an EAGLE group beside a sliding window) under 0.29.0 and 0.30.0. Now they agree, up to
    where vLLM hangs: under 0.30.0 seed 9 run 9, and under 0.29.0 and 0.30.0 seed 14 run 10
    (one full-attention group, a 97-block pool, no prefix caching), reach a state vLLM
    never leaves (requests hold GPU blocks while waiting to load, nothing runs: vLLM alone
    runs to the time limit), which kvsim's deadlock breaker ends; the lockstep names that
    step (a ``deadlock_break`` divergence, finding 28)."""
    version, python = vllm_python
    scenario, _ = _fuzzed(tmp_path, seed, run, version, max_sim_time_s=120.0)
    if (seed, run, version) in ((9, 9, "0.30.0"), (14, 10, "0.29.0"), (14, 10, "0.30.0")):
        out = tmp_path / "diff"
        r = _kvsim(python, "run", str(scenario), "--decisions", "differential", "--out", str(out),
                   cwd=tmp_path)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]   # 1: diverged
        assert "deadlock_break: kvsim 'broke a deadlock" in r.stdout, r.stdout[-2000:]
        diff = json.loads((out / "summary.json").read_text())["differential"]
        first = diff["first"]
        assert first["what"] == "deadlock_break" and first["step"] > 150, first
        assert first["vllm"].startswith("waits (no breaker"), first
        return
    _, summary, _ = _lockstep(python, scenario, tmp_path)
    diff = summary["differential"]
    assert diff["divergences"] == 0 and not diff["known"] and diff["decisions"] > 900, diff
    assert summary["end"] == "ok"
