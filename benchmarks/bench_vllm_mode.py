"""Speed of ``decisions = "vllm"`` beside kvsim's own model, measured side by side in one run.

The case is the first ``--limit`` (2,000) requests of the Mooncake conversation
trace on the spec §6 layout with the settings of ``bench_engine.py``'s
``mooncake-spec6`` case (100,000-chunk LRU CPU cache, H200, step and transfer
times on). Each mode runs in its own child process; the figure is simulated
requests per wall second of the replay (vLLM's import and the scheduler's
construction are reported apart). The model mode runs without fast-forward
too, since the vLLM mode steps one step at a time.

Run it with the Python of a vLLM environment (``scripts/install-vllm-cpu.sh``):

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. /tmp/venv-vllm-0.30.0/bin/python benchmarks/bench_vllm_mode.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim.startup  # noqa: E402 -- first: a signal during the heavy imports below ends in one line
from sim.tools.run import child_preexec  # noqa: E402 -- after the path set-up, as the child's imports

MODES = {"model": ['decisions="model"'],
         "model-stepwise": ['decisions="model"', "scheduler.fast_forward=false"],
         "vllm": ['decisions="vllm"']}


class _Discard:
    def write(self, table: str, columns: dict[str, list[object]]) -> None:
        pass


def child(mode: str, limit: int) -> None:
    from bench_engine import CASES  # noqa: PLC0415

    from sim.engine.loop import simulate  # noqa: PLC0415
    from sim.engine.metrics import Recorder  # noqa: PLC0415
    from sim.io.scenario import load_run  # noqa: PLC0415

    case = CASES["mooncake-spec6"]
    sets = [*case["set"], *MODES[mode], f"workload.limit={limit}"]
    spec = load_run(Path(case["scenario"]), [("bench", s) for s in sets])
    cfg = spec.engine_config()
    t0 = time.perf_counter()
    if mode == "vllm":
        from sim.engine.vllm_engine import VllmEngine  # noqa: PLC0415

        engine = VllmEngine(cfg, spec.requests(), Recorder(_Discard()))
        version = engine.vllm_version
    else:
        from sim.engine.loop import Engine  # noqa: PLC0415

        engine = Engine(dataclasses.replace(cfg), spec.requests(), Recorder(_Discard()))
        version = None
    t1 = time.perf_counter()
    res = engine.run()
    t2 = time.perf_counter()
    s = res.summary
    print(json.dumps({"mode": mode, "vllm": version, "status": res.status, "finished": s.requests_finished,
                      "setup_s": t1 - t0, "replay_s": t2 - t1, "rps": s.requests_finished / (t2 - t1),
                      "steps": s.steps}))
    _ = simulate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--mode", choices=sorted(MODES), action="append")
    p.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.limit)
        return 0
    rows = []
    for mode in args.mode or ["model", "model-stepwise", "vllm"]:
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--limit", str(args.limit)],
                             capture_output=True, text=True, check=False, preexec_fn=child_preexec)
        if out.returncode != 0:
            print(f"{mode}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r["rps"] for r in rows if r["mode"] == "model"), None)
    print(f"{'mode':16s} {'status':8s} {'finished':>8s} {'setup s':>8s} {'replay s':>9s} {'req/s':>8s} "
          f"{'steps':>7s} {'vs model':>8s}")
    for r in rows:
        ratio = f"{r['rps'] / base:.3f}x" if base else "-"
        label = r["mode"] + (f" {r['vllm']}" if r["vllm"] else "")
        print(f"{label:16s} {r['status']:8s} {r['finished']:8d} {r['setup_s']:8.2f} {r['replay_s']:9.2f} "
              f"{r['rps']:8.1f} {r['steps']:7d} {ratio:>8s}")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
