"""The offloading spec kvsim hands to a real vLLM (``decisions = "vllm"``).

vLLM builds its offloading spec by name from the connector's extra config
(``spec_name`` / ``spec_module_path``); this module is that name. It is
imported by vLLM itself, only in the ``vllm`` decision mode, and imports vLLM
at the top (see :mod:`sim.model.real_vllm`, which never imports it otherwise).

:class:`KvsimOffloadingSpec` is vLLM's own CPU spec (so the scheduler side
gets vLLM's own ``CPUOffloadingManager`` with its LRU or ARC policy) with two
changes: the capacity is the scenario's chunk count (vLLM derives it from
``cpu_bytes_to_use`` and the worker's bytes per block), and the worker is
kvsim's: a transfer is not copied, it is handed to the engine's links and
reported finished when simulated time says so (:class:`SimulatedWorker`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["KvsimOffloadingSpec", "SimulatedWorker"]

class SimulatedWorker(OffloadingWorker):  # type: ignore[misc]
    """vLLM's worker-side transfer interface, backed by kvsim's clock.

    ``submitted`` collects the jobs vLLM's worker connector submits (the
    engine turns them into link transfers), ``waited`` the jobs it waits for
    within the step (flushes; 0.33's synchronous loads), and the jobs the
    engine reports finished are handed back by :meth:`get_finished`.
    """

    def __init__(self) -> None:
        #: (job id, "h2d" | "d2h", source spec, destination spec), in submission order
        self.submitted: list[tuple[int, str, Any, Any]] = []
        self.waited: set[int] = set()
        self._finished: list[int] = []
        self.on_submit: Callable[[], None] | None = None

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.submitted.append((job_id, "d2h", src_spec, dst_spec))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        self.submitted.append((job_id, "h2d", src_spec, dst_spec))
        return True

    def wait(self, job_ids: set[int]) -> None:
        self.waited |= set(job_ids)

    def finish(self, job_ids: list[int]) -> None:
        """The engine's transfers of these jobs completed (in completion order)."""
        self._finished.extend(job_ids)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return [TransferResult(job_id=j, success=True, transfer_size=None, transfer_time=None) for j in done]


class KvsimOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's CPU offloading spec with kvsim's capacity and worker."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        chunks = int(self.extra_config["kvsim_num_chunks"])
        self.num_chunks = chunks   # 0.30 and later
        self.num_blocks = chunks   # 0.29

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        # kvsim registers no KV tensors: sim.model.real_vllm sets its worker directly
        return SimulatedWorker()
