"""kvsim fidelity: kvsim's model against the installed vLLM, on the same scenario and clock.

What it does
    Runs a scenario on kvsim's engine twice, in memory and in lockstep
    (:class:`sim.tools.differential.Lockstep`): once with kvsim's own model
    deciding (under the window logic that corresponds to the installed vLLM:
    0.29.0 old, 0.30.0 new, 0.33.0 latest) and once with that vLLM deciding
    (:mod:`sim.engine.vllm_engine`). The lockstep compares every step's
    decisions and reports the first divergence (or "0 divergences in N
    decisions"); both runs then go on to their end, and every decision the two
    runs recorded is compared, request by request:

    * per request: its end (finished, rejected, unfinished), the GPU and CPU
      hit tokens, the tokens computed and recomputed, preemptions, deferred
      lookups, load and store jobs and their bytes, the first-token and
      finish times, a crash;
    * per request, each transfer job in submission order: direction, chunks,
      blocks, bytes and submission time;
    * the crash events (kind and request).

    Later divergences may follow from the first (the runs drift apart); they
    are counted, not explained.

Known divergences
    Differences that come from a simplification of kvsim's engine listed in
    the docs before the comparison are counted apart, by kind:

    * ``too_long``: a request longer than what the block pool holds is
      rejected by vLLM on arrival (``max_model_len``); kvsim's model rejects
      it on arrival by the same bound, so only a request its fallback
      rejects later (one within the bound that still does not fit) counts.

Simplifications
    * No check/1 reproducer (``kvsim run --decisions differential`` writes one).
    * When vLLM stops on a crash that kvsim's model makes too, both runs stop
      there (vLLM's state is undefined after its assertion).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.engine.metrics import MemorySink
from sim.errors import InputError
from sim.io.scenario import load_run

__all__ = ["Divergence", "FidelityReport", "fidelity", "format_report"]

#: the requests-table fields compared
REQUEST_FIELDS = ("status", "gpu_hit_tokens", "cpu_hit_tokens", "cpu_reload_tokens", "computed_tokens",
                  "recomputed_tokens", "preemptions", "deferrals", "load_jobs", "store_jobs", "loaded_bytes",
                  "stored_bytes", "output_tokens", "first_token_s", "finish_s", "crash")
#: the transfers-table fields compared (per request, in submission order)
TRANSFER_FIELDS = ("direction", "chunks", "blocks", "bytes", "submit_s")


def _rows(sink: MemorySink, table: str) -> list[dict[str, Any]]:
    """A table of ``sink`` as a list of row dicts."""
    t = sink.tables.get(table, {})
    names = list(t)
    n = len(t[names[0]]) if names else 0
    return [{k: t[k][i] for k in names} for i in range(n)]


@dataclass(frozen=True)
class Divergence:
    """One decision on which the two runs differ."""

    t_s: float
    req_id: str
    what: str
    kvsim: Any
    vllm: Any


@dataclass
class FidelityReport:
    """The comparison of one scenario under kvsim's model and the installed vLLM."""

    scenario: str
    vllm_version: str
    logic: str
    requests: int
    decisions: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    #: divergences explained by a listed simplification, by kind
    known: dict[str, int] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    #: the lockstep's report (:meth:`sim.tools.differential.DifferentialReport.to_dict`)
    lockstep: dict[str, Any] | None = None

    @property
    def first(self) -> Divergence | None:
        return min(self.divergences, key=lambda d: (d.t_s, d.req_id, d.what)) if self.divergences else None

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "vllm_version": self.vllm_version, "logic": self.logic,
                "requests": self.requests, "decisions": self.decisions,
                "divergences": len(self.divergences), "known": dict(self.known), "status": dict(self.status),
                "first": dataclasses.asdict(self.first) if self.first else None,
                "by_field": _by_field(self.divergences), "lockstep": self.lockstep}


def _by_field(divs: Sequence[Divergence]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for d in divs:
        out[d.what.split("[")[0]] += 1
    return dict(sorted(out.items()))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def fidelity(path: Path, overrides: Sequence[str | tuple[str, str]] = ()) -> FidelityReport:
    """Run ``path`` under kvsim's model and under the installed vLLM; compare the decisions.

    Raises:
        InputError: a bad scenario, or vLLM not installed (one line, exit 2).
    """
    from sim.model.real_vllm import INSTALL_HINT, SUPPORTED_VERSIONS, VllmMissingError, installed_version  # noqa: PLC0415

    try:
        version = installed_version()
    except VllmMissingError:
        raise InputError(str(path), "decisions", "kvsim fidelity needs vLLM, which is not installed in this "
                         "Python environment", INSTALL_HINT.split(": ", 1)[1]) from None
    logic = SUPPORTED_VERSIONS.get(version, "latest")
    spec = load_run(path, [*overrides, ("fidelity", f"window_logic={logic}"), ("fidelity", "decisions=vllm")])
    from sim.tools.differential import Lockstep, WatchingRecorder  # noqa: PLC0415 -- imports vLLM

    model, real = MemorySink(), MemorySink()
    lock = Lockstep(spec.engine_config(), spec.requests, WatchingRecorder(model), WatchingRecorder(real),
                    stop_at_first=False)
    res_model, res_real, lockstep = lock.run()
    report = FidelityReport(str(path), version, logic, 0,
                            status={"kvsim": res_model.status, "vllm": res_real.status},
                            lockstep=lockstep.to_dict())
    _compare(model, real, report)
    return report


def _compare(model: MemorySink, real: MemorySink, report: FidelityReport) -> None:
    mreq = {r["req_id"]: r for r in _rows(model, "requests")}
    vreq = {r["req_id"]: r for r in _rows(real, "requests")}
    report.requests = len(set(mreq) | set(vreq))
    mx: dict[str, list[dict[str, Any]]] = defaultdict(list)
    vx: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for table, rows in ((mx, _rows(model, "transfers")), (vx, _rows(real, "transfers"))):
        for row in sorted(rows, key=lambda r: (r["submit_s"], r["job_id"])):
            table[row["req_id"]].append(row)
    for req_id in sorted(set(mreq) | set(vreq)):
        m, v = mreq.get(req_id), vreq.get(req_id)
        if m is None or v is None:
            report.decisions += 1
            t = (m or v or {}).get("arrival_s", 0.0)
            report.divergences.append(Divergence(t, req_id, "present", m is not None, v is not None))
            continue
        if "rejected" in (m["status"], v["status"]):
            report.known["too_long"] = report.known.get("too_long", 0) + 1
            continue
        t0 = min(x for x in (m["scheduled_s"], v["scheduled_s"], m["arrival_s"]) if x is not None)
        for f in REQUEST_FIELDS:
            report.decisions += 1
            if not _same(m[f], v[f]):
                report.divergences.append(Divergence(t0, req_id, f, m[f], v[f]))
        ms, vs = mx.get(req_id, []), vx.get(req_id, [])
        for i in range(max(len(ms), len(vs))):
            a = ms[i] if i < len(ms) else None
            b = vs[i] if i < len(vs) else None
            report.decisions += 1
            if a is None or b is None:
                t = (a or b or {}).get("submit_s", t0)
                report.divergences.append(Divergence(t, req_id, f"transfer[{i}]", _job(a), _job(b)))
            elif any(not _same(a[f], b[f]) for f in TRANSFER_FIELDS):
                report.divergences.append(Divergence(min(a["submit_s"], b["submit_s"]), req_id,
                                                     f"transfer[{i}]", _job(a), _job(b)))
    mc = sorted((e["req_id"] or "", e["detail"]) for e in _rows(model, "events") if e["kind"] == "crash")
    vc = sorted((e["req_id"] or "", e["detail"]) for e in _rows(real, "events") if e["kind"] == "crash")
    report.decisions += 1
    if mc != vc:
        report.divergences.append(Divergence(math.inf, "", "crash events", mc[:5], vc[:5]))


def _job(row: dict[str, Any] | None) -> str | None:
    if row is None:
        return None
    return (f"{row['direction']} {row['chunks']} chunks {row['blocks']} blocks {row['bytes']} B "
            f"at {row['submit_s']:.6f} s")


def format_report(rep: FidelityReport) -> str:
    """The report as the command prints it."""
    ends = f"ends: kvsim {rep.status.get('kvsim')}, vLLM {rep.status.get('vllm')}"
    lines = [f"fidelity: {rep.scenario}: kvsim (logic {rep.logic}) vs vLLM {rep.vllm_version}, "
             f"{rep.requests} requests ({ends})"]
    if rep.lockstep is not None:
        from sim.tools.differential import describe  # noqa: PLC0415

        lines += describe(rep.lockstep)
        lines.append("per request, over the whole runs:")
    known = ", ".join(f"{k} {n}" for k, n in sorted(rep.known.items())) or "none"
    lines.append(f"{len(rep.divergences)} divergences in {rep.decisions} decisions "
                 f"(known, from listed simplifications: {known})")
    first = rep.first
    if first is not None:
        lines.append(f"first: t={first.t_s:.6f} s, request {first.req_id}, {first.what}: "
                     f"kvsim {first.kvsim!r}, vLLM {first.vllm!r}")
        by = ", ".join(f"{k} {n}" for k, n in _by_field(rep.divergences).items())
        lines.append(f"by field: {by}")
    return "\n".join(lines)
