"""kvsim against published measurements of vLLM with CPU KV offloading (issue 17, item 5).

Every case of ``benchmarks/validation/published.toml`` (sources and readings in
docs/validation.md) is replayed with the shipped model and hardware files
(:mod:`sim.tools.validation`): the TTFT reduction a CPU hit gives (cold TTFT /
CPU-hit TTFT, one request alone), the throughput gain of a batch at a CPU hit
rate (tokens/s over the same batch without hits), and the gain of a release's
KV layout over an earlier one (the largest ratio over a grid, "up to"). The table gives the published
figure, kvsim's, the relative error (kvsim / published - 1) and whether it is
within 25 %; the detail lines give the two figures each ratio is made of.
``--mfu X`` replays with the matmuls at X of peak, one constant for every step, instead of
the GPU's default (the measured curve by step size on the H100, H200 and A100, else 0.5;
docs/costs.md; attention keeps its own efficiency): a sensitivity diagnostic, printed as
such, never a calibration. Deterministic; about two minutes.

``--curves`` adds kvsim's whole curves over each source's measured grid (prompt
sizes, hit rates), for reading against the published plots.

Usage: python benchmarks/validate_published.py [--cases FILE] [--only ID ...] [--requests N]
       [--mfu X] [--curves]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import sim.startup  # first: a signal during the heavy imports below ends in one line
from sim.errors import InputError
from sim.tools.validation import TOLERANCE, ValidationFile, load_cases, replay, throughput_and_hits, ttft_pair

CASES = Path(__file__).resolve().parent / "validation" / "published.toml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=Path, default=CASES, help="a validation/1 file")
    ap.add_argument("--only", nargs="*", default=None, help="case ids to run (default: all)")
    ap.add_argument("--requests", type=int, default=None,
                    help="shrink every throughput batch to this many requests (default: the published size)")
    ap.add_argument("--mfu", type=float, default=None,
                    help="what-if: fraction of dense BF16 peak the matmuls reach in every step (default: "
                         "the GPU's measured curve by step size, else 0.5)")
    ap.add_argument("--curves", action="store_true",
                    help="also print kvsim's whole curves over each source's measured grid")
    args = ap.parse_args(argv)
    try:
        vf = load_cases(args.cases)
    except InputError as exc:
        ap.error(str(exc))
    cases = [c for c in vf.cases if args.only is None or c.id in args.only]
    what_if = "" if args.mfu is None else f", WHAT-IF mfu = {args.mfu:g} (not the model's default)"
    print(f"# kvsim vs published vLLM CPU-offloading measurements ({args.cases.name}, {len(cases)} cases, "
          f"tolerance {TOLERANCE:.0%}{what_if})")
    rows = []
    details = []
    for c in cases:
        r = replay(c, args.cases.parent, requests=args.requests, mfu=args.mfu)
        rows.append(r)
        if c.metric == "layout_ttft_reduction":
            details.append(f"# {c.id}: kvsim CPU-hit TTFT {r.numerator * 1e3:,.1f} ms with the earlier "
                           f"layout, {r.denominator * 1e3:,.1f} ms with the case's, at {r.at:,.0f} tokens")
        elif c.metric == "layout_throughput_gain":
            details.append(f"# {c.id}: kvsim {r.numerator:,.0f} tokens/s with the case's layout, "
                           f"{r.denominator:,.0f} with the earlier one, at {r.at:.0%} CPU hits")
        elif c.metric == "ttft_reduction":
            line = (f"# {c.id}: kvsim cold TTFT {r.numerator * 1e3:,.1f} ms, CPU-hit TTFT "
                    f"{r.denominator * 1e3:,.1f} ms")
            if c.published_parts is not None:
                cold, hit = c.published_parts
                line += (f" (published {cold * 1e3:,.1f} ms and {hit * 1e3:,.1f} ms: kvsim "
                         f"{r.numerator / cold - 1:+.0%} and {r.denominator / hit - 1:+.0%})")
            details.append(line)
        else:
            details.append(f"# {c.id}: kvsim {r.numerator:,.0f} tokens/s with hits, {r.denominator:,.0f} "
                           "tokens/s without")
    print("| case | source | model, GPU | metric | point | published | kvsim | error | within 25%? |")
    print("|---|---|---|---|---|---:|---:|---:|---|")
    for r in rows:
        c = r.case
        if c.metric == "ttft_reduction":
            point, metric = f"{c.prompt_tokens:,} tokens", "TTFT cold / CPU hit"
        elif c.metric == "layout_ttft_reduction":
            assert c.up_to is not None
            point = f"up to, over {min(c.up_to):,.0f}-{max(c.up_to):,.0f} tokens"
            metric = "CPU-hit TTFT, earlier / new layout"
        elif c.metric == "layout_throughput_gain":
            assert c.up_to is not None
            point = f"up to, over {min(c.up_to):.0%}-{max(c.up_to):.0%} CPU hits"
            metric = "throughput, new / earlier layout"
        else:
            assert c.hit_rate is not None
            point, metric = f"{c.hit_rate:.0%} CPU hits", "throughput vs 0 % hits"
        print(f"| {c.id} | {c.source} | {c.model}, {c.gpu}"
              f"{f' TP{c.tensor_parallel}' if c.tensor_parallel > 1 else ''} | {metric} | {point} "
              f"| {c.published:.2f}x | {r.kvsim:.2f}x | {r.rel_error:+.0%} | {'yes' if r.within else 'no'} |")
    for line in details:
        print(line)
    inside = sum(r.within for r in rows)
    print(f"# {inside} of {len(rows)} cases within {TOLERANCE:.0%}")
    if args.curves:
        curves(vf, args.cases.parent, args.requests, args.mfu)
    return 0


def curves(vf: ValidationFile, base: Path, requests: int | None, mfu: float | None) -> None:
    """kvsim's figures over each source's grid, the setup of its first case of each metric
    (no published figure at most points: the curves' shape, for reading against the plots)."""
    for key, src in vf.sources.items():
        ttft = next((c for c in vf.cases if c.source == key and c.metric == "ttft_reduction"), None)
        if ttft is not None and src.prompt_grid:
            print(f"\n# {key}: kvsim TTFT cold / CPU hit over the measured prompt sizes "
                  f"({ttft.model}, {ttft.gpu})")
            print("| prompt tokens | cold TTFT | CPU-hit TTFT | reduction |")
            print("| ---: | ---: | ---: | ---: |")
            for n in src.prompt_grid:
                cold, hit = ttft_pair(ttft.model_copy(update={"prompt_tokens": n}), base, mfu)
                print(f"| {n:,} | {cold * 1e3:,.1f} ms | {hit * 1e3:,.1f} ms | {cold / hit:.2f}x |")
        thr = next((c for c in vf.cases if c.source == key and c.metric == "throughput_gain"), None)
        if thr is not None and src.hit_rate_grid:
            print(f"\n# {key}: kvsim throughput over the measured CPU hit rates ({thr.model}, {thr.gpu}, "
                  f"{requests or thr.requests:,} x {thr.prompt_tokens:,} tokens)")
            print("| CPU hit rate (planned) | hits achieved | tokens/s | gain over 0 % |")
            print("| ---: | ---: | ---: | ---: |")
            base_rate = None
            for h in src.hit_rate_grid:
                rate, hit, wanted = throughput_and_hits(thr, base, h, requests, mfu)
                base_rate = base_rate or rate
                print(f"| {h:.0%} | {hit:,} of {wanted:,} | {rate:,.0f} | {rate / base_rate:.2f}x |")


if __name__ == "__main__":
    sim.startup.run_script(main)
