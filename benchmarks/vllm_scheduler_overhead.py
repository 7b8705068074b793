"""The engine's own time per step, measured on real vLLM: its v1 ``Scheduler`` on the CPU.

Times ``Scheduler.schedule()`` plus ``Scheduler.update_from_output()`` (vLLM's
scheduling, KV block allocation and prefix-cache bookkeeping, and the output
update of every running request) in all-decode steps with ``n`` running
requests of Llama 3.1 8B's shape (one full-attention group, 16-token blocks,
prefix caching on), for ``n`` in 1..512, and fits ``t = a + b x n`` over
``n`` = 8..256. The model runner is replaced by a fixed sampled token per
request, so input preparation, sampling and detokenisation are *not* in the
figure: it is the scheduler's share of kvsim's ``host_per_request_s``
(``docs/costs.md``). Each figure is the median over the decode steps of one
run; ``--repeat`` runs, the fastest kept (a shared machine only adds time).

Needs a vLLM environment (``scripts/install-vllm-cpu.sh 0.33.0``), not kvsim:

    VLLM_TARGET_DEVICE=cpu /tmp/venv-vllm-0.33.0/bin/python benchmarks/vllm_scheduler_overhead.py

No network: the model config is written to a temporary folder (no weights,
no tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

#: Llama 3.1 8B's config.json figures (https://huggingface.co/meta-llama/Llama-3.1-8B)
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 128000,
            "eos_token_id": 128001}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per run (the second half is timed)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per batch size, fastest kept")
    args = ap.parse_args(argv)

    # vLLM and torch exist only in the vLLM environment; imported here, after the environment
    # variables above that vLLM reads at import
    import torch  # noqa: PLC0415
    import vllm  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: PLC0415
    from vllm.utils.hashing import sha256  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: PLC0415
    from vllm.v1.outputs import ModelRunnerOutput  # noqa: PLC0415
    from vllm.v1.request import Request  # noqa: PLC0415
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415

    folder = tempfile.mkdtemp(prefix="kvsim-sched-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(LLAMA_8B, f)
    mc = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192)
    sc = SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=8192,
                         is_encoder_decoder=False)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                    scheduler_config=sc)
    vc.cache_config.num_gpu_blocks = 200_000
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=200_000, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}" for i in range(32)], spec)])
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)

    def run(n: int) -> float:
        s = Scheduler(vc, kv, StructuredOutputManager(vc), block_size=16)
        for i in range(n):
            params = SamplingParams(max_tokens=100_000, ignore_eos=True)
            s.add_request(Request(f"r{i}", list(range(i * 1000, i * 1000 + 256)), params, None,
                                  block_hasher=hasher))
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = s.schedule()
            ids = list(out.num_scheduled_tokens)
            index = {r: j for j, r in enumerate(ids)}
            s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index=index,
                                                        sampled_token_ids=[[7] for _ in ids]))
            times.append(time.perf_counter() - t0)
        return statistics.median(times[args.steps // 2:])

    print(f"# vLLM {vllm.__version__} Scheduler, CPU, Python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs; Llama 3.1 8B shape, 16-token blocks, "
          f"prefix caching; {args.steps} steps per run (second half timed), fastest of {args.repeat}")
    print("| running requests | schedule + update_from_output | per request |")
    print("| ---: | ---: | ---: |")
    points = []
    for n in (1, 8, 32, 64, 128, 256, 512):
        t = min(run(n) for _ in range(args.repeat))
        points.append((n, t))
        print(f"| {n} | {t * 1e6:,.1f} us | {t / n * 1e6:.1f} us |", flush=True)
    fit = [(n, t) for n, t in points if 8 <= n <= 256]
    b, a = statistics.linear_regression([n for n, _ in fit], [t for _, t in fit])
    print(f"fit over 8..256 running requests: t = {a * 1e6:.1f} us + {b * 1e6:.2f} us x n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
