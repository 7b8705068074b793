"""Step times of the roofline step model per shipped model and GPU (docs/costs.md,
"Step times per model").

    python benchmarks/step_times.py            # the markdown table
    python benchmarks/step_times.py --gpu h200

Decode rows: ``n`` sequences decoding one token each with ``ctx`` tokens of context
(each request's attended KV and pairs as the scheduler reports them); prefill rows: one
prompt alone, chunked at 8,192 tokens (:func:`sim.model.costs.chunked_prefill_time`).
Models whose weights do not fit one GPU run at tensor parallelism 2. No engine, no
trace: the cost model alone, in well under a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.io.scenario import group_spec, load_model_file, scenarios_dir, step_model_for
from sim.model.costs import GPU_PROFILES, RooflineStepModel, chunked_prefill_time
from sim.model.layout import Layout
from sim.model.scheduler import AttendedContext

#: (model, tensor parallelism): the order of docs/costs.md's table
MODELS = [("llama-3.1-8b", 1), ("llama-3.1-70b", 2), ("qwen3-8b", 1), ("qwen3-32b", 1),
          ("qwen3-30b-a3b", 1), ("gpt-oss-120b", 1), ("gemma-3-27b", 1), ("llama-4-scout", 2),
          ("qwen3-next-80b-a3b", 2), ("deepseek-v4-style", 2)]


def decode_ms(model: RooflineStepModel, ctx: AttendedContext, n: int, context: int) -> float:
    """One decode step of ``n`` sequences with ``context`` tokens each (the new one included)."""
    return 1e3 * model.time(ctx.load([(context - 1, 1, True)] * n))


def row(name: str, tp: int, gpu: str) -> str:
    mf = load_model_file(scenarios_dir() / "models" / f"{name}.toml")
    tph = min(g.tokens_per_block for g in mf.groups)
    tph = 16 if tph >= 16 else tph
    model = step_model_for(gpu, name, tensor_parallel=tp, tokens_per_hash=tph)
    layout = Layout.of([group_spec(g, tp) for g in mf.groups], tph, 1)
    ctx = AttendedContext(layout)
    label = f"{name} (TP{tp})" if tp > 1 else name
    cells = [f"{model.weight_bytes / 1e9:.2f}", f"{model.token_flops / 1e9:.2f}",
             f"{decode_ms(model, ctx, 1, 1000):.2f}", f"{decode_ms(model, ctx, 64, 2048):.2f}",
             f"{1e3 * chunked_prefill_time(model, layout, 2048, 8192):,.1f}",
             f"{1e3 * chunked_prefill_time(model, layout, 32768, 8192):,.0f}"]
    return f"| {label} | {gpu} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="append", choices=sorted(GPU_PROFILES),
                    help="GPU profile(s) (default: h100 and h200)")
    args = ap.parse_args()
    gpus = args.gpu or ["h100", "h200"]
    print("| model | GPU | weights/worker (GB) | token (GFLOP) | decode b=1, 1k ctx (ms) "
          "| decode b=64, 2k ctx (ms) | prefill 2,048 (ms) | prefill 32k (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tp in MODELS:
        for gpu in gpus:
            print(row(name, tp, gpu))


if __name__ == "__main__":
    sim.startup.run_script(main)
