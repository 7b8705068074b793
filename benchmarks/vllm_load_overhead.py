"""vLLM's own scheduler time around a CPU-hit load, measured on real vLLM (CPU).

Replays the vLLM blog's TTFT case (``benchmarks/validation/published.toml``,
``vllm-blog-ttft-100k``: Llama-3.1-8B, 16-token blocks, one copy per block, GPU
prefix caching off) at several prompt sizes with ``decisions = "vllm"``: a cold
prompt, then the same prompt again once it is in the CPU cache. vLLM's v1
``Scheduler`` with its ``OffloadingConnector`` decides every step; the script
times each call of ``Scheduler.schedule()`` and ``Scheduler.update_from_output()``
(the scheduler, the KV cache manager and the connector's scheduler side: lookup,
block allocation, load and store plans, job completions) and prints, per prompt
size, what the CPU hit's steps cost: the ``schedule()`` that admits it with its
load, the ``update_from_output()`` calls after (the load's completion, the first
token), and the cold prompt's ``schedule()`` calls for comparison; each the
fastest of ``--repeat`` runs (a shared machine only adds time).

These figures are the source of kvsim's scheduler time per block (``host_per_block_s``,
``host_per_loaded_block_s`` and ``host_no_forward_step_s`` of ``docs/costs.md``, fitted on
vLLM 0.30.0's run of 2026-12-06: 1.55 us per block at admission and in cold prefill steps,
0.8 us per loaded block after it, 0.22 ms fixed for the admitting step); the last column
is kvsim's CPU-hit TTFT with the current model (``docs/validation.md``, "Why they
disagree", item 3).

Needs a vLLM environment (``scripts/install-vllm-cpu.sh 0.30.0``) and kvsim's
source on the path, as ``kvsim run --decisions vllm`` does:

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD /tmp/venv-vllm-0.30.0/bin/python benchmarks/vllm_load_overhead.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parent.parent
CASE = "vllm-blog-ttft-100k"
PROMPTS = (1_024, 10_240, 65_536, 102_400)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per prompt size, fastest step kept")
    ap.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS), help="prompt sizes (tokens)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    # vLLM exists only in the vLLM environment: imported here, after the variables above
    import logging  # noqa: PLC0415

    import vllm  # noqa: PLC0415
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415

    from sim.engine.metrics import MemorySink, Recorder  # noqa: PLC0415
    from sim.engine.vllm_engine import simulate_vllm  # noqa: PLC0415
    from sim.tools import validation as v  # noqa: PLC0415

    logging.getLogger("vllm").setLevel(logging.ERROR)   # 0.33 warns per engine, whatever the variable

    #: (call, phase, wall seconds) of every timed call; phase "hit" once the second request is in
    calls: list[tuple[str, str, float]] = []

    def timed(name: str) -> None:
        real = getattr(Scheduler, name)

        def call(self: Any, *a: Any, **k: Any) -> Any:
            phase = "hit" if "hit" in self.requests else "cold"
            t0 = time.perf_counter()
            out = real(self, *a, **k)
            wall = time.perf_counter() - t0
            if name == "schedule" and phase == "cold" and not out.total_num_scheduled_tokens:
                phase = "idle"   # a step that scheduled nothing (a store in flight, say)
            calls.append((name, phase, wall))
            return out

        setattr(Scheduler, name, call)

    timed("schedule")
    timed("update_from_output")
    case = next(c for c in v.load_cases(ROOT / "benchmarks" / "validation" / "published.toml").cases
                if c.id == CASE)
    print(f"# vLLM {vllm.__version__} Scheduler + OffloadingConnector (scheduler side), CPU, Python "
          f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; case {CASE} "
          f"(16-token blocks); each call the fastest of {args.repeat} runs")
    print("| prompt tokens | blocks | cold: schedule() of each prefill step (ms) "
          "| CPU hit: admitting schedule() (ms) | CPU hit: update_from_output() after it, sum (ms) "
          "| CPU-hit TTFT, kvsim (ms) "
          "| admission, us per block |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for prompt in args.prompts:
        spec = v._spec(case.model_copy(update={"prompt_tokens": prompt}), ROOT / "benchmarks" / "validation")
        cfg = dataclasses.replace(spec.engine_config(), decisions="vllm")
        tph = spec.layout.tokens_per_hash
        best: list[float] | None = None
        kinds: list[tuple[str, str]] = []
        ttft = 0.0
        for _ in range(args.repeat):
            calls.clear()
            reqs = [v._request("cold", 0.0, prompt, 1, tph, 0),
                    v._request("hit", v._GAP_S, prompt, 1, tph, 1)]
            sink = MemorySink()
            simulate_vllm(cfg, reqs, Recorder(sink))
            if kinds and kinds != [(n, p) for n, p, _ in calls]:
                raise RuntimeError("the runs took different steps")
            kinds = [(n, p) for n, p, _ in calls]
            walls = [w for _, _, w in calls]
            best = walls if best is None else [min(a, b) for a, b in zip(best, walls, strict=True)]
            ttft = float(sink.frames()["requests"].set_index("req_id").loc["hit", "ttft_s"])
        assert best is not None
        timed_calls = list(zip(kinds, best, strict=True))
        cold = [w for (n, p), w in timed_calls if (n, p) == ("schedule", "cold")]
        hit = [(n, w) for (n, p), w in timed_calls if p == "hit"]
        admit = next(i for i, (n, _) in enumerate(hit) if n == "schedule")
        after = sum(w for n, w in hit[admit + 1:] if n == "update_from_output")
        blocks = prompt // 16
        print(f"| {prompt:,} | {blocks:,} | {', '.join(f'{w * 1e3:.2f}' for w in cold)} | "
              f"{hit[admit][1] * 1e3:.2f} | {after * 1e3:.2f} | {ttft * 1e3:.1f} | "
              f"{hit[admit][1] / blocks * 1e6:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
