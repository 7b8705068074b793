"""The prefill curve: prompt length -> modelled time of its whole chunked prefill, and the ratio to 1k.

One request alone on an idle engine: its prompt is computed in steps of at most
``--budget`` tokens (vLLM's chunked prefill, ``max_num_batched_tokens``), each
step timed by the ``costs.step = "auto"`` model of the shipped model file on
the GPU (:func:`sim.model.costs.chunked_prefill_time`, the same pairs and KV
reads the scheduler reports). Columns: the step model's time; the share of
compute time in causal attention (the quadratic term); the same prefill
without the attention term (``linear``), which is what the step model of
earlier releases charged in shape (time proportional to tokens); the ratios to
the 1,000-token prompt. No simulation and no randomness: the figures are
exact functions of the model and hardware files.

Usage: python benchmarks/prefill_curve.py [--model llama-3.1-8b] [--gpu h100] [--tp 1] [--budget 8192]
"""

from __future__ import annotations

import argparse
import dataclasses

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.errors import InputError
from sim.io.scenario import group_spec, load_model_file, scenarios_dir, step_model_for
from sim.model.costs import GPU_PROFILES, StepLoad, attention_pairs, chunked_prefill_time, group_span
from sim.model.layout import Layout

PROMPTS = (1_000, 2_000, 4_000, 8_192, 16_384, 32_768, 65_536, 90_000, 131_072)


def attention_share(model: object, layout: Layout, prompt: int, budget: int) -> float:
    """Fraction of the prefill's FLOPs spent in attention."""
    attn = other = 0.0
    p = 0
    while p < prompt:
        c = min(budget, prompt - p)
        pairs = [attention_pairs(g.kind, group_span(g), p, c) for g in layout.groups]
        attn += sum(f * n for f, n in zip(model.pair_flops, pairs, strict=True))  # type: ignore[attr-defined]
        other += model.token_flops * c + model.sample_flops  # type: ignore[attr-defined]
        p += c
    return attn / (attn + other)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a shipped model file with a [shape]")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPU_PROFILES), help="a shipped GPU profile")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    args = ap.parse_args(argv)
    if args.tp < 1 or args.budget < 1:
        ap.error("--tp and --budget: positive integers")
    try:
        mf = load_model_file(scenarios_dir() / "models" / f"{args.model}.toml")
        tph = 16 if all(g.tokens_per_block % 16 == 0 for g in mf.groups) else 8
        layout = Layout.of([group_spec(g, args.tp) for g in mf.groups], tph, 1)
        model = step_model_for(args.gpu, args.model, tensor_parallel=args.tp, tokens_per_hash=tph)
    except InputError as exc:   # no such model, or one without a [shape]
        ap.error(f"--model: {exc}")
    linear = dataclasses.replace(model, pair_flops=tuple(0.0 for _ in model.pair_flops))
    print(f"# prefill curve: model {args.model}, GPU {args.gpu}, tensor_parallel {args.tp}, "
          f"max_num_batched_tokens {args.budget}")
    pairs = ", ".join(f"{f:.4g}" for f in model.pair_flops)
    curve = model.token_rate_curve
    rate = (f"{curve[0][1]:.4g}-{curve[-1][1]:.4g} FLOP/s by tokens per step "
            f"({curve[0][0]:,}-{curve[-1][0]:,})" if curve else f"{model.flops_per_s:.4g} FLOP/s")
    print(f"# step model: token {model.token_flops:.4g} FLOP, LM head {model.sample_flops:.4g} FLOP/request, "
          f"pairs {pairs} FLOP, weights {model.weight_bytes:.4g} B, "
          f"{rate} (attention pairs: "
          f"{', '.join(f'{r:.4g}' for r in model.pair_flops_per_s) or 'the same'}), "
          f"{model.bytes_per_s:.4g} B/s, host {model.host.step_s:g} s/step + "
          f"{model.host.per_request_s:g} s/request + {model.host.per_block_s:g} s/prompt block")
    one = StepLoad(decode_seqs=1, requests=1, pairs=(0,) * len(layout.groups))
    print(f"# (a decode step of one sequence with no context: {model.time(one) * 1e3:.2f} ms)")
    base = chunked_prefill_time(model, layout, PROMPTS[0], args.budget)
    base_lin = chunked_prefill_time(linear, layout, PROMPTS[0], args.budget)
    print("| prompt tokens | steps | prefill time | ratio to 1k | attention share of FLOPs "
          "| without attention term | its ratio to 1k |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in PROMPTS:
        t = chunked_prefill_time(model, layout, n, args.budget)
        lin = chunked_prefill_time(linear, layout, n, args.budget)
        steps = -(-n // args.budget)
        share = attention_share(model, layout, n, args.budget)
        print(f"| {n:,} | {steps} | {t * 1e3:,.1f} ms | {t / base:.1f} | {share:.1%} | {lin * 1e3:,.1f} ms "
              f"| {lin / base_lin:.1f} |")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
