"""What vLLM's engine core spends hashing a new request's prompt, measured on real vLLM.

vLLM computes a request's prefix-cache block hashes when the request is created in
the engine core (``Request(..., block_hasher=...)``: the chained ``sha256`` of every
full ``hash_block_size``-token block of the prompt, vLLM's default
``prefix_caching_hash_algo``). This script times that construction for prompts of
1k to 128k tokens and 8- and 16-token hash blocks, and prints the time per block
(the fastest of ``--repeat`` runs: a shared machine only adds time), the figure of
kvsim's ``host_per_hashed_block_s`` (``docs/costs.md``).

Needs a vLLM environment (``scripts/install-vllm-cpu.sh 0.33.0``), not kvsim:

    VLLM_TARGET_DEVICE=cpu /tmp/venv-vllm-0.33.0/bin/python benchmarks/vllm_block_hash_cost.py

No network, no model: only vLLM's ``Request`` and its block hasher.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

PROMPTS = (1_024, 8_192, 32_768, 131_072)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed constructions per case, fastest kept")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)

    # vLLM exists only in the vLLM environment; imported after the variables it reads at import
    import vllm  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.utils.hashing import sha256  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1)
    rows = []
    for block in (16, 8):
        hasher = get_request_block_hasher(block, sha256)
        for n in PROMPTS:
            tokens = list(range(1000, 1000 + n))        # distinct ids: nothing cached by accident
            best = float("inf")
            for k in range(args.repeat):
                t0 = time.perf_counter()
                req = Request(f"r{block}-{n}-{k}", tokens, params, None, block_hasher=hasher)
                best = min(best, time.perf_counter() - t0)
            assert len(req.block_hashes) == n // block
            rows.append({"hash_block_tokens": block, "prompt_tokens": n, "blocks": n // block,
                         "seconds": best, "us_per_block": 1e6 * best / (n // block)})
    if args.json:
        print(json.dumps({"vllm": vllm.__version__, "python": platform.python_version(), "rows": rows}))
        return 0
    print(f"vLLM {vllm.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
          f"Request construction with the sha256 block hasher, fastest of {args.repeat}")
    print("| hash block (tokens) | prompt tokens | blocks | ms | us per block |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['hash_block_tokens']} | {r['prompt_tokens']:,} | {r['blocks']:,} | "
              f"{1e3 * r['seconds']:.2f} | {r['us_per_block']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
