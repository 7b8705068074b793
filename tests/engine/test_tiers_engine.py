"""Secondary tiers in the engine: a promotion defers the lookup (timeline), a GPU
load never reads a secondary tier, every invariant holds at the end, and a run
without tiers has no tier figures at all."""

from __future__ import annotations

import math
from array import array
from pathlib import Path

import pytest

from sim.engine.links import TierLinkModel
from sim.engine.loop import EngineConfig, simulate
from sim.engine.metrics import MemorySink, Recorder
from sim.errors import InputError
from sim.io.scenario import load_run
from sim.model.costs import TransferModel
from sim.model.cpu_cache import EvictionPolicy
from sim.model.layout import GroupKind, GroupSpec, Layout
from sim.model.request import Request
from sim.model.tiers import TierSpec

LAYOUT = Layout.of([GroupSpec(GroupKind.FULL, 16)], tokens_per_hash=16)


def req(rid: str, t: float, h1: int, h2: int) -> Request:
    # 33 prompt tokens: two complete 16-token chunks and one token always computed
    return Request(rid, t, 33, 1, array("q", [h1, h2]), tokens_per_hash=16)


def engine_cfg(latency_s: float = 1.0, **kw: object) -> EngineConfig:
    slow = TransferModel(math.inf, latency_s)
    return EngineConfig(layout=LAYOUT, gpu_blocks=64, prefix_caching=False, cpu_capacity_chunks=2,
                        tiers=(TierSpec("nvme"),), tier_links=(TierLinkModel(slow, slow),),
                        tier_chunk_bytes=1000, **kw)  # type: ignore[arg-type]


def run(cfg: EngineConfig, reqs: list[Request]) -> tuple[dict, MemorySink]:
    sink = MemorySink()
    res = simulate(cfg, reqs, Recorder(sink))
    assert res.status == "ok"            # end-of-run invariants held (tiers included)
    return res.summary.figures(), sink


def test_a_promotion_defers_the_lookup_and_the_gpu_load_reads_the_cpu_tier_after_it() -> None:
    # r0 stores A, B (cascaded to the tier); r1 stores C, D, evicting A, B from the
    # 2-chunk CPU tier; r2 asks for A, B again: promoted from the tier first.
    figs, sink = run(engine_cfg(), [req("r0", 0.0, 1, 2), req("r1", 2.0, 3, 4), req("r2", 4.0, 1, 2)])
    x = sink.frames()["transfers"]
    timeline = sorted(zip(x.direction, x.req_id, x.chunks, x.submit_s, x.end_s, strict=True),
                      key=lambda row: (row[3], row[4], row[0]))
    assert timeline == [
        ("d2h", "r0", 2, 0.0, 0.0),
        ("1:nvme:write", "", 2, 0.0, 1.0),       # cascade of A, B (1 s per tier job)
        ("d2h", "r1", 2, 2.0, 2.0),
        ("1:nvme:write", "", 2, 2.0, 3.0),       # cascade of C, D
        ("1:nvme:read", "", 2, 4.0, 5.0),        # promotion of A, B: r2's lookup deferred
        ("h2d", "r2", 2, 5.0, 5.0),              # the GPU load, from the CPU tier, after it
    ]
    r = sink.frames()["requests"].set_index("req_id")
    r2 = r.loc["r2"]
    assert r2.deferrals >= 1 and r2.deferrals_pending_or_retry >= 1 and r2.deferred_s == 1.0
    assert r.loc["r2"].cpu_hit_tokens == 32 and r.loc["r2"].first_token_s == 5.0
    assert r.loc["r0"].cpu_hit_tokens == 0 and r.loc["r1"].cpu_hit_tokens == 0
    assert figs["crashes"]["count"] == 0
    t = figs["tiers"]["secondary"][0]
    assert (t["promotion_jobs"], t["cascade_jobs"], t["promoted_chunks_loaded"]) == (1, 2, 2)
    assert (t["read_bytes"], t["write_bytes"]) == (2000, 4000)
    # asked of the tier: A by r0 and C by r1 (misses: a prefix lookup stops there), A and B by r2
    assert (t["chunk_queries"], t["chunk_hits"]) == (4, 2)
    # of the CPU tier: the same four, all misses (r2's later hits were resolved already, as in vLLM)
    primary = figs["tiers"]["primary"]
    assert {k: primary[k] for k in ("label", "chunk_queries", "chunk_hits")} == {
        "label": "0:primary", "chunk_queries": 4, "chunk_hits": 0}
    # r2's 32 hit tokens came through the promotion: all the tier's, none resident
    assert (t["promoted_hit_tokens"], primary["resident_hit_tokens"]) == (32.0, 0.0)
    assert t["promoted_hit_rate"] + primary["resident_hit_rate"] == pytest.approx(figs["cpu_hit_rate"])


def test_the_tiers_table_samples_each_tier_with_the_occupancy_table() -> None:
    cfg = engine_cfg(occupancy_interval_s=0.5)
    figs, sink = run(cfg, [req("r0", 0.0, 1, 2), req("r1", 2.0, 3, 4), req("r2", 4.0, 1, 2)])
    frames = sink.frames()
    tiers, occ = frames["tiers"], frames["occupancy"]
    assert list(tiers.t_s) == list(occ.t_s) and set(tiers.tier) == {"1:nvme"}   # one tier, every sample
    assert (tiers.chunks_used == tiers.chunks_ready + tiers.chunks_pending_write + tiers.chunks_reading).all()
    assert tiers.capacity_chunks.isna().all()           # an unbounded tier
    states = {t: (r.chunks_ready, r.chunks_pending_write, r.chunks_reading)
              for t, r in tiers.drop_duplicates("t_s").set_index("t_s").iterrows()}
    assert states[0.0] == (0, 0, 0)
    assert states[0.5] == (0, 2, 0)                     # A, B being written (the 1-s cascade)
    assert states[1.0] == (2, 0, 0)                     # written
    assert states[2.5] == (2, 2, 0)                     # C, D being written
    assert states[4.5] == (2, 0, 2)                     # A, B being promoted for r2
    assert states[5.0] == (4, 0, 0)
    occ_figs = figs["tiers"]["secondary"][0]["occupancy_chunks"]
    assert occ_figs["peak"] == tiers.chunks_used.max() and occ_figs["end"] == tiers.chunks_used.iloc[-1]


def test_a_run_without_tiers_has_an_empty_tiers_table() -> None:
    _, sink = run(EngineConfig(layout=LAYOUT, gpu_blocks=64, prefix_caching=False, cpu_capacity_chunks=2),
                  [req("r0", 0.0, 1, 2)])
    assert sink.tables["tiers"]["t_s"] == []


def test_without_a_promotion_delay_the_hit_is_the_same_but_sooner() -> None:
    _, sink = run(engine_cfg(latency_s=0.0), [req("r0", 0.0, 1, 2), req("r1", 2.0, 3, 4),
                                              req("r2", 4.0, 1, 2)])
    r = sink.frames()["requests"].set_index("req_id")
    assert r.loc["r2"].cpu_hit_tokens == 32 and r.loc["r2"].first_token_s == 4.0


def test_a_tier_never_read_back_changes_nothing_but_bytes_written() -> None:
    reqs = [req("r0", 0.0, 1, 2), req("r1", 2.0, 3, 4), req("r2", 4.0, 5, 6)]
    tiered, _ = run(engine_cfg(), reqs)
    plain, _ = run(EngineConfig(layout=LAYOUT, gpu_blocks=64, prefix_caching=False, cpu_capacity_chunks=2),
                   reqs)
    tiers = tiered.pop("tiers")
    t = tiers["secondary"][0]
    assert t["label"] == "1:nvme" and t["write_bytes"] == 6000 and t["read_bytes"] == 0
    assert "tiers" not in plain
    for key in ("tokens", "cpu_hit_rate", "ttft_s", "transfers", "requests"):
        assert tiered[key] == plain[key], key


SCENARIO = """schema = "run/1"
[model]
name = "hybrid-demo"
[hardware]
gpu_kv_bytes = "1GiB"
[cpu_cache]
capacity = "1GiB"
{tiers}
[scheduler]
blocks_per_chunk = 4
[workload]
kind = "uniform"
requests = 12
input_tokens_min = 200
input_tokens_max = 400
output_tokens_min = 4
output_tokens_max = 8
"""

NVME = """[[tiers]]
kind = "nvme"
capacity = "2GiB"
read_bandwidth = "7GB"
write_bandwidth = "6GB"
latency_s = 0.0001
concurrency = 4
policy = "arc"
"""


def test_a_scenario_with_tiers_resolves_and_runs(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers=NVME))
    spec = load_run(f)
    cfg = spec.engine_config()
    assert cfg.tiers == (TierSpec("nvme", 2 * 2**30 // spec.cpu_slot_bytes, EvictionPolicy.ARC),)
    assert cfg.tier_links[0].concurrency == 4 and cfg.tier_links[0].read.bandwidth_bytes_per_s == 7e9
    assert spec.resolved()["tiers"] == [{
        "kind": "nvme", "capacity": 2 * 2**30, "read_bandwidth": 7_000_000_000,
        "write_bandwidth": 6_000_000_000, "latency_s": 0.0001, "concurrency": 4, "policy": "arc"}]
    res = simulate(cfg, spec.requests(), Recorder(MemorySink()))
    assert res.status == "ok" and res.summary.figures()["tiers"]["secondary"][0]["label"] == "1:nvme"


def test_no_tier_no_tier_key(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers=""))
    spec = load_run(f)
    assert "tiers" not in spec.resolved() and spec.engine_config().tiers == ()


@pytest.mark.parametrize(("tiers", "key"), [
    (NVME.replace('kind = "nvme"', 'kind = "tape"'), "tiers.0.kind"),
    (NVME.replace("concurrency = 4", "concurrency = 0"), "tiers.0.concurrency"),
    (NVME.replace('read_bandwidth = "7GB"', 'read_bandwidth = "fast"'), "tiers.0.read_bandwidth"),
    (NVME.replace('write_bandwidth = "6GB"\n', ""), "tiers.0.write_bandwidth"),
    (NVME.replace("latency_s = 0.0001", "latency_s = -1"), "tiers.0.latency_s"),
    (NVME.replace('policy = "arc"', 'policy = "fifo"'), "tiers.0.policy"),
    (NVME.replace('capacity = "2GiB"', 'capacity = "2GiB"\nchunks = 10'), "tiers.0"),
    (NVME + "colour = 1\n", "tiers.0.colour"),
])
def test_bad_tier_input_is_one_line_naming_the_key(tmp_path: Path, tiers: str, key: str) -> None:
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers=tiers))
    with pytest.raises(InputError) as info:
        load_run(f)
    line = str(info.value)
    assert "\n" not in line and key in line, line


def test_tiers_without_offloading_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    text = SCENARIO.format(tiers=NVME).replace("blocks_per_chunk = 4",
                                               "blocks_per_chunk = 4\noffloading = false")
    f.write_text(text)
    with pytest.raises(InputError, match="tiers"):
        load_run(f)


def test_tiers_with_the_copy_path_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers=NVME) + "[copy_path]\nenabled = true\n")
    with pytest.raises(InputError, match="copy path"):
        load_run(f)


def test_a_tier_takes_its_figures_from_a_storage_profile_and_its_own_keys_win(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers='[[tiers]]\ndevice = "pm1743"\ncapacity = "1TiB"\nconcurrency = 2\n'))
    spec = load_run(f)
    [t] = spec.scenario.tiers
    assert (t.kind, t.read_bandwidth, t.write_bandwidth, t.latency_s, t.concurrency) == (
        "nvme", 13_000_000_000, 6_600_000_000, 0.0001, 2)
    link = spec.engine_config().tier_links[0]
    assert link.read.bandwidth_bytes_per_s == 13e9 and link.write.latency_s == 0.0001
    assert link.concurrency == 2
    # the resolved scenario loads back to the same tiers
    again = tmp_path / "again.toml"
    again.write_text(spec.resolved_toml())
    assert load_run(again).engine_config().tiers == spec.engine_config().tiers
    assert load_run(again).engine_config().tier_links == spec.engine_config().tier_links


def test_a_storage_profile_by_path(tmp_path: Path) -> None:
    (tmp_path / "disk.toml").write_text('schema = "storage/1"\nname = "disk"\nkind = "fs"\n'
                                        'read_bandwidth = "1GB"\nwrite_bandwidth = "1GB"\n'
                                        'latency_s = 0.01\nconcurrency = 4\n')
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers='[[tiers]]\ndevice = "disk.toml"\n'))
    [t] = load_run(f).scenario.tiers
    assert (t.kind, t.latency_s, t.capacity, t.chunks) == ("fs", 0.01, None, None)


def test_an_unknown_storage_profile_is_one_line_listing_the_shipped_ones(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(SCENARIO.format(tiers='[[tiers]]\ndevice = "floppy"\n'))
    with pytest.raises(InputError) as info:
        load_run(f)
    line = str(info.value)
    assert "tiers.0.device" in line and "floppy" in line and "pm1743" in line and "\n" not in line
