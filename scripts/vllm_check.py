"""Decide check/1 scenarios with a real vLLM's scheduler-side objects.

For each check/1 case this builds, inside an installed vLLM (CPU only, see
scripts/install-vllm-cpu.sh):

* the KV cache groups as vLLM KV cache specs (full attention, sliding
  window with its ``extra_retained_tokens``, chunked local attention; EAGLE
  groups flagged as drafter groups),
* vLLM's GPU ``KVCacheManager`` (its block pool and per-kind managers), with
  the local prefix hit put into its prefix cache by an earlier request that
  shares the first ``gpu_computed_tokens`` tokens,
* vLLM's ``CPUOffloadingManager`` (LRU) holding the stated chunk states
  (present: stored; pending: store not completed; loading: stored and being
  loaded by another request; retry: absent, the lookup answers RETRY),
* the ``OffloadingConnectorScheduler`` (scheduler side of the connector),

then runs one new request through the calls the core scheduler makes:
``get_num_new_matched_tokens``, ``allocate_slots`` (asynchronous load, no new
tokens) and ``update_state_after_alloc``, and reports the outcome in the shape
of ``kvsim check --json``: external_tokens (None: deferred), load_async,
load_keys, group_sizes, block_indices, crash, hazards.

Run it with the vLLM environment's Python and kvsim on the path:

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/work/main \\
        /tmp/venv-vllm-0.33.0/bin/python scripts/vllm_check.py scenarios/crash/*.toml

Options: ``--json`` prints one JSON object per case ({"file", "vllm", "outcome"
or "error"}); ``--batch FILE`` reads a JSON list (or JSON Lines) of check/1
objects instead of files (scripts/fuzz_batch.py writes one from the fuzzer's
random scenarios); ``--expect LOGIC`` compares each outcome with the file's
``[expect.LOGIC]`` (exit 1 on a mismatch); ``--toml LOGIC`` prints an
``[expect.LOGIC]`` table per case (what a library file would state);
``--against LOGIC`` compares every outcome field with kvsim's own decision
under LOGIC (exit 1 on a difference).

Not supported (reported as an error of the case): Mamba groups (their
copy-on-write partial tails have no check/1 counterpart).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as offsched
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload import base as offbase
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request

from sim.io.check import CheckCase, compare, load_check_file, parse_check, run_check

VERSION = vllm.__version__
LookupResult = offbase.LookupResult

try:  # 0.33 computes the window in chunks when it builds the offloading config
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks as _window_in_chunks,
    )
except ImportError:  # 0.30: the scheduler module computes it itself
    _window_in_chunks = offsched.get_sliding_window_size_in_chunks  # type: ignore[attr-defined]

_NOT_FOUND = "not found"
_NOT_READY = "not ready"


class UnsupportedError(Exception):
    """The case uses something this harness does not build."""


def _kv_spec(g: Any) -> Any:
    common = {"block_size": g.tokens_per_block, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    kind = str(g.kind)
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=g.window,
                                 extra_retained_tokens=g.extra_retained_tokens)
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=g.attention_chunk)
    if kind == "mamba":
        return MambaSpec(block_size=g.tokens_per_block, shapes=((1,),), dtypes=(torch.float16,),
                         mamba_cache_mode="align")
    raise UnsupportedError(f"group kind {kind} is not built by this harness")


class _Spec:
    """The attributes of an ``OffloadingSpec`` the connector's scheduler side
    reads, with vLLM's own ``CPUOffloadingManager`` behind ``get_manager``."""

    def __init__(self, case: CheckCase, kv_specs: list[Any], capacity: int) -> None:
        bpc = case.blocks_per_chunk
        groups = []
        for i, (g, spec) in enumerate(zip(case.groups, kv_specs, strict=True)):
            groups.append(SimpleNamespace(
                group_id=i, tokens_per_block=g.tokens_per_block, layer_names=(f"layer.{i}",),
                sliding_window_size_in_chunks=_window_in_chunks(spec, g.tokens_per_block * bpc)))
        self.config = SimpleNamespace(groups=tuple(groups))
        self.extra_config: dict[str, Any] = {}
        self.kv_events_config = offbase.OffloadingKVEventsConfig(
            enable_kv_cache_events=False, self_describing_kv_events=False)
        self.offload_prompt_only = True
        self.tokens_per_block = tuple(g.tokens_per_block for g in case.groups)
        self.tokens_per_hash = case.tokens_per_hash
        self.blocks_per_chunk = bpc
        self.manager = CPUOffloadingManager(capacity)  # num_chunks (num_blocks in 0.29)

    def get_manager(self) -> CPUOffloadingManager:
        return self.manager


def _vllm_config(case: CheckCase) -> Any:
    eagle = any(g.eagle for g in case.groups)
    spec_cfg = SimpleNamespace(use_eagle_block_drop=lambda: True, use_eagle=lambda: True) if eagle else None
    return SimpleNamespace(
        speculative_config=spec_cfg,
        parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(enable_prefix_caching=case.prefix_caching,
                                     prefix_cache_retention_interval=None),
    )


def _request(req_id: str, tokens: list[int], hasher: Any) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def _ctx(req_id: str) -> Any:
    return offbase.ReqContext(req_id=req_id)


def _gpu_side(case: CheckCase, kv_groups: list[Any]) -> tuple[KVCacheManager, KVCacheConfig]:
    """vLLM's KV cache manager over one shared block pool; and the connector's config."""
    n, tph = case.num_tokens, case.tokens_per_hash
    bss = [g.tokens_per_block for g in case.groups]
    num_blocks = 16 + 4 * sum(math.ceil(n / bs) for bs in [*bss, tph])
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_groups)
    gpu_config = kv_config
    if len(kv_groups) == 1 and bss[0] != tph and case.prefix_caching:
        # vLLM hashes a single group at its own block size; a check hashes at
        # tokens_per_hash. The GPU side gets a second (full attention, one hash
        # block per block) group that the connector never sees, so that both agree.
        dummy = KVCacheGroupSpec(["layer.gpu-only"], FullAttentionSpec(
            block_size=tph, num_kv_heads=1, head_size=8, dtype=torch.float16))
        gpu_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                   kv_cache_groups=[*kv_groups, dummy])
        bss = [*bss, tph]
    gpu = KVCacheManager(gpu_config, max_model_len=n + 64, scheduler_block_size=math.lcm(*bss),
                         hash_block_size=tph, enable_caching=case.prefix_caching)
    return gpu, kv_config


def _local_hit(case: CheckCase, gpu: KVCacheManager, req: Request, tokens: list[int], hasher: Any) -> Any:
    """The cached blocks of the stated local hit, put into vLLM's prefix cache
    by an earlier request that computed the same first tokens (and one of its own)."""
    local = case.gpu_computed_tokens
    if not local:
        # the connector's decisions do not depend on the GPU prefix-cache
        # lookup (which vLLM refuses for some layouts)
        return gpu.empty_kv_cache_blocks
    seed = _request("seed", [*tokens[:local], 7], hasher)
    if gpu.allocate_slots(seed, local + 1) is None:
        raise RuntimeError("GPU pool too small for the seed request")
    gpu.free(seed)
    try:
        blocks, found = gpu.get_computed_blocks(req)[:2]
    except AssertionError as exc:
        raise UnsupportedError(f"vLLM's GPU prefix cache refuses this layout: {exc}") from None
    if found != local:
        # e.g. 0.30 drops the last block of a hit for an EAGLE group: the
        # stated local hit is not one this vLLM produces
        raise UnsupportedError(f"vLLM's prefix cache finds {found} local tokens, the case states {local}")
    return blocks


class _Cpu:
    """The CPU offloading manager holding the stated chunk states, with the
    load plan captured where ``prepare_load`` is called."""

    def __init__(self, case: CheckCase, conn: Any, mgr: CPUOffloadingManager, hashes: list[Any]) -> None:
        self.conn, self.mgr = conn, mgr
        bpc, tph = case.blocks_per_chunk, case.tokens_per_hash
        self.key_of: dict[tuple[int, int], bytes] = {}
        self.gj_of: dict[bytes, tuple[int, int]] = {}
        for g, grp in enumerate(case.groups):
            hpc = grp.tokens_per_block * bpc // tph
            for j in range(case.num_tokens // (grp.tokens_per_block * bpc)):
                key = offbase.make_offload_key(hashes[(j + 1) * hpc - 1], g)
                self.key_of[(g, j)] = key
                self.gj_of[key] = (g, j)
        self.seen: dict[str, Any] = {}
        self._place({(g, j): st for g, j, st in case.states})
        self._real_prepare_load = mgr.prepare_load
        mgr.prepare_load = self._prepare_load  # type: ignore[method-assign]

    def _place(self, states: dict[tuple[int, int], str]) -> None:
        mgr, other = self.mgr, _ctx("other")
        mgr.on_new_request(other)
        ordered = sorted(states)

        def keys(*names: str) -> list[bytes]:
            return [self.key_of[gj] for gj in ordered if states[gj] in names]

        stored = keys("present", "pending", "loading")
        if stored:
            out = mgr.prepare_store(stored, other)
            if out is None or len(out.keys_to_store) != len(stored):
                raise RuntimeError("could not place the stated chunks")
        mgr.complete_store(keys("present", "loading"), other)
        loading = keys("loading")
        if loading:  # ready, pinned by another request's load
            mgr.prepare_load(loading, other)
            if self.conn._chunks_being_loaded is not None:
                self.conn._chunks_being_loaded.update(loading)
        retry = set(keys("retry"))
        if retry:  # absent; an asynchronous tier would answer RETRY
            real_lookup = mgr.lookup

            def lookup(key: Any, ctx: Any) -> Any:
                return LookupResult.RETRY if key in retry else real_lookup(key, ctx)

            mgr.lookup = lookup  # type: ignore[method-assign]

    def _prepare_load(self, keys: Any, ctx: Any) -> Any:
        caller = sys._getframe(1).f_locals  # update_state_after_alloc's plan so far
        keys = list(keys)
        loading = self.conn._chunks_being_loaded
        policy = self.mgr._policy
        self.seen.update(
            keys=keys,
            group_sizes=list(caller.get("group_sizes", [])),
            block_indices=list(caller.get("block_indices", [])),
            double=[self.gj_of[k] for k in keys if loading is not None and k in loading],
            first_bad=next((self.gj_of[k] for k in keys
                            if (c := policy.get(k)) is None or not c.is_ready), None))
        return self._real_prepare_load(keys, ctx)

    def fill(self, out: dict[str, Any]) -> None:
        seen = self.seen
        out["load_keys"] = sorted([*self.gj_of[k]] for k in seen["keys"])
        out["group_sizes"] = seen["group_sizes"]
        out["block_indices"] = seen["block_indices"]
        out["hazards"] = [{"kind": "double_load", "group": g, "chunk": j} for g, j in seen["double"]]


def decide(case: CheckCase) -> dict[str, Any]:
    """The outcome of ``case`` under the installed vLLM (kvsim check's shape)."""
    kv_specs = [_kv_spec(g) for g in case.groups]
    kv_groups = [KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=g.eagle)
                 for i, (g, spec) in enumerate(zip(case.groups, kv_specs, strict=True))]
    gpu, kv_config = _gpu_side(case, kv_groups)
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(case.tokens_per_hash, sha256)
    tokens = [1000 + i for i in range(case.num_tokens)]
    req = _request("check", tokens, hasher)
    computed_blocks = _local_hit(case, gpu, req, tokens, hasher)
    capacity = case.cpu_capacity_chunks or max(100, len(case.states))
    spec = _Spec(case, kv_specs, capacity)
    conn = offsched.OffloadingConnectorScheduler(spec, _vllm_config(case), kv_config)
    cpu = _Cpu(case, conn, spec.manager, req.block_hashes)

    local = case.gpu_computed_tokens
    conn.on_new_request(req)
    ext, load_async = conn.get_num_new_matched_tokens(req, local)
    out: dict[str, Any] = {"external_tokens": ext, "load_async": False, "load_keys": [], "group_sizes": [],
                           "block_indices": [], "crash": None, "hazards": []}
    if not ext:
        return out
    blocks = gpu.allocate_slots(req, 0, num_new_computed_tokens=local, new_computed_blocks=computed_blocks,
                                num_external_computed_tokens=ext, delay_cache_blocks=bool(load_async))
    if blocks is None:
        raise RuntimeError("GPU allocation failed")
    try:
        conn.update_state_after_alloc(req, gpu.get_blocks(req.request_id), ext)
    except AssertionError as exc:
        msg = str(exc)
        if "keys" in cpu.seen and (_NOT_FOUND in msg or _NOT_READY in msg):
            g, j = cpu.seen["first_bad"] or (None, None)
            kind = "missing_chunk" if _NOT_FOUND in msg else "chunk_not_ready"
            out["crash"] = {"kind": kind, "group": g, "chunk": j, "message": msg}
            cpu.fill(out)
        else:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            msg = msg or f"assert at {Path(where.filename).name}:{where.lineno}: {where.line}"
            out["crash"] = {"kind": "assertion", "group": None, "chunk": None, "message": msg}
        return out
    out["load_async"] = True
    cpu.fill(out)
    return out


def differences(vllm_out: dict[str, Any], kvsim_out: dict[str, Any]) -> list[str]:
    """Where kvsim's outcome differs from vLLM's: every field, the crash by kind
    (and by group and chunk for the two ``prepare_load`` assertions), hazards
    by kind, group and chunk."""
    def crash(o: dict[str, Any]) -> Any:
        c = o["crash"]
        if c is None:
            return None
        return c["kind"] if c["kind"] == "assertion" else [c["kind"], c["group"], c["chunk"]]

    def hazards(o: dict[str, Any]) -> Any:
        return sorted([h["kind"], h["group"], h["chunk"]] for h in o["hazards"])

    diffs = []
    for key in ("external_tokens", "load_async", "load_keys", "group_sizes", "block_indices"):
        if vllm_out[key] != kvsim_out[key]:
            diffs.append(f"{key}: vllm {json.dumps(vllm_out[key])}, kvsim {json.dumps(kvsim_out[key])}")
    for name, fn in (("crash", crash), ("hazards", hazards)):
        if fn(vllm_out) != fn(kvsim_out):
            diffs.append(f"{name}: vllm {json.dumps(fn(vllm_out))}, kvsim {json.dumps(fn(kvsim_out))}")
    return diffs


def expectation(outcome: dict[str, Any]) -> dict[str, Any]:
    """An ``[expect.<logic>]`` table pinning ``outcome`` (the library's conventions)."""
    e: dict[str, Any] = {}
    if outcome["external_tokens"] is None:
        e["deferred"] = True
    else:
        e["external_tokens"] = outcome["external_tokens"]
    crash = outcome["crash"]
    e["crash"] = crash["kind"] if crash else "none"
    e["load_async"] = outcome["load_async"]
    if crash is None or crash["kind"] != "assertion":
        e["load_keys"] = outcome["load_keys"]
        e["group_sizes"] = outcome["group_sizes"]
        e["block_indices"] = outcome["block_indices"]
    e["hazards"] = sorted({h["kind"] for h in outcome["hazards"]})
    return e


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return str(v)


def _items(args: argparse.Namespace) -> list[tuple[str, Any]]:
    if args.batch:
        path = Path(args.batch)
        text = path.read_text()
        if text.lstrip().startswith("["):
            data = json.loads(text)
        else:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [(f"{path}[{i}]", d) for i, d in enumerate(data)]
    out: list[tuple[str, Any]] = []
    for f in args.files:
        try:
            out.append((f, load_check_file(Path(f))[1][0]))
        except Exception as exc:  # reported as that case's error
            out.append((f, exc))
    return out


class _Tally:
    """Counts over the cases, and the per-case checks (--against, --expect)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.failed = False
        self.agree = self.total = self.same = self.compared = self.unsupported = 0

    def against(self, source: str, data: Any, sc: Any, out: dict[str, Any]) -> None:
        logic = self.args.against
        self.compared += 1
        diffs = differences(out, run_check(sc.case(source), logic))
        self.same += not diffs
        self.failed = self.failed or bool(diffs)
        if diffs:
            print(f"{source}: vllm {VERSION} vs kvsim {logic}: DIFFER: " + "; ".join(diffs))
            print(f"    case: {json.dumps(data)}")

    def expect(self, source: str, sc: Any, out: dict[str, Any]) -> list[str]:
        exp = sc.expect.get(self.args.expect)
        if exp is None:
            return []
        self.total += 1
        diffs = compare(exp, out)
        self.agree += not diffs
        self.failed = self.failed or bool(diffs)
        if diffs and self.args.quiet:
            print(f"{source}: [expect.{self.args.expect}] MISMATCH " + "; ".join(diffs))
        return diffs

    def totals(self) -> None:
        args = self.args
        if args.expect and not args.json:
            print(f"vllm {VERSION}: {self.agree} of {self.total} expectations [{args.expect}] agree")
        if args.against:
            print(f"vllm {VERSION} vs kvsim --logic {args.against}: {self.same} of {self.compared} cases "
                  f"agree in every field ({self.unsupported} unsupported cases skipped)")


def _show(args: argparse.Namespace, source: str, out: dict[str, Any], diffs: list[str]) -> None:
    if args.json:
        print(json.dumps({"file": source, "vllm": VERSION, "outcome": out, "mismatch": diffs}))
    elif args.toml:
        print(f"# {source}\n[expect.{args.toml}]")
        for k, v in expectation(out).items():
            print(f"{k} = {_toml(v)}")
        print()
    else:
        ext = "deferred" if out["external_tokens"] is None else f"{out['external_tokens']} tokens"
        crash = out["crash"]["kind"] if out["crash"] else "no crash"
        verdict = "" if not args.expect else ("  MISMATCH " + "; ".join(diffs) if diffs else "  ok")
        print(f"{source} [vllm {VERSION}] {ext}, {crash}, load {len(out['load_keys'])} chunks "
              f"sizes {out['group_sizes']} firsts {out['block_indices']}{verdict}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="check/1 files (TOML or JSON)")
    p.add_argument("--batch", metavar="FILE", help="a JSON list or JSON Lines of check/1 objects")
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    p.add_argument("--expect", metavar="LOGIC", help="compare with [expect.LOGIC]; exit 1 on a mismatch")
    p.add_argument("--toml", metavar="LOGIC", help="print an [expect.LOGIC] table per case")
    p.add_argument("--against", metavar="LOGIC",
                   help="compare every field with kvsim's own decision under LOGIC; exit 1 on a difference")
    p.add_argument("--quiet", "-q", action="store_true", help="print only differences, mismatches and totals")
    args = p.parse_args(argv)
    tally = _Tally(args)
    for source, data in _items(args):
        try:
            if isinstance(data, Exception):
                raise data
            sc = parse_check(data, source)
            out = decide(sc.case(source))
        except UnsupportedError as exc:
            tally.unsupported += 1
            if not args.quiet:
                print(json.dumps({"file": source, "vllm": VERSION, "unsupported": str(exc)}) if args.json
                      else f"{source}: unsupported: {exc}")
            continue
        except Exception as exc:  # one case's failure must not stop the others
            tally.failed = True
            print(json.dumps({"file": source, "vllm": VERSION, "error": repr(exc)}) if args.json
                  else f"{source}: ERROR {exc!r}")
            continue
        if args.against:
            tally.against(source, data, sc, out)
        diffs = tally.expect(source, sc, out) if args.expect else []
        if not args.quiet:
            _show(args, source, out, diffs)
    tally.totals()
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
