"""Shared builders and paths for the tests (imported explicitly, never through conftest)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sim.model.connector import OffloadingScheduler
from sim.model.cpu_cache import CpuChunkCache, OffloadKey, offload_key
from sim.model.gpu_cache import GpuKVCache
from sim.model.gpu_fast import GpuFastCache
from sim.model.layout import GroupKind, GroupSpec, Layout
from sim.model.windows import profile

ROOT = Path(__file__).resolve().parent.parent
#: the public traces: $KVSIM_TRACES (what scenarios naming a trace read; .ci/run sets it),
#: else the shared folder next to the repository
TRACES = Path(os.environ["KVSIM_TRACES"]) if os.environ.get("KVSIM_TRACES") else \
    ROOT.parent / "shared" / "traces"


def fa(bs: int, eagle: bool = False) -> GroupSpec:
    return GroupSpec(GroupKind.FULL, bs, eagle=eagle)


def swa(bs: int, window: int, eagle: bool = False, extra: int = 0) -> GroupSpec:
    return GroupSpec(GroupKind.SLIDING_WINDOW, bs, window=window, eagle=eagle,
                     extra_retained_tokens=extra)


def cla(bs: int, chunk: int) -> GroupSpec:
    return GroupSpec(GroupKind.CHUNKED_LOCAL, bs, attention_chunk=chunk)


SPEC6 = Layout.of([fa(256), swa(64, 128), swa(8, 128)], tokens_per_hash=8, blocks_per_chunk=4)


@dataclass
class Req:
    req_id: str
    block_hashes: list[int]
    num_tokens: int
    num_prompt_tokens: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = self.num_tokens


def quiet_thresholds_from_scratch(gpu: GpuFastCache, req_id: str) -> tuple[int, int]:
    """:meth:`GpuFastCache.quiet_thresholds` computed from the request's table alone
    (no kept bounds): what the kept bounds must always equal."""
    t = gpu._tables[req_id]
    slots = comp = 1 << 62
    for g, (blocks, d) in enumerate(zip(t.lists, t.done, strict=True)):
        spec = gpu.layout.groups[g]
        bs = spec.tokens_per_block
        slots = min(slots, len(blocks) * bs + 1)
        if gpu.pool.enable_caching:   # the least t with cacheable_tokens(g, t) >= (d + 1) * bs
            x = (d + 1) * bs
            t_min = x
            while gpu.layout.cacheable_tokens(g, t_min) < x:
                t_min += 1
            slots = min(slots, t_min)
        if spec.kind is not GroupKind.FULL:
            comp = min(comp, gpu.next_skip(g, t.skipped[g]))
    return slots, comp


def make_req(layout: Layout, num_tokens: int, req_id: str = "r", base: int = 1) -> Req:
    return Req(req_id, list(range(base, base + num_tokens // layout.tokens_per_hash)), num_tokens)


@dataclass
class World:
    """Layout + CPU cache + GPU cache + scheduler, for one logic."""

    layout: Layout
    logic: str
    cpu: CpuChunkCache = field(init=False)
    gpu: GpuKVCache = field(init=False)
    sched: OffloadingScheduler = field(init=False)
    capacity: int = 100
    gpu_blocks: int = 4096

    def __post_init__(self) -> None:
        self.cpu = CpuChunkCache(self.capacity)
        self.gpu = GpuKVCache(self.layout, self.gpu_blocks)
        self.sched = OffloadingScheduler(self.layout, self.cpu, profile(self.logic))

    def key(self, req: Req, g: int, j: int) -> OffloadKey:
        hpc = self.layout.hashes_per_chunk[g]
        return offload_key(req.block_hashes[(j + 1) * hpc - 1], g)

    def store(self, req: Req, g: int, chunks: range | list[int], complete: bool = True) -> None:
        keys = [self.key(req, g, j) for j in chunks]
        assert self.cpu.prepare_store(keys) is not None
        if complete:
            self.cpu.complete_store(keys)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- processes (signal and orphan tests; Linux /proc) -------------------------------------------


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """Live child processes of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None and st[1] == pid and st[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return out


# -- small sweeps ------------------------------------------------------------------------------

#: a sweep/1 base of seconds-long uniform runs on the hybrid-demo model (no [sweep] table)
SWEEP_BASE = """schema = "sweep/1"
name = "t"
[model]
name = "hybrid-demo"
[hardware]
gpu_kv_bytes = "1GiB"
[cpu_cache]
capacity = "1GiB"
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
#: the same, swept over the two eviction policies
SWEEP_POLICIES = SWEEP_BASE + '[sweep]\ngrid = { "cpu_cache.policy" = ["lru", "arc"] }\n'


#: the vLLM releases the real-vLLM tests use, and the window logic each is
VLLM_LOGIC_OF = {"0.29.0": "old", "0.30.0": "new", "0.33.0": "latest"}


def vllm_venvs() -> dict[str, Path]:
    """``$KVSIM_VLLM_VENVS`` (``VERSION=VENV`` pairs, comma-separated; .ci/run sets it)."""
    text = os.environ.get("KVSIM_VLLM_VENVS", "")
    out: dict[str, Path] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        version, _, path = item.partition("=")
        out[version] = Path(path)
    return out


#: a run/1 scenario of one full-attention group, 16 chat sessions spread out so that no
#: admission waits for blocks, CPU hits in the run (kvsim fidelity and the real-vLLM tests)
QUIET_FULL_ATTENTION = """
schema = "run/1"
name = "quiet"
[model]
label = "full16"
groups = [{ kind = "full", tokens_per_block = 16, layers = 2, kv_heads = 1, head_size = 8, dtype = "fp16" }]
[hardware]
gpu_blocks = 1200
[cpu_cache]
chunks = 3000
[scheduler]
blocks_per_chunk = 4
tokens_per_hash = 16
max_num_batched_tokens = 2048
[workload]
kind = "multiturn"
sessions = 16
session_rate_per_s = 0.2
think_time_mean_s = 30.0
max_context_tokens = 8000
output_tokens_mean = 40
[costs]
step = { overhead_s = 0.005, prefill_token_s = 1e-5, decode_seq_s = 1e-4, context_token_s = 1e-7 }
transfer = "hardware"
"""
