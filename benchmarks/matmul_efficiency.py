"""The matmul efficiency of an H100 and of an A100 by step size, from measured per-layer operator times.

kvsim's roofline step model charges a step's token FLOPs (every weight matmul, and the
per-token work around them) at ``efficiency x dense BF16 peak``. This script derives that
efficiency from measured times, not from an assumption:

* Source: Vidur's operator profile of an H100 (microsoft/vidur, file
  ``data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv`` at commit
  e26eb8f79fa9a6a7c38eac0f5291302402b20364): the median time (ms, CUDA events, 20 runs)
  of each operator of one Llama-2-7B decoder layer (hidden 4,096, 32 heads, MLP 11,008,
  gated) for a given number of tokens, tensor parallelism 1. Vidur's device
  configuration for this GPU states 1,000 FP16 TFLOPS, the H100 SXM figure.
* Rows: windows of 8 consecutive profiled token counts (the profile steps by 8 tokens
  up to 1,024, by 16 up to 2,048, by 32 above): the 4 above and the 4 at or below each
  of 512 and 1,024, the 8 from 1,872 to 1,984, and the largest 8 (3,904 to 4,096, where
  the profile ends); every row of those windows, copied below as they are in the file.
* Per row: the layer's weight-matmul FLOPs (QKV, output, gate-and-up and down
  projections: ``2 x tokens x 4,096 x 49,408``) over the time of every operator the
  profile has outside attention (the four projections, both RMSNorms, rotary embedding,
  SiLU-and-mul, and the residual add, counted twice), over kvsim's H100 peak (989e12).
  So the figure also carries the per-token elementwise work, which kvsim counts no
  FLOPs for.
* Per window: the median token count and the median efficiency. These four points are
  ``sim.model.costs.HOPPER_MATMUL_EFFICIENCY``; ``tests/model/test_costs_roofline.py``
  checks that they are what this script computes.
* The A100 the same way: Vidur's operator profile of the same layer on an A100
  (``data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv`` at commit
  bee57dafa1eb2dc422dcaec46a66975599a6a242; tensor parallelism 1), the rows of the same
  four windows (``A100_WINDOWS``), over the A100's dense BF16 peak (312e12): the points of
  ``sim.model.costs.AMPERE_MATMUL_EFFICIENCY``.

    python benchmarks/matmul_efficiency.py            # the table of docs/costs.md

What the rows show: about 0.63 from 1,600 tokens up, 0.54-0.63 around 1,024 (high at
and just below 1,024, low just above it: the GEMM tiles' last wave), 0.45-0.55 around 512.
The A100's rows are flatter: 0.57-0.65 from 488 to 4,096 tokens (its peak is a third of
the H100's, so the same small step keeps its tensor cores busier).
"""

from __future__ import annotations

import argparse
import statistics

import sim.startup  # first: a signal while it starts ends in one line

#: kvsim's dense BF16 peak of an H100 SXM (sim.model.costs.GPU_PROFILES["h100"])
H100_PEAK = 989e12
#: kvsim's dense BF16 peak of an A100 SXM (sim.model.costs.GPU_PROFILES["a100"])
A100_PEAK = 312e12
#: weight-matmul FLOPs per token of one Llama-2-7B layer: 2 x hidden x (QKV 12,288 + output
#: 4,096 + gate-and-up 22,016 + down 11,008 over the hidden size)
FLOPS_PER_TOKEN = 2 * 4096 * (3 * 4096 + 4096 + 2 * 11008 + 11008)

#: columns copied per row (median ms): input_layernorm, attn_pre_proj, attn_rope,
#: attn_post_proj, post_attention_layernorm, mlp_up_proj, mlp_act, mlp_down_proj, add
COLUMNS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")

#: (tokens, medians in COLUMNS order), window by window
WINDOWS: dict[str, tuple[tuple[int, tuple[float, ...]], ...]] = {
    "512": (
        (544, (0.009, 0.105, 0.012, 0.048, 0.009, 0.168, 0.022, 0.112, 0.005)),
        (536, (0.009, 0.104, 0.0115, 0.048, 0.009, 0.169, 0.022, 0.112, 0.005)),
        (528, (0.007, 0.1035, 0.010, 0.048, 0.007, 0.167, 0.018, 0.112, 0.005)),
        (520, (0.007, 0.105, 0.010, 0.048, 0.0075, 0.1695, 0.017, 0.112, 0.005)),
        (512, (0.007, 0.090, 0.011, 0.029, 0.007, 0.134, 0.017, 0.0755, 0.004)),
        (504, (0.007, 0.090, 0.011, 0.034, 0.007, 0.133, 0.017, 0.082, 0.004)),
        (496, (0.007, 0.091, 0.011, 0.029, 0.007, 0.135, 0.017, 0.078, 0.004)),
        (488, (0.007, 0.090, 0.011, 0.029, 0.007, 0.132, 0.017, 0.079, 0.004)),
    ),
    "1,024": (
        (1088, (0.014, 0.169, 0.024, 0.066, 0.015, 0.304, 0.040, 0.157, 0.008)),
        (1072, (0.014, 0.1695, 0.023, 0.065, 0.015, 0.305, 0.040, 0.155, 0.008)),
        (1056, (0.013, 0.168, 0.021, 0.065, 0.013, 0.302, 0.037, 0.155, 0.008)),
        (1040, (0.013, 0.170, 0.021, 0.065, 0.013, 0.3025, 0.036, 0.156, 0.008)),
        (1024, (0.013, 0.151, 0.021, 0.049, 0.014, 0.256, 0.037, 0.109, 0.007)),
        (1016, (0.013, 0.148, 0.021, 0.049, 0.014, 0.252, 0.0365, 0.108, 0.007)),
        (1008, (0.013, 0.148, 0.021, 0.048, 0.0135, 0.252, 0.037, 0.108, 0.007)),
        (1000, (0.013, 0.148, 0.021, 0.048, 0.014, 0.2485, 0.036, 0.108, 0.007)),
    ),
    "2,000": (
        (1984, (0.026, 0.279, 0.041, 0.097, 0.028, 0.487, 0.069, 0.223, 0.014)),
        (1968, (0.026, 0.280, 0.040, 0.097, 0.028, 0.487, 0.069, 0.225, 0.014)),
        (1952, (0.024, 0.2755, 0.039, 0.095, 0.0275, 0.4815, 0.068, 0.220, 0.014)),
        (1936, (0.024, 0.277, 0.039, 0.095, 0.027, 0.4855, 0.068, 0.226, 0.014)),
        (1920, (0.024, 0.260, 0.039, 0.094, 0.026, 0.478, 0.067, 0.2165, 0.013)),
        (1904, (0.025, 0.265, 0.039, 0.098, 0.026, 0.4725, 0.068, 0.2255, 0.013)),
        (1888, (0.024, 0.2625, 0.039, 0.097, 0.025, 0.478, 0.067, 0.223, 0.013)),
        (1872, (0.023, 0.256, 0.038, 0.094, 0.0245, 0.462, 0.066, 0.226, 0.013)),
    ),
    "4,096": (
        (4096, (0.0665, 0.584, 0.0835, 0.193, 0.067, 0.987, 0.139, 0.441, 0.031)),
        (4096, (0.0665, 0.593, 0.084, 0.195, 0.067, 0.999, 0.138, 0.435, 0.031)),
        (4064, (0.068, 0.5665, 0.084, 0.206, 0.068, 1.001, 0.138, 0.452, 0.031)),
        (4032, (0.066, 0.557, 0.082, 0.2005, 0.066, 0.986, 0.136, 0.5255, 0.030)),
        (4000, (0.065, 0.556, 0.081, 0.200, 0.066, 0.987, 0.135, 0.4275, 0.030)),
        (3968, (0.065, 0.532, 0.081, 0.1885, 0.066, 0.971, 0.134, 0.429, 0.029)),
        (3936, (0.0645, 0.5395, 0.082, 0.2025, 0.065, 0.9795, 0.1335, 0.450, 0.029)),
        (3904, (0.063, 0.534, 0.080, 0.200, 0.063, 0.976, 0.130, 0.427, 0.029)),
    ),
}

#: The A100's rows of the same windows (Vidur's A100 profile, same columns; both 4,096-token rows
#: in file order), copied as the file has them (binary noise such as 0.10400000000000001 trimmed)
A100_WINDOWS: dict[str, tuple[tuple[int, tuple[float, ...]], ...]] = {
    "512": (
        (544, (0.013, 0.262, 0.022, 0.095, 0.012, 0.460, 0.037, 0.238, 0.007)),
        (536, (0.012, 0.282, 0.022, 0.097, 0.012, 0.463, 0.036, 0.242, 0.007)),
        (528, (0.013, 0.288, 0.022, 0.099, 0.012, 0.468, 0.036, 0.247, 0.007)),
        (520, (0.012, 0.278, 0.0215, 0.0935, 0.012, 0.4565, 0.035, 0.239, 0.007)),
        (512, (0.012, 0.234, 0.022, 0.088, 0.012, 0.402, 0.0365, 0.229, 0.007)),
        (504, (0.012, 0.2295, 0.022, 0.085, 0.012, 0.398, 0.036, 0.220, 0.007)),
        (496, (0.012, 0.230, 0.021, 0.086, 0.012, 0.3995, 0.036, 0.205, 0.007)),
        (488, (0.011, 0.223, 0.020, 0.084, 0.0115, 0.392, 0.035, 0.193, 0.006)),
    ),
    "1,024": (
        (1088, (0.025, 0.489, 0.040, 0.191, 0.024, 0.896, 0.077, 0.519, 0.014)),
        (1072, (0.024, 0.489, 0.040, 0.192, 0.023, 0.896, 0.072, 0.518, 0.014)),
        (1056, (0.023, 0.472, 0.039, 0.186, 0.022, 0.869, 0.070, 0.503, 0.013)),
        (1040, (0.023, 0.481, 0.0385, 0.189, 0.022, 0.8845, 0.071, 0.511, 0.013)),
        (1024, (0.022, 0.475, 0.038, 0.176, 0.022, 0.877, 0.070, 0.431, 0.012)),
        (1016, (0.0225, 0.476, 0.038, 0.174, 0.022, 0.878, 0.070, 0.433, 0.012)),
        (1008, (0.023, 0.4865, 0.038, 0.179, 0.022, 0.899, 0.070, 0.4385, 0.013)),
        (1000, (0.021, 0.458, 0.037, 0.2205, 0.021, 0.846, 0.068, 0.417, 0.012)),
    ),
    "2,000": (
        (1984, (0.050, 0.9615, 0.073, 0.296, 0.052, 1.663, 0.1305, 0.783, 0.025)),
        (1968, (0.051, 0.987, 0.074, 0.304, 0.053, 1.551, 0.131, 0.808, 0.025)),
        (1952, (0.050, 0.989, 0.073, 0.319, 0.0515, 1.550, 0.129, 0.808, 0.025)),
        (1936, (0.049, 0.975, 0.072, 0.314, 0.050, 1.530, 0.126, 0.798, 0.025)),
        (1920, (0.049, 0.932, 0.072, 0.294, 0.050, 1.606, 0.127, 0.786, 0.026)),
        (1904, (0.050, 0.951, 0.073, 0.299, 0.051, 1.482, 0.128, 0.804, 0.026)),
        (1888, (0.049, 0.960, 0.073, 0.302, 0.051, 1.492, 0.129, 0.811, 0.026)),
        (1872, (0.048, 0.9455, 0.071, 0.297, 0.050, 1.469, 0.127, 0.8005, 0.025)),
    ),
    "4,096": (
        (4096, (0.105, 1.911, 0.149, 0.611, 0.104, 3.3655, 0.266, 1.604, 0.055)),
        (4096, (0.104, 1.8865, 0.1485, 0.603, 0.104, 3.324, 0.2645, 1.585, 0.055)),
        (4064, (0.104, 1.9015, 0.1475, 0.594, 0.103, 3.3605, 0.2635, 1.599, 0.055)),
        (4032, (0.1025, 1.886, 0.147, 0.592, 0.102, 3.3425, 0.260, 1.5845, 0.054)),
        (4000, (0.103, 1.910, 0.146, 0.596, 0.102, 3.3655, 0.260, 1.604, 0.054)),
        (3968, (0.102, 1.846, 0.1445, 0.5905, 0.101, 3.272, 0.258, 1.6035, 0.053)),
        (3936, (0.102, 1.858, 0.143, 0.5955, 0.100, 3.293, 0.256, 1.607, 0.053)),
        (3904, (0.101, 1.845, 0.142, 0.591, 0.100, 3.273, 0.254, 1.603, 0.053)),
    ),
}

Windows = dict[str, tuple[tuple[int, tuple[float, ...]], ...]]
#: per GPU: its measured rows and kvsim's dense BF16 peak for it
GPUS: dict[str, tuple[Windows, float]] = {"h100": (WINDOWS, H100_PEAK), "a100": (A100_WINDOWS, A100_PEAK)}


def row_efficiency(tokens: int, ms: tuple[float, ...], peak: float = H100_PEAK) -> float:
    """Weight-matmul FLOPs of one layer over the time of its operators outside attention
    (the residual add twice), as a fraction of ``peak`` (the H100's dense BF16 peak by default)."""
    times = dict(zip(COLUMNS, ms, strict=True))
    seconds = (sum(times.values()) + times["add"]) / 1e3
    return tokens * FLOPS_PER_TOKEN / seconds / peak


def window_points(gpu: str = "h100") -> tuple[tuple[int, float], ...]:
    """Per window of ``gpu``'s rows, (median token count, median efficiency rounded to 3 places)."""
    windows, peak = GPUS[gpu]
    out = []
    for rows in windows.values():
        tokens = statistics.median(t for t, _ in rows)
        eff = statistics.median(row_efficiency(t, ms, peak) for t, ms in rows)
        out.append((int(tokens), round(eff, 3)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for gpu, (windows, peak) in GPUS.items():
        print(f"{gpu.upper()} peak {peak:.4g} FLOP/s; {FLOPS_PER_TOKEN:,} weight-matmul FLOPs per token "
              "and layer")
        print("| window | tokens | matmuls ms | other ops ms | efficiency |")
        print("|---|---:|---:|---:|---:|")
        for name, rows in windows.items():
            for t, ms in rows:
                d = dict(zip(COLUMNS, ms, strict=True))
                mm = d["attn_pre_proj"] + d["attn_post_proj"] + d["mlp_up_proj"] + d["mlp_down_proj"]
                other = sum(ms) + d["add"] - mm
                print(f"| {name} | {t:,} | {mm:.4f} | {other:.4f} | {row_efficiency(t, ms, peak):.3f} |")
        print(f"\n{gpu} per window (median tokens, median efficiency): "
              + ", ".join(f"({t:,}, {e:.3f})" for t, e in window_points(gpu)) + "\n")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
