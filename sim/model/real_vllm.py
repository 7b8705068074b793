"""Real vLLM as the decision maker (``decisions = "vllm"``): its v1 scheduler, clock-free.

What it models
    Nothing of its own: every scheduling and KV decision comes from the vLLM
    installed in the environment (0.29.0, 0.30.0 and 0.33.0 supported; others
    tried, with a warning). :class:`RealVllmScheduler` builds, on CPU and
    without model weights:

    * vLLM's v1 ``Scheduler`` (waiting queue, token budget, chunked prefill,
      preemption) with its ``KVCacheManager`` (one block pool shared by the
      layout's groups; the per-kind managers; the prefix cache), from a tiny
      local ``config.json`` (the model's shapes do not matter to the
      scheduler; kvsim's layout gives the KV cache groups);
    * vLLM's ``OffloadingConnector``, scheduler side, with vLLM's own
      ``CPUOffloadingManager`` (LRU or ARC) of the scenario's capacity
      (:class:`sim.model.vllm_spec.KvsimOffloadingSpec`);
    * vLLM's ``OffloadingConnector``, worker side, with kvsim's worker
      (:class:`sim.model.vllm_spec.SimulatedWorker`): vLLM's own code decides
      when a store is submitted (deferred to the next step), what is flushed
      and waited for; kvsim only times the jobs.

    The engine (:mod:`sim.engine.vllm_engine`) keeps kvsim's clock, arrivals,
    step-time and transfer models. One step is vLLM's: ``schedule()``, the
    worker connector's ``handle_preemptions`` / ``start_load_kv`` /
    ``wait_for_save`` / ``get_finished``, the forward pass (kvsim's step
    time), then ``update_from_output`` with one sampled token per request
    whose prefill is complete and the transfer completions as connector
    output.

    Requests carry no token ids in kvsim (a block's content is its hash): the
    prompt is a run of one token id, and each request's block hasher returns
    kvsim's hashes of the workload, so vLLM's prefix cache and offload keys
    see exactly the sharing kvsim's model sees.

Simplifications (of the driving, not of vLLM's decisions)
    * Too-long requests: vLLM refuses at start-up a ``max_model_len`` its KV
      cache cannot hold, and its input processor rejects longer prompts. kvsim
      sets ``max_model_len`` to the longest request one pool can hold (each
      group's worst case with a full ``max_num_batched_tokens`` chunk,
      :func:`sim.model.scheduler.max_model_len`) and rejects longer requests on
      arrival, as kvsim's own model does.
    * A vLLM assertion (the modelled crash) leaves vLLM's state undefined:
      the run stops there (``stopped_on_crash``) whatever ``on_crash`` says;
      the crash is an ``events`` row and the request's ``crash`` column.
    * Synchronous scheduling (no async scheduling, no speculative decoding
      tokens), greedy single-token outputs with ``ignore_eos``.
    * vLLM is configured for what kvsim's model implements, where its own default
      differs: ``prefix_cache_retention_interval = None`` (dense sliding-window
      checkpoints) and, with prefix caching, ``mamba_cache_mode = "all"`` where the
      release has it (0.29, 0.30; vLLM's default and 0.33's only such mode is
      ``"align"``, not modelled: docs/vllm.md, finding 13).
    * A completed transfer's chunks reach vLLM's CPU manager in the order the
      job was prepared in, not in the per-process order of vLLM's ``set`` of
      keys (see :meth:`RealVllmScheduler._watch_manager`).

Invariants
    * :meth:`RealVllmScheduler.invariant_problems` at the end of a completed
      run: no request left, every GPU block free or cached, no transfer job
      left in vLLM's connector.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import sys
import tempfile
import traceback
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.errors import THE_SCENARIO, InputError
from sim.model.costs import StepLoad, pieces_per_block
from sim.model.layout import GroupKind
from sim.model.request import LiveRequest, Request, RequestStatus
from sim.model.scheduler import (
    MAX_POSITIONS,
    AttendedContext,
    ModelEvent,
    SchedulerConfig,
    SchedulerHooks,
    SchedulerStats,
    max_model_len,
    reject_too_long,
)

__all__ = ["SUPPORTED_VERSIONS", "RealStep", "RealVllmScheduler", "VllmMissingError", "installed_version"]

#: the vLLM releases this mode is tested against (window logic each corresponds to)
SUPPORTED_VERSIONS = {"0.29.0": "old", "0.30.0": "new", "0.33.0": "latest"}

INSTALL_HINT = ("decisions = \"vllm\" needs vLLM in this Python environment: "
                "bash scripts/install-vllm-cpu.sh 0.30.0 (or 0.29.0, 0.33.0), then run kvsim with that "
                "environment's Python (docs/vllm.md)")


class VllmMissingError(ImportError):
    """vLLM cannot be imported here (the message is the one-line install hint)."""


def installed_version() -> str:
    """The installed vLLM's version, without importing its heavy modules.

    Raises:
        VllmMissingError: vLLM is not installed.
    """
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise VllmMissingError(INSTALL_HINT) from None


#: the names this module uses: short name -> (module, attribute; None: the module itself)
_NAMES = {
    "torch": ("torch", None),
    "CacheConfig": ("vllm.config", "CacheConfig"),
    "DeviceConfig": ("vllm.config", "DeviceConfig"),
    "KVTransferConfig": ("vllm.config", "KVTransferConfig"),
    "ModelConfig": ("vllm.config", "ModelConfig"),
    "VSchedulerConfig": ("vllm.config", "SchedulerConfig"),
    "VllmConfig": ("vllm.config", "VllmConfig"),
    "KVConnectorRole": ("vllm.distributed.kv_transfer.kv_connector.v1", "KVConnectorRole"),
    "OffloadingConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
                            "OffloadingConnector"),
    "ForwardContext": ("vllm.forward_context", "ForwardContext"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "resolve_kv_cache_block_sizes": ("vllm.v1.core.kv_cache_utils", "resolve_kv_cache_block_sizes"),
    "VScheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "ChunkedLocalAttentionSpec": ("vllm.v1.kv_cache_interface", "ChunkedLocalAttentionSpec"),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "KVCacheGroupSpec": ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"),
    "MambaSpec": ("vllm.v1.kv_cache_interface", "MambaSpec"),
    "MambaCacheMode": ("vllm.config.cache", "MambaCacheMode"),
    "SlidingWindowSpec": ("vllm.v1.kv_cache_interface", "SlidingWindowSpec"),
    "KVConnectorOutput": ("vllm.v1.outputs", "KVConnectorOutput"),
    "ModelRunnerOutput": ("vllm.v1.outputs", "ModelRunnerOutput"),
    "VRequest": ("vllm.v1.request", "Request"),
    "StructuredOutputManager": ("vllm.v1.structured_output", "StructuredOutputManager"),
}


def _import_vllm() -> dict[str, Any]:
    """The vLLM names this module uses (imported on CPU, quietly)."""
    installed_version()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # its logs go to stdout, which is kvsim's (--json); harmless CPU-only import errors (Triton) too
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out: dict[str, Any] = {}
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        try:
            for key, (module, attr) in _NAMES.items():
                mod = importlib.import_module(module)
                out[key] = mod if attr is None else getattr(mod, attr)
        except (ImportError, AttributeError) as exc:
            raise VllmMissingError(f"vLLM is installed but does not import ({exc}); "
                                   + INSTALL_HINT) from None
    return out


@dataclass
class RealStep:
    """One step of the real scheduler, between ``schedule`` and ``update_from_output``."""

    output: Any
    #: the step model's input (:class:`~sim.model.costs.StepLoad`)
    load: StepLoad = field(default_factory=StepLoad)
    scheduled: int = 0
    preempted: int = 0
    loads: int = 0
    stores: int = 0
    #: a vLLM assertion stopped the run in ``schedule`` (nothing else is set)
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class RealJob:
    """A transfer job vLLM's worker connector submitted."""

    job_id: int
    req_id: str
    direction: str
    chunks: int
    blocks: int
    nbytes: int
    #: separate copies vLLM makes (:func:`sim.model.costs.pieces_per_block`)
    pieces: int = 0


@dataclass
class _Track:
    """What kvsim records about one request (its row), beside vLLM's ``Request``."""

    live: LiveRequest
    hashes: list[bytes] = field(default_factory=list)


def _tiny_model_dir() -> str:
    """A local Hugging Face config vLLM's ``ModelConfig`` accepts offline (shapes unused)."""
    root = Path(tempfile.gettempdir()) / "kvsim-vllm-model"
    cfg = root / "config.json"
    if not cfg.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".config-{os.getpid()}.json"
        tmp.write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
            "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": MAX_POSITIONS,
            "rms_norm_eps": 1e-5, "torch_dtype": "float16", "eos_token_id": 2, "bos_token_id": 1}))
        tmp.replace(cfg)
    return str(root)


class _InOrder(set):  # type: ignore[type-arg]
    """A set that iterates in a given order (see :meth:`RealVllmScheduler._order_finishes`)."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self._order = items

    def __iter__(self) -> Any:
        return iter(self._order)


class RealVllmScheduler:
    """vLLM's scheduler and offloading connector behind kvsim's engine.

    Args:
        cfg: the scheduler's share of the engine configuration (layout, pool,
            budget, prefix caching, CPU capacity and policy).
        hooks: ``event`` receives crash and rejection rows, ``release`` a
            request that is done.
    """

    def __init__(self, cfg: SchedulerConfig, hooks: SchedulerHooks) -> None:
        v = self._v = _import_vllm()
        self.version = installed_version()
        self.cfg, self.hooks = cfg, hooks
        self.layout = layout = cfg.layout
        self.stats = SchedulerStats()
        self.reproducers: list[Any] = []
        self.requests: dict[str, LiveRequest] = {}
        self._tracks: dict[str, _Track] = {}
        self.running: list[LiveRequest] = []
        self.now = 0.0
        self.context = AttendedContext(layout)
        self.max_model_len = max_model_len(layout, cfg.gpu_blocks, cfg.max_num_batched_tokens,
                                           prefix_caching=cfg.prefix_caching)
        try:   # vLLM validates the configuration here: a refusal is bad input, said in one line
            kv_config = self._kv_cache_config()
            vcfg = self._vllm_config()
            vcfg.cache_config.num_gpu_blocks = cfg.gpu_blocks
            block_size, hash_size = v["resolve_kv_cache_block_sizes"](kv_config, vcfg)
            self.sched = v["VScheduler"](vllm_config=vcfg, kv_cache_config=kv_config, log_stats=False,
                                         structured_output_manager=v["StructuredOutputManager"](vcfg),
                                         block_size=block_size, hash_block_size=hash_size)
        except Exception as exc:   # an AssertionError, ValueError or pydantic's ValidationError
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise InputError(THE_SCENARIO, "decisions",
                             f"vLLM {self.version} refuses this configuration: {why[:300]}",
                             'a configuration vLLM accepts, or decisions = "model"') from None
        self._drop_eagle_blocks()
        if hash_size % layout.tokens_per_hash:
            raise InputError(THE_SCENARIO, "scheduler.tokens_per_hash",
                             f"vLLM {self.version} hashes {hash_size}-token blocks for this layout; "
                             f"{layout.tokens_per_hash} does not divide it", f"a divisor of {hash_size}")
        self.hash_size = hash_size
        self._per_hash = hash_size // layout.tokens_per_hash
        #: the connector's lookups, (request, local hit tokens, external tokens or None, async),
        #: appended while a list (as :attr:`sim.model.scheduler.Scheduler.lookup_log`)
        self.lookup_log: list[tuple[str, int, int | None, bool]] | None = None
        #: the CPU manager's evicted keys, appended while a list (the differential mode)
        self.evicted_log: list[bytes] | None = None
        self.worker: Any = None
        self.wconn: Any = None
        self.conn_sched: Any = None
        if cfg.offloading:
            from sim.model.vllm_spec import SimulatedWorker  # noqa: PLC0415 -- imports vLLM

            self.worker = SimulatedWorker()
            self.wconn = v["OffloadingConnector"](vcfg, v["KVConnectorRole"].WORKER, kv_config)
            self.wconn.connector_worker.worker = self.worker
            self.conn_sched = self.sched.connector.connector_scheduler
            self._watch_lookups()
            self._watch_manager()
            self._order_finishes()
        self._fctx = v["ForwardContext"](no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._group_bytes = [layout.kv_bytes_per_block(i) or 0 for i in range(len(layout.groups))]
        self._block_pieces = [pieces_per_block(g, cfg.transfer_piece) for g in layout.groups]
        self._jobs: dict[int, RealJob] = {}
        #: jobs in the connector's metadata, not yet submitted by the worker
        self._planned: dict[int, RealJob] = {}
        #: finished in the last step: released at the next schedule (their final stores built)
        self._finishing: list[LiveRequest] = []

    def _kv_cache_config(self) -> Any:
        """vLLM's KV cache config: one group per layout group, one block pool (toy tensor shapes:
        the scheduler reads block sizes and kinds, and compares specs to merge groups for its
        lookup; kvsim's layout gives the bytes)."""
        v, cfg = self._v, self.cfg
        f16 = v["torch"].float16
        specs = []
        # groups of one spec class get equal specs; two classes alike but for their shapes
        # get different head sizes: vLLM looks up as one the groups kvsim's model does
        # (Layout.hit_groups)
        nth: dict[tuple[object, ...], dict[int, int]] = {}
        for g, cls in zip(self.layout.groups, self.layout.spec_classes, strict=True):
            alike = nth.setdefault(g.attention_key, {})
            k = alike.setdefault(cls, len(alike)) + 1
            common = {"block_size": g.tokens_per_block, "num_kv_heads": 1, "head_size": 8 * k, "dtype": f16}
            if g.kind is GroupKind.SLIDING_WINDOW:
                kw: dict[str, Any] = {"sliding_window": g.window}
                if g.extra_retained_tokens:
                    kw["extra_retained_tokens"] = g.extra_retained_tokens
                specs.append(v["SlidingWindowSpec"](**common, **kw))
            elif g.kind is GroupKind.CHUNKED_LOCAL:
                specs.append(v["ChunkedLocalAttentionSpec"](**common, attention_chunk_size=g.attention_chunk))
            elif g.kind is GroupKind.MAMBA:
                specs.append(v["MambaSpec"](block_size=g.tokens_per_block, shapes=((k,),), dtypes=(f16,),
                                            mamba_cache_mode=self._mamba_mode()))
            else:
                specs.append(v["FullAttentionSpec"](**common))
        groups = [v["KVCacheGroupSpec"]([f"layer.{i}"], s, **({"is_eagle_group": True} if g.eagle else {}))
                  for i, (g, s) in enumerate(zip(self.layout.groups, specs, strict=True))]
        return v["KVCacheConfig"](num_blocks=cfg.gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups)

    def _drop_eagle_blocks(self) -> None:
        """vLLM 0.33 drops the last block an EAGLE group's lookup matches (and hashes one
        block more) only with a speculative config (``use_eagle_block_drop``); 0.29 and 0.30
        do so for every group marked ``is_eagle_group``. kvsim models no speculative
        decoding, so it turns on 0.33's coordinator drop for the marked groups as such a
        config would, and leaves the rest of speculative decoding off, as with 0.29 and 0.30."""
        coord = self.sched.kv_cache_manager.coordinator
        marked: set[int] = getattr(coord, "eagle_group_ids", set())
        if not marked or getattr(coord, "drop_eagle_group_ids", None) != set():
            return
        coord.drop_eagle_group_ids = set(marked)
        if hasattr(coord, "attention_groups"):    # the hybrid coordinator: its lookup groups anew
            coord.verify_and_split_kv_cache_groups()
        else:
            coord.single_type_managers[0].use_eagle = 0 in marked

    def _mamba_mode(self) -> str:
        """vLLM's Mamba cache mode for the run: "all" (a state block per block, what kvsim's
        model allocates) where the installed vLLM has it, else "align" (vLLM 0.33, whose
        prefix caching requires it); "none" without prefix caching."""
        if not self.cfg.prefix_caching:
            return "none"
        return "all" if "all" in typing.get_args(self._v["MambaCacheMode"]) else "align"

    def _vllm_config(self) -> Any:
        """vLLM's config: a tiny local model, kvsim's budget and pool, the OffloadingConnector
        with kvsim's spec (vLLM's CPU manager of the scenario's capacity and policy)."""
        v, cfg, layout = self._v, self.cfg, self.layout
        extra = {"spec_name": "KvsimOffloadingSpec", "spec_module_path": "sim.model.vllm_spec",
                 "kvsim_num_chunks": max(1, cfg.cpu_capacity_chunks), "cpu_bytes_to_use": 1 << 30,
                 "blocks_per_chunk": layout.blocks_per_chunk, "eviction_policy": str(cfg.eviction.value),
                 "offload_prompt_only": cfg.offload_prompt_only}
        model = v["ModelConfig"](model=_tiny_model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0,
                                 max_model_len=self.max_model_len)
        sched_cfg = v["VSchedulerConfig"](max_num_seqs=cfg.max_num_seqs,
                                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                                          max_model_len=self.max_model_len, enable_chunked_prefill=True,
                                          is_encoder_decoder=False,
                                          scheduler_reserve_full_isl=cfg.reserve_full_isl)
        cache = v["CacheConfig"](block_size=layout.groups[0].tokens_per_block, gpu_memory_utilization=0.9,
                                 cache_dtype="auto", enable_prefix_caching=cfg.prefix_caching)
        # kvsim's model keeps sliding-window checkpoints densely (vLLM's None); vLLM's own
        # default, 0, keeps only the replay boundary and shared-prefix junctions (docs/vllm.md)
        cache.prefix_cache_retention_interval = None
        # kvsim's model allocates a Mamba state block per block, vLLM's "all" mode (0.29, 0.30);
        # with prefix caching vLLM's default is "align", the only mode 0.33 has (finding 13)
        cache.mamba_cache_mode = self._mamba_mode()
        transfer = v["KVTransferConfig"](kv_connector="OffloadingConnector", kv_role="kv_both",
                                         kv_connector_extra_config=extra) if cfg.offloading else None
        return v["VllmConfig"](model_config=model, scheduler_config=sched_cfg, cache_config=cache,
                               kv_transfer_config=transfer, device_config=v["DeviceConfig"]("cpu"))

    # -- observing vLLM (never deciding) ---------------------------------------------

    def _watch_lookups(self) -> None:
        """Count what the connector's lookup answered per request (hits, deferrals); keep the
        lookups while the differential mode asks for them."""
        conn = self.sched.connector
        real = conn.get_num_new_matched_tokens

        def lookup(request: Any, num_computed_tokens: int) -> Any:
            ext, load_async = real(request, num_computed_tokens)
            if self.lookup_log is not None:
                self.lookup_log.append((request.request_id, num_computed_tokens, ext, bool(load_async)))
            r = self.requests.get(request.request_id)
            if r is not None:
                if ext is None:
                    r.deferrals += 1
                    self.stats.deferrals += 1
                    if r.deferred_since is None:
                        r.deferred_since = self.now
                elif r.deferred_since is not None:
                    r.deferred_s += self.now - r.deferred_since
                    r.deferred_since = None
            return ext, load_async

        real_alloc = conn.update_state_after_alloc

        def after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            # the hit counts once the request got its blocks (a lookup may be repeated)
            r = self.requests.get(request.request_id)
            if r is not None and num_external_tokens:
                if r.preemptions:
                    r.cpu_reload_tokens += num_external_tokens
                    self.stats.cpu_reload_tokens += num_external_tokens
                else:
                    r.cpu_hit_tokens += num_external_tokens
                    self.stats.cpu_hit_tokens += num_external_tokens
            return real_alloc(request, blocks, num_external_tokens)

        conn.get_num_new_matched_tokens = lookup
        conn.update_state_after_alloc = after_alloc

    def _watch_manager(self) -> None:
        """Keep the CPU manager's evictions while the differential mode asks for them, and
        hand it a completed job's keys in a reproducible order.

        vLLM's connector hands a completed job's keys to its CPU manager as a ``set`` of
        bytes, whose order Python randomises per process (``PYTHONHASHSEED``): the order in
        which the chunks of one store become evictable, so which of them an LRU or ARC
        eviction takes first, would change from run to run. The manager gets them in the
        order the job was prepared in (as kvsim's model marks them), which makes the run
        deterministic."""
        mgr = self.conn_sched.manager
        real_store, real_load = mgr.prepare_store, mgr.prepare_load
        real_stored, real_loaded = mgr.complete_store, mgr.complete_load
        #: each key's place in the last store or load that named it (see :meth:`_job_order`)
        rank: dict[bytes, int] = {}

        def prepare_store(keys: Any, *args: Any, **kwargs: Any) -> Any:
            out = real_store(keys, *args, **kwargs)
            if out is not None:
                rank.update((k, i) for i, k in enumerate(out.keys_to_store))
                if self.evicted_log is not None:
                    self.evicted_log.extend(out.evicted_keys)
            return out

        def prepare_load(keys: Any, *args: Any, **kwargs: Any) -> Any:
            rank.update((k, i) for i, k in enumerate(keys))
            return real_load(keys, *args, **kwargs)

        def complete_store(keys: Any, *args: Any, **kwargs: Any) -> Any:
            return real_stored(sorted(keys, key=lambda k: rank.pop(k, 0)), *args, **kwargs)

        def complete_load(keys: Any, *args: Any, **kwargs: Any) -> Any:
            return real_loaded(sorted(keys, key=lambda k: rank.get(k, 0)), *args, **kwargs)

        mgr.prepare_store, mgr.prepare_load = prepare_store, prepare_load
        mgr.complete_store, mgr.complete_load = complete_store, complete_load

    def _order_finishes(self) -> None:
        """Hand vLLM 0.33's connector the requests finished in a step in the order they
        finished.

        From 0.33 on, the connector commits each finished request's chunks to the CPU
        manager's policy (fresh recency ranks) while walking the step's
        ``finished_req_ids``, a ``set`` of strings whose order Python randomises per
        process: which request's chunks end up older, so which an eviction takes,
        would change from run to run. The set is replaced by one that iterates in the
        order ``request_finished`` saw the requests (as kvsim's model commits them),
        which makes the run deterministic; earlier versions never iterate it there."""
        cs = self.conn_sched
        real_finished, real_meta = cs.request_finished, cs.build_connector_meta
        seen: dict[str, int] = {}
        tick = itertools.count()

        def request_finished(request: Any, *args: Any, **kwargs: Any) -> Any:
            seen.setdefault(request.request_id, next(tick))
            return real_finished(request, *args, **kwargs)

        def build_connector_meta(out: Any, *args: Any, **kwargs: Any) -> Any:
            ids = out.finished_req_ids
            if ids and len(ids) > 1:
                out.finished_req_ids = _InOrder(sorted(ids, key=lambda r: seen.get(r, -1)))
            return real_meta(out, *args, **kwargs)

        cs.request_finished, cs.build_connector_meta = request_finished, build_connector_meta

    # -- requests ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting) + len(getattr(self.sched, "skipped_waiting", ()))

    @property
    def num_waiting_for_kv(self) -> int:
        waiting = list(self.sched.waiting) + list(getattr(self.sched, "skipped_waiting", ()))
        return sum(1 for q in waiting if q.status.name == "WAITING_FOR_REMOTE_KVS")

    def add_request(self, req: Request, now: float | None = None) -> LiveRequest:
        """``req`` reaches vLLM at ``now`` (:meth:`~sim.model.scheduler.Scheduler.add_request`:
        rejected on arrival, as kvsim's model does, when longer than ``max_model_len``)."""
        r = LiveRequest(req, self.layout.tokens_per_hash)
        self.stats.requests_arrived += 1
        self.stats.prompt_tokens += req.prompt_tokens
        if reject_too_long(r, self.max_model_len, self.now if now is None else now, self.hooks):
            return r   # the caller writes its row at once
        ph = self._per_hash
        hashes = req.block_hashes
        keyed = [int(hashes[(i + 1) * ph - 1]).to_bytes(8, "little", signed=True)
                 for i in range(len(hashes) // ph)]
        self.requests[r.req_id] = r
        self._tracks[r.req_id] = _Track(r, keyed)

        def hasher(vreq: Any, keyed: list[bytes] = keyed, hs: int = self.hash_size) -> list[bytes]:
            return keyed[len(vreq.block_hashes): vreq.num_tokens // hs]

        v = self._v
        params = v["SamplingParams"](max_tokens=req.output_tokens, ignore_eos=True)
        vreq = v["VRequest"](r.req_id, [0] * req.prompt_tokens, params, None, block_hasher=hasher)
        self.sched.add_request(vreq)
        return r

    def _event(self, kind: str, detail: str, req_id: str | None, message: str, group: int = -1,
               chunk: int = -1) -> None:
        self.hooks.event(ModelEvent(self.now, kind, detail, req_id, group, chunk, message))

    # -- one step --------------------------------------------------------------------------

    def schedule(self, now: float) -> RealStep:
        """vLLM's ``schedule()``; the cost model's inputs of the step."""
        self.now = now
        try:
            out = self.sched.schedule()
        except AssertionError as exc:
            self._crash(exc)
            return RealStep(None, stopped=True)
        step = RealStep(out)
        self._account(out, step, now)
        for req_id in out.preempted_req_ids or ():
            victim = self.requests.get(req_id)
            if victim is not None:
                victim.preemptions += 1
                self.stats.preemptions += 1
                step.preempted += 1
        meta = out.kv_connector_metadata
        if meta is not None:
            step.loads, step.stores = len(meta.load_jobs), len(meta.store_jobs)
            for table, direction in ((meta.load_jobs, "h2d"), (meta.store_jobs, "d2h")):
                for job_id, entry in table.items():  # counted when built, as kvsim's model does
                    self._planned[job_id] = self._job(job_id, str(entry.req_id), direction,
                                                      entry.src_spec, entry.dst_spec)
        # requests finished in the last step leave now, their final stores built (as in kvsim)
        for r in self._finishing:
            if self.hooks.release is not None:
                self.hooks.release(r)
        self._finishing = []
        return step

    def _account(self, out: Any, step: RealStep, now: float) -> None:
        """The scheduled requests' counters (as kvsim's model counts them) and the step's load."""
        vreqs = self.sched.requests
        work: list[tuple[int, int, bool]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            q = vreqs[req_id]
            r = self.requests[req_id]
            done = q.num_computed_tokens - n   # vLLM advanced it in schedule()
            if r.scheduled_s is None:
                r.scheduled_s = now
                r.gpu_hit_tokens = max(0, done - r.cpu_hit_tokens)
                self.stats.gpu_hit_tokens += r.gpu_hit_tokens
            end = done + n
            # kvsim's step model: a decode step computes one token of a complete sequence
            work.append((done, n, done >= q.num_prompt_tokens and done == q.num_tokens - 1))
            if done < q.num_prompt_tokens or end < q.num_tokens:   # prefill work (as kvsim counts it)
                redo = max(0, min(end, r.high_water) - done)
                r.computed_tokens += n
                r.recomputed_tokens += redo
                self.stats.computed_tokens += n
                self.stats.recomputed_tokens += redo
            r.high_water = max(r.high_water, end)
        step.load = self.context.load(work)
        step.scheduled = len(out.num_scheduled_tokens)

    def flush(self, step: RealStep) -> tuple[list[RealJob], set[int]]:
        """The worker's ``handle_preemptions``: stores it submits now, jobs it waits for."""
        if self.wconn is None or step.output.kv_connector_metadata is None:
            return [], set()
        self.wconn.handle_preemptions(step.output.kv_connector_metadata)
        return self._take_submitted()

    def start_transfers(self, step: RealStep) -> tuple[list[RealJob], set[int]]:
        """The worker's ``start_load_kv``: deferred stores and this step's loads; jobs waited for."""
        if self.wconn is None or step.output.kv_connector_metadata is None:
            return [], set()
        self.wconn.bind_connector_metadata(step.output.kv_connector_metadata)
        self.wconn.start_load_kv(self._fctx)
        return self._take_submitted()

    def _take_submitted(self) -> tuple[list[RealJob], set[int]]:
        w = self.worker
        jobs = []
        for job_id, direction, src, dst in w.submitted:
            job = self._planned.pop(job_id, None) or self._job(job_id, "", direction, src, dst)
            self._jobs[job_id] = job
            jobs.append(job)
        w.submitted = []
        waited, w.waited = w.waited, set()
        return jobs, waited

    def _job(self, job_id: int, req_id: str, direction: str, src: Any, dst: Any) -> RealJob:
        """A job from its specs (GPU blocks per group: the bytes); counted for its request."""
        gpu, other = (dst, src) if direction == "h2d" else (src, dst)
        sizes = list(getattr(gpu, "group_sizes", None) or [len(gpu.block_ids)])
        nbytes = sum(n * b for n, b in zip(sizes, self._group_bytes, strict=False))
        ids = getattr(other, "block_ids", None)
        chunks = len(ids) if ids is not None else 0
        pieces = sum(n * k for n, k in zip(sizes, self._block_pieces, strict=False))
        job = RealJob(job_id, req_id, direction, chunks, sum(sizes), nbytes, pieces)
        r = self.requests.get(req_id) or next((f for f in self._finishing if f.req_id == req_id), None)
        if direction == "h2d":
            self.stats.load_jobs += 1
            self.stats.loaded_bytes += nbytes
            if r is not None:
                r.load_jobs += 1
                r.loaded_bytes += nbytes
        else:
            self.stats.store_jobs += 1
            self.stats.stored_bytes += nbytes
            if r is not None:
                r.store_jobs += 1
                r.stored_bytes += nbytes
        return job

    def update_from_output(self, now: float, step: RealStep,
                           completed: list[int]) -> list[LiveRequest] | None:
        """The worker's end of step (``wait_for_save``, ``get_finished``) and vLLM's
        ``update_from_output``; returns the requests finished (None: a vLLM
        assertion stopped the run)."""
        self.now = now
        try:
            mro = self._model_runner_output(step, completed)
            outputs = self.sched.update_from_output(step.output, mro)
        except AssertionError as exc:
            self._crash(exc)
            return None
        finished: list[LiveRequest] = []
        for eco in outputs.values():
            for o in eco.outputs:
                r = self.requests.get(o.request_id)
                if r is None:
                    continue
                if o.new_token_ids:
                    if r.first_token_s is None:
                        r.first_token_s = now
                    r.generated += len(o.new_token_ids)
                if o.finish_reason is not None:
                    r.status = RequestStatus.FINISHED
                    r.finish_s = now
                    finished.append(r)
        for r in finished:
            self.requests.pop(r.req_id, None)
            self._tracks.pop(r.req_id, None)
            self._finishing.append(r)
        live = self.requests
        self.running = [live[q.request_id] for q in self.sched.running if q.request_id in live]
        return finished

    def _model_runner_output(self, step: RealStep, completed: list[int]) -> Any:
        """What vLLM's worker returns: a token per request whose prefill is complete, and the
        connector's output with the transfers completed by now."""
        v, out = self._v, step.output
        if self.worker is not None:
            self.worker.finish(completed)
        conn_out = None
        if self.wconn is not None and out.kv_connector_metadata is not None:
            self.wconn.wait_for_save()
            fin_send, fin_recv = self.wconn.get_finished(out.finished_req_ids)
            kw: dict[str, Any] = {"finished_sending": fin_send, "finished_recving": fin_recv}
            worker_meta = self.wconn.build_connector_worker_meta()
            if worker_meta is not None:
                kw["kv_connector_worker_meta"] = worker_meta
            self.wconn.clear_connector_metadata()
            conn_out = v["KVConnectorOutput"](**kw)
        for j in completed:
            self._jobs.pop(j, None)
        vreqs = self.sched.requests
        ids = list(out.num_scheduled_tokens)
        # vLLM advanced num_computed_tokens in schedule(): the prefill is done when it reaches the end
        sampled = [[0] if vreqs[i].num_computed_tokens >= vreqs[i].num_tokens else [] for i in ids]
        return v["ModelRunnerOutput"](req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=sampled, kv_connector_output=conn_out)

    def _crash(self, exc: AssertionError) -> None:
        """A vLLM assertion: the modelled crash (recorded; the run stops)."""
        frames = traceback.extract_tb(exc.__traceback__)
        where = frames[-1]
        msg = str(exc) or f"assert at {Path(where.filename).name}:{where.lineno}: {where.line}"
        kind = ("missing_chunk" if "not found" in msg else "chunk_not_ready" if "not ready" in msg
                else "assertion")
        req_id = None
        tb = exc.__traceback__
        while tb is not None:  # the innermost frame that names a request
            loc = tb.tb_frame.f_locals
            for name in ("request", "req"):
                rid = getattr(loc.get(name), "request_id", None)
                if isinstance(rid, str):
                    req_id = rid
            tb = tb.tb_next
        s = self.stats
        s.crashes += 1
        s.crash_kinds[kind] = s.crash_kinds.get(kind, 0) + 1
        if s.first_crash_s is None:
            s.first_crash_s = self.now
        if req_id is not None and req_id in self.requests:
            self.requests[req_id].crash = kind
        self._event("crash", kind, req_id,
                    f"vllm {self.version} {Path(where.filename).name}:{where.lineno}: {msg}")

    # -- occupancy and the end ------------------------------------------------------------

    @property
    def gpu_used(self) -> int:
        pool = self.sched.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks) - 1 - int(pool.get_num_free_blocks())

    @property
    def gpu_cached(self) -> int:
        pool = self.sched.kv_cache_manager.block_pool
        return len(getattr(pool, "cached_block_hash_to_block", ()) or ())

    def cpu_counts(self) -> tuple[int, int, int, int]:
        """(present, pending, loading, free) chunks of vLLM's CPU manager (best effort)."""
        if self.conn_sched is None:
            return 0, 0, 0, 0
        mgr = self.conn_sched.manager
        cap = self.cfg.cpu_capacity_chunks
        used = int(getattr(mgr, "_num_allocated_chunks", getattr(mgr, "_num_allocated_blocks", 0)) or 0)
        pending = int(getattr(mgr, "_num_write_pending_chunks",
                              getattr(mgr, "_num_write_pending_blocks", 0)) or 0)
        return max(0, used - pending), pending, 0, max(0, cap - used)

    def has_work(self) -> bool:
        return bool(self.sched.requests) or bool(self._jobs) or bool(self.sched.finished_req_ids) \
            or bool(self._finishing) or bool(self._planned) \
            or bool(self.conn_sched is not None and getattr(self.conn_sched, "_jobs", None))

    def invariant_problems(self) -> list[str]:
        problems = []
        if self.sched.requests:
            problems.append(f"{len(self.sched.requests)} requests left in vLLM's scheduler")
        if self._jobs:
            problems.append(f"{len(self._jobs)} transfer jobs never completed")
        return problems

