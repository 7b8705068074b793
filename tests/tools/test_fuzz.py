"""`kvsim fuzz`: the decision fuzzer (fast path, conditions, shrinking, library
entries), the whole-run fuzzer (injected bugs are found, correct runs are
clean) and the parallel `kvsim regress`."""

from __future__ import annotations

import dataclasses
import random
import shutil
import tomllib
from pathlib import Path

import pytest

from sim.cli import main
from sim.io.check import CheckCase, load_check_file, parse_check, run_check
from sim.model.decision import decide, decision_layout
from sim.tools import fuzz
from sim.tools.fuzz import (
    Condition,
    condition_of,
    fast_outcomes,
    fuzz_decisions,
    fuzz_runs,
    reference_outcomes,
    scenario_at,
    shrink,
)
from sim.tools.regress import run_library

ROOT = Path(__file__).resolve().parents[2]
CRASH = ROOT / "scenarios" / "crash"
UNALIGNED_OLD = {"crash:missing_chunk", "crash:chunk_not_ready", "hit+double_load"}


def library() -> list[CheckCase]:
    out = []
    for path in sorted(CRASH.rglob("*.toml")):
        _, items = load_check_file(path)
        out.append(parse_check(items[0], str(path)).case())
    return out


# -- the fast path ------------------------------------------------------------------------


def test_fast_path_equals_run_check_on_random_scenarios():
    n = 2500
    for i in range(n):
        fs = scenario_at(7, i)
        assert fast_outcomes(fs) == reference_outcomes(fs), (i, fs)


def test_fast_path_equals_run_check_on_the_library_and_on_shrink_candidates():
    cases = library()
    assert len(cases) >= 30
    rng = random.Random(3)
    for fs in cases:
        assert fast_outcomes(fs) == reference_outcomes(fs), fs
        # the shrinker's odd variants (tph 1, split chunks, kinds turned into FA, ...)
        cands = [c for c in fuzz._candidates(fs) if c.valid()]
        for c in rng.sample(cands, min(12, len(cands))):
            assert fast_outcomes(c) == reference_outcomes(c), c


def test_cross_check_catches_a_diverging_fast_path(monkeypatch):
    real = fuzz.decide

    def wrong(*args, **kwargs):  # the load starts one block later in every group
        outs = real(*args, **kwargs)
        for o in outs.values():
            o["block_indices"] = [b + 1 for b in o["block_indices"]]
        return outs

    monkeypatch.setattr(fuzz, "decide", wrong)
    rep = fuzz_decisions(600, 1, jobs=1, verify_every=1)
    assert rep.divergences
    assert all("reference_check" in d for _, d in rep.divergences)


def test_fast_outcomes_is_the_kernel():
    """fast_outcomes, run_check and kvsim check decide with one kernel (sim.model.decision)."""
    fs = scenario_at(7, 3)
    dl = decision_layout(fs.groups, fs.tokens_per_hash, fs.blocks_per_chunk)
    want = decide(dl, fs.states, fs.num_tokens, fs.gpu_computed_tokens, fs.prefix_caching)
    assert fast_outcomes(fs) == fast_outcomes(fs, ("old", "new"), dl) == want
    assert {lg: run_check(fs, lg) for lg in ("old", "new")} == want
    assert not hasattr(fuzz, "_allocate") and not hasattr(fuzz, "_StateTable")


# -- generation, determinism ----------------------------------------------------------------


def test_scenarios_are_valid_and_deterministic():
    for i in range(500):
        fs = scenario_at(11, i)
        assert fs == scenario_at(11, i)
        assert fs.valid(), fs
        fs.to_scenario()  # check/1 accepts it
    assert scenario_at(11, 0) != scenario_at(12, 0)


@pytest.mark.slow
def test_search_is_deterministic_and_independent_of_jobs():
    a = fuzz_decisions(5000, 3, jobs=1, verify_every=0)
    b = fuzz_decisions(5000, 3, jobs=2, verify_every=0)
    assert a.scanned == b.scanned == 5000
    assert a.findings == b.findings > 0
    sig = [(c.condition, c.first_index, c.count, c.shrunk) for c in a.conditions]
    assert sig == [(c.condition, c.first_index, c.count, c.shrunk) for c in b.conditions]


# -- classification, dedupe, shrinking ----------------------------------------------------------


def test_classes_and_conditions_of_the_spec_cases():
    fs = parse_check(
        tomllib.loads((CRASH / "s6-b3904-left-missing.toml").read_text()), "s6").case()
    cond = condition_of(fs, fast_outcomes(fs))
    assert cond == Condition("old", "crash:missing_chunk", "new", "zero", "", "sliding_window", True)
    assert cond.words() == "unaligned sliding-window hit: OLD crash missing_chunk, NEW 0"
    same = parse_check(
        tomllib.loads((CRASH / "s6-b3840-left-missing.toml").read_text()), "s6").case()
    assert condition_of(same, fast_outcomes(same)) is None  # both load 3840: not a finding


def test_shrinking_keeps_the_condition_and_reduces_the_case():
    fs = parse_check(
        tomllib.loads((CRASH / "s6-b3904-left-pending-eagle.toml").read_text()), "s6").case()
    cond = condition_of(fs, fast_outcomes(fs))
    assert cond is not None and cond.a == "crash:chunk_not_ready" and cond.b == "defer"
    small, evals = shrink(fs, cond)
    assert evals > 0
    assert condition_of(small, reference_outcomes(small)) == cond  # the reference path agrees
    assert small.size() < fs.size()
    assert small.num_tokens < fs.num_tokens / 4
    assert len(small.states) < len(fs.states)
    # a shrunk case is (locally) minimal: shrinking it again changes nothing
    assert shrink(small, cond)[0] == small


@pytest.mark.slow
def test_findings_are_deduplicated_by_condition_and_written_once(tmp_path: Path):
    out = tmp_path / "fuzz"
    rep = fuzz_decisions(3000, 5, out=out, jobs=1)
    conds = [c.condition for c in rep.conditions]
    assert len(conds) == len(set(conds)) > 3
    assert sum(c.count for c in rep.conditions) == rep.findings
    files = sorted(out.glob("*.toml"))
    assert len(files) == len(conds) == sum(c.status == "written" for c in rep.conditions)
    assert len({c.condition.slug() for c in rep.conditions}) == len(conds)
    # every entry reproduces its observed outcomes (check and regress pass)
    results = run_library(out, jobs=1)
    assert all(r.ok for r in results), [r.mismatches for r in results if not r.ok]
    # a second search with the same seed writes nothing new
    again = fuzz_decisions(3000, 5, out=out, jobs=1)
    assert {c.status for c in again.conditions} == {"unchanged"}
    # a different existing file of a condition is never overwritten
    victim = files[0]
    victim.write_text(victim.read_text() + "# edited\n")
    other = fuzz_decisions(3000, 5, out=out, jobs=1)
    kept = [c for c in other.conditions if c.path == victim]
    assert kept and kept[0].status == "kept existing"
    assert victim.read_text().endswith("# edited\n")


def test_simulator_exceptions_are_findings(tmp_path: Path, monkeypatch):
    from sim.model import decision

    real = decision._plan

    def broken(dl, *args):  # a kernel bug on three-group layouts, after the lookup
        if dl.ng == 3:
            raise KeyError("injected")
        return real(dl, *args)

    monkeypatch.setattr(decision, "_plan", broken)
    rep = fuzz_decisions(800, 2, out=tmp_path, jobs=1, verify_every=0)
    bugs = rep.simulator_bugs
    assert bugs and bugs[0].condition.a == "error:KeyError"
    assert bugs[0].path is not None and bugs[0].path.suffix == ".json"
    assert not list(tmp_path.glob("*error*.toml"))  # not a library entry


# -- acceptance: seed 1 rediscovers the unaligned-hit class (spec §6) ---------------------------


@pytest.mark.slow
def test_seed_1_rediscovers_the_unaligned_hit_class(tmp_path: Path, capsys):
    out = tmp_path / "fuzz"
    code = main(["fuzz", "--budget", "8192", "--seed", "1", "--out", str(out), "--jobs", "2", "-q"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "scenarios/s wall" in text
    found = []
    for path in sorted(out.glob("*.toml")):
        head = path.read_text().splitlines()[2]
        assert head.startswith("# fuzz key: ")
        key = dict(kv.split("=", 1) for kv in head[len("# fuzz key: "):].split())
        if (key["kind"] == "sliding_window" and key["unaligned"] == "1" and key["a"] in UNALIGNED_OLD
                and (key["b"] in ("zero", "defer") or (key["b"] == "hit" and key["relation"] == "smaller"))):
            found.append(path)
    assert found, sorted(p.name for p in out.glob("*.toml"))
    assert (out / "old-crash-missing_chunk--new-zero--swa-unaligned.toml") in found
    for path in found:
        assert main(["check", str(path)]) == 0
        data = tomllib.loads(path.read_text())
        assert data["window_logic"] == "both" and {"old", "new"} <= set(data["expect"])
    assert main(["regress", str(out)]) == 0


# -- the whole-run fuzzer ------------------------------------------------------------------------


def test_run_fuzzer_is_clean_on_correct_code():
    # seed 7: 4 preemptions and 12 load jobs under NEW in its first 24 runs (seed 4's one
    # preemption came from a one-token window's whole-prompt hit, gone with finding 27)
    rep = fuzz_runs(24, 7, jobs=2)
    assert rep.findings == [], [(f.kind, f.logic, f.index, f.detail) for f in rep.findings]
    # and it exercised what it is meant to: preemptions, CPU loads, full CPU caches
    assert rep.coverage["new:preemptions"] and rep.coverage["new:load_jobs"]
    assert rep.coverage["new:store_rejections"]


def test_run_fuzzer_finds_an_injected_block_leak(tmp_path: Path, monkeypatch, capsys):
    from sim.model.gpu_cache import GpuKVCache
    from sim.model.scheduler import GPU_CACHES

    real = GpuKVCache.free

    def leaky(self, req_id):   # the last block of group 0 is never released
        blocks = self.req_blocks[req_id][0]
        if blocks and blocks[-1].block_id:
            blocks.pop()
        real(self, req_id)

    monkeypatch.setattr(GpuKVCache, "free", leaky)
    # every run uses the (leaky) reference accounting, whatever scheduler.block_accounting says
    monkeypatch.setitem(GPU_CACHES, "fast", GpuKVCache)
    rep = fuzz_runs(3, 4, out=tmp_path, jobs=1)
    kinds = {(f.kind, f.logic) for f in rep.findings}
    assert ("invariant", "old") in kinds and ("invariant", "new") in kinds
    f = next(f for f in rep.findings if f.kind == "invariant")
    assert "GPU blocks still referenced" in f.detail
    assert f.path is not None and f.path.is_file()
    # the written run/1 file replays the failure with `kvsim run` (exit 1)
    assert main(["run", str(f.path), "--out", str(tmp_path / "replay"), "-q"]) == 1
    capsys.readouterr()


def test_run_fuzzer_finds_a_skipped_store_copy(tmp_path: Path, monkeypatch):
    pytest.importorskip("torch")
    from sim.engine.copypath import CopyPath

    monkeypatch.setattr(CopyPath, "store", lambda self, *a, **k: 0.0)
    rep = fuzz_runs(8, 4, copy_path=True, out=tmp_path, jobs=1)
    hits = [f for f in rep.findings if f.kind == "integrity"]
    assert hits and {f.logic for f in hits} == {"new"}
    assert hits[0].data["copy_path"]["enabled"] is True


def test_run_fuzzer_is_clean_with_the_copy_path():
    pytest.importorskip("torch")
    rep = fuzz_runs(8, 4, copy_path=True, jobs=1)
    assert rep.findings == []
    assert rep.coverage["new:load_jobs"]


@pytest.mark.parametrize(("seed", "run"), [(5, 3), (3, 2), (1, 6)])
def test_fixed_engine_livelock_of_preempted_loaded_requests(seed: int, run: int):
    """Regression (found by `kvsim fuzz --runs 40 --seed 5`): the deadlock
    breaker no longer preempts a request whose load is in flight or was just
    issued, so loaded requests are not reloaded and preempted forever."""
    data = fuzz.run_config(fuzz._rng_for(seed, run))
    data["output"]["max_sim_time_s"] = 20.0
    for logic in ("new", "old"):
        assert fuzz._check_run(data, logic, False)[0] is None


@pytest.mark.parametrize("logic", ["old", "new", "latest"])
def test_no_room_while_a_load_is_in_flight_stops_admission_as_vllm_does(logic: str):
    """Regression (found by `kvsim fuzz --runs 600 --seed 5`, run 523, and by the
    differential mode against vLLM 0.30.0): with nothing running and a load in flight, a
    waiting request that does not fit used to be skipped and the next one looked up; vLLM
    stops admitting (``allocate_slots`` returned None: ``break``). Skipping let two loaded
    requests take turns preempting each other: 12,977 preemptions and 13,007 loads in an
    hour of simulated time, 30 of 32 requests done. Now only the head is looked up at
    that step (t = 0.275766 s: s1t0, not s0t3 behind it) and the run ends."""
    from sim.engine.loop import Engine
    from sim.engine.metrics import MemorySink, Recorder
    from sim.io.scenario import build_run

    data = {**fuzz.run_config(fuzz._rng_for(5, 523)), "window_logic": logic}
    spec = build_run(data, Path("fuzz-s5-i523.toml"))
    engine = Engine(spec.engine_config(), spec.requests(), Recorder(MemorySink()), None)
    engine.sched.lookup_log = []
    looked_up: dict[float, list[str]] = {}

    def on_schedule(plan: object) -> None:
        looked_up[round(engine.env.now, 6)] = [rid for rid, *_ in engine.sched.lookup_log]
        engine.sched.lookup_log.clear()

    engine.on_schedule = on_schedule
    res = engine.run()
    assert looked_up[0.275766] == ["s1t0"]
    assert res.status == "ok"
    assert res.summary.requests_finished == res.summary.requests_arrived == 32
    assert res.summary.preemptions < 10


@pytest.mark.parametrize("logic", ["old", "new", "latest"])
def test_requests_longer_than_max_model_len_are_rejected_on_arrival(logic: str):
    """Regression (seed 6 run 594 of the run fuzzer's generator, found under LATEST): a
    270-block pool holds requests of at most ``max_model_len`` = 496 tokens; vLLM refuses
    longer ones when they arrive. kvsim's model queued them and rejected one only once
    nothing else ran; under 0.33's logic (a skipped request goes back to the head of the
    queue) the run thrashed for the whole simulated hour (41,154 preemptions, 8 of 41
    requests done). Now each is rejected at the time it reaches the scheduler, and the run
    ends in seconds in every logic (tests/tools/test_vllm_mode.py runs it against vLLM)."""
    from sim.engine.loop import Engine
    from sim.engine.metrics import MemorySink, Recorder
    from sim.io.scenario import build_run
    from sim.model.scheduler import max_model_len

    data = {**fuzz.run_config(fuzz._rng_for(6, 594)), "window_logic": logic}
    spec = build_run(data, Path("fuzz-s6-i594.toml"))
    cfg = spec.engine_config()
    limit = max_model_len(cfg.layout, cfg.gpu_blocks, cfg.max_num_batched_tokens,
                          prefix_caching=cfg.prefix_caching)
    assert limit == 496
    sink = MemorySink()
    res = Engine(cfg, spec.requests(), Recorder(sink), None).run()
    assert res.status == "ok" and res.summary.sim_time_s < 10 and res.summary.preemptions < 10
    frames = sink.frames()
    req = frames["requests"].set_index("req_id")
    total = {r.req_id: r.prompt_tokens + r.output_tokens for r in spec.requests()}   # output asked for
    long = req.index.map(total) > limit
    assert (req.status[long] == "rejected").all() and (req.status[~long] == "finished").all()
    assert long.sum() == res.summary.requests_rejected == 29
    assert req.scheduled_s[long].isna().all() and (req.finish_s[long] >= req.arrival_s[long]).all()
    ev = frames["events"]
    assert list(ev.detail) == ["too_long"] * 29
    assert dict(zip(ev.req_id, ev.t_s, strict=True)) == req.finish_s[long].to_dict()


def test_a_step_that_only_releases_finished_requests_is_followed_by_no_step_at_once():
    """Regression (seed 5 run 523, against vLLM 0.29.0, 0.30.0 and 0.33.0 in lockstep): the
    step after s4t0's last decode (t = 1.948147 s) only released it (nothing to store, a
    load still on its way); kvsim's engine counted that as work and took another step at
    the same time, repeating that step's lookup, where vLLM's next step came when the load
    completed (2.152972 s). Now one step runs at 1.948147 s."""
    from sim.engine.loop import Engine
    from sim.engine.metrics import MemorySink, Recorder
    from sim.io.scenario import build_run

    data = {**fuzz.run_config(fuzz._rng_for(5, 523)), "window_logic": "new"}
    data["scheduler"]["fast_forward"] = False
    spec = build_run(data, Path("fuzz-s5-i523.toml"))
    engine = Engine(spec.engine_config(), spec.requests(), Recorder(MemorySink()), None)
    times: list[float] = []
    engine.on_schedule = lambda plan: times.append(round(engine.env.now, 6))
    engine.run()
    assert times.count(1.948147) == 1
    after = times[times.index(1.948147) + 1:]
    assert after[:2] == [2.152972, 2.152972]   # the load's completion is polled, then s2t1 admitted


def test_a_hit_on_a_mamba_block_committed_in_the_same_step_waits():
    """Regression (seed 7 run 22 of the run fuzzer's generator, in lockstep with vLLM 0.29.0
    and 0.30.0: full attention, a 2-token sliding window and a Mamba group, prefix caching
    on). At t = 1.57858 s s9t0's last prefill chunk commits its Mamba state block at 448
    tokens and s9t1, its next turn, finds a 448-token local hit ending on that block. vLLM's
    Mamba manager refuses to build on a state block cached in the same step (it asks for
    more blocks than the pool has), so s9t1 is not admitted and admission stops; kvsim
    admitted it with the 3 tokens of budget left. Now it waits for the next step."""
    from sim.engine.loop import Engine
    from sim.engine.metrics import MemorySink, Recorder
    from sim.io.scenario import build_run

    data = {**fuzz.run_config(fuzz._rng_for(7, 22)), "window_logic": "new"}
    data["scheduler"]["fast_forward"] = False
    spec = build_run(data, Path("fuzz-s7-i22.toml"))
    engine = Engine(spec.engine_config(), spec.requests(), Recorder(MemorySink()), None)
    engine.sched.lookup_log = []
    seen: dict[float, tuple[list, list]] = {}

    def on_schedule(plan) -> None:
        seen[round(engine.env.now, 6)] = (list(engine.sched.lookup_log),
                                          [(r.req_id, n) for r, n, _ in plan.scheduled])
        engine.sched.lookup_log.clear()

    engine.on_schedule = on_schedule
    res = engine.run()
    lookups, batch = seen[1.57858]
    assert ("s9t1", 448, 0, False) in lookups and ("s9t0", 25) in batch
    assert "s9t1" not in [rid for rid, _ in batch]
    assert res.status == "ok" and res.summary.requests_finished == 18


# -- parallel regress ----------------------------------------------------------------------------


def test_parallel_regress_equals_sequential_and_recurses(tmp_path: Path):
    lib = tmp_path / "lib"
    shutil.copytree(CRASH, lib)
    fuzz_decisions(1500, 1, out=lib / "fuzz", jobs=1)
    nested = sorted((lib / "fuzz").glob("*.toml"))
    assert nested
    broken = lib / "fuzz" / "zz-broken.toml"
    broken.write_text(nested[0].read_text().replace('crash = "', 'crash = "x', 1))
    seq = run_library(lib, jobs=1)
    par = run_library(lib, jobs=2)
    assert [r.path for r in seq] == [r.path for r in par] == sorted(lib.rglob("*.toml"))
    for a, b in zip(seq, par, strict=True):
        assert (a.outcomes, a.mismatches, a.error) == (b.outcomes, b.mismatches, b.error)
    assert sum(not r.ok for r in par) == 1


def test_regress_jobs_option_keeps_table_and_exit_codes(tmp_path: Path, capsys):
    assert main(["regress", str(CRASH), "--jobs", "1"]) == 0
    one = capsys.readouterr().out
    assert main(["regress", str(CRASH), "--jobs", "2"]) == 0
    assert capsys.readouterr().out == one
    assert main(["regress", str(CRASH), "--jobs", "0"]) == 2


def test_fuzz_cli_rejects_bad_arguments(capsys):
    assert main(["fuzz", "--budget", "10", "--logic-pair", "old,newest"]) == 2
    assert main(["fuzz", "--budget", "10", "--logic-pair", "new,new"]) == 2      # nothing to compare
    assert main(["fuzz", "--budget", "10", "--verify-every", "-1"]) == 2
    assert main(["fuzz", "--budget", "0"]) == 2
    assert main(["fuzz", "--runs", "1", "--jobs", "0"]) == 2
    capsys.readouterr()
    # an option of the other mode is refused, not ignored
    for args in (["--budget", "10", "--copy-path"], ["--runs", "1", "--logic-pair", "old,new"],
                 ["--runs", "1", "--verify-every", "0"]):
        assert main(["fuzz", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "has no effect with" in err[0], (args, err)


def test_condition_names_are_words_and_slugs_are_file_names():
    c = Condition("old", "hit+double_load", "new", "defer", "", "chunked_local", True, True, False, True)
    assert c.words() == ("unaligned chunked-local hit (EAGLE, attention chunk not a multiple of the chunk): "
                         "OLD a hit with double_load, NEW None (deferred)")
    assert c.slug() == "old-hit-double_load--new-defer--cla-unaligned-eagle-misfit"
    d = dataclasses.replace(c, a="crash:missing_chunk", b="hit", relation="smaller", kind="")
    assert "NEW a smaller hit" in d.words()
    assert d.slug().startswith("old-crash-missing_chunk--new-hit-smaller")
