"""Stateful property test of the offloading scheduler and the CPU cache together.

A hypothesis ``RuleBasedStateMachine`` plays the engine's part (spec §9):
requests arrive, are looked up, load what the lookup found, compute their
prompt in chunks with a store job planned each step, finish with a final
store, and their transfer jobs complete in any order. A foreign writer
shares the CPU cache to force evictions. A deliberately naive reference
model follows every chunk's state (a dict key -> ref count: -1 pending,
0 ready, k loads), the jobs in flight, the being-loaded set and each
request's next chunk to store, and predicts, for a full-attention layout
(spec §4.3, §7.1, §3.3):

* the lookup: the leading run of present chunks; None when a pending chunk
  is in it or one of its chunks is being loaded; 0 below one chunk;
* the load plan: exactly the hit's chunks, all READY or LOADING beforehand;
* the store plan: the absent chunks of ``[next_stored, T // tpc)``, the
  eviction count and that every victim was idle and not offered; a
  rejection when too few idle chunks exist (then ``next_stored`` stays).

After every step: the CPU cache's ``check_invariants``, every chunk's state
and ref count, the scheduler's jobs per request and its being-loaded set.
The ``drain`` rule (and the teardown) completes every job and checks that
the scheduler then holds no job, no fence, no finished request, and that no
chunk is pending or loading.

Both profiles run the same machine: with one full-attention group and
hashes that always cover the request, OLD and NEW agree (no window, no
EAGLE, finished requests end on their prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim.model.connector import OffloadingScheduler
from sim.model.cpu_cache import ChunkState, CpuChunkCache, OffloadKey, offload_key
from sim.model.gpu_cache import GpuKVCache
from sim.model.layout import Layout
from sim.model.windows import profile
from tests.helpers import Req, fa

BS = 2  #: tokens per GPU block and per hash
BPC = 2  #: blocks per chunk
TPC = BS * BPC
LAYOUT = Layout.of([fa(BS)], tokens_per_hash=BS, blocks_per_chunk=BPC)
MAX_TOKENS = 24
#: hash chains of a few prompts; prompt 3 shares its first two chunks with prompt 0
SEQS = [[100 * b + i + 1 for i in range(MAX_TOKENS // BS)] for b in range(3)]
SEQS.append(SEQS[0][:4] + [300 + i for i in range(MAX_TOKENS // BS - 4)])
#: keys a foreign writer (another group's chunks) stores into the same cache
FOREIGN = [offload_key(900 + i, 1) for i in range(6)]


def seq_keys(seq: int) -> list[OffloadKey]:
    """The offload keys of prompt ``seq`` (spec §1.3: the hash of each chunk's last block)."""
    return [offload_key(h, 0) for h in SEQS[seq][BPC - 1 :: BPC]]


UNIVERSE = sorted({k for seq in range(len(SEQS)) for k in seq_keys(seq)}) + FOREIGN


@dataclass
class Ref:
    """The reference's view of one request."""

    req: Req
    keys: list[OffloadKey]
    phase: str = "waiting"  # waiting -> loading -> running -> finished
    computed: int = 0
    next_stored: int = 0
    block_ids: list[int] = field(default_factory=list)
    jobs: set[int] = field(default_factory=set)


class ConnectorMachine(RuleBasedStateMachine):
    """Scheduler + CPU cache of one logic against dicts and lists."""

    logic = "new"

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.cpu = CpuChunkCache(0)
        self.gpu = GpuKVCache(LAYOUT, 512)
        self.sched = OffloadingScheduler(LAYOUT, self.cpu, profile(self.logic))
        self.ref: dict[OffloadKey, int] = {}  # present keys: -1 pending, 0 ready, k loads
        self.jobs: dict[int, tuple[str, bool, tuple[OffloadKey, ...]]] = {}  # id -> (req, store?, keys)
        self.loading: set[OffloadKey] = set()
        self.reqs: dict[str, Ref] = {}
        self.next_req = 0
        self.rejections = 0
        self.foreign_pending: list[tuple[OffloadKey, ...]] = []  # stores of the other writer

    @initialize(capacity=st.integers(min_value=1, max_value=8),
                prompts=st.lists(st.tuples(st.integers(0, len(SEQS) - 1), st.integers(1, MAX_TOKENS // TPC)),
                                 max_size=3),
                pending=st.lists(st.booleans(), min_size=8, max_size=8))
    def start(self, capacity: int, prompts: list[tuple[int, int]], pending: list[bool]) -> None:
        # Start from chunks earlier requests left behind (some still being
        # stored): swarm testing disables rules per example, and an empty
        # cache would leave most lookups with nothing to find.
        self.capacity = capacity
        self.cpu = CpuChunkCache(capacity)
        self.sched = OffloadingScheduler(LAYOUT, self.cpu, profile(self.logic))
        prefill: list[OffloadKey] = []
        for seq, chunks in prompts:
            prefill += [k for k in seq_keys(seq)[:chunks] if k not in prefill]
        prefill = prefill[:capacity]
        if prefill:
            self.writer_store(prefill, pending[: len(prefill)])

    # -- reference helpers

    def live(self, phase: str) -> list[str]:
        return sorted(r for r, ref in self.reqs.items() if ref.phase == phase)

    def predict_store(self, offered: list[OffloadKey]) -> tuple[list[OffloadKey], int] | None:
        """(keys to store, evictions), or None when prepare_store has no room."""
        to_store = [k for k in offered if k not in self.ref]
        shortfall = len(to_store) - (self.capacity - len(self.ref))
        if shortfall > 0:
            idle = [k for k, r in self.ref.items() if r == 0 and k not in offered]
            if len(idle) < shortfall:
                return None
        return to_store, max(0, shortfall)

    def apply_store(self, offered: list[OffloadKey], plan_keys: tuple[OffloadKey, ...],
                    evicted: tuple[OffloadKey, ...], predicted: tuple[list[OffloadKey], int]) -> None:
        to_store, evictions = predicted
        assert list(plan_keys) == to_store
        assert len(evicted) == len(set(evicted)) == evictions
        for k in evicted:
            assert self.ref.get(k) == 0 and k not in offered, (k, self.ref.get(k))
            del self.ref[k]
        for k in plan_keys:
            self.ref[k] = -1

    def store_step(self, rid: str, tokens: int | None) -> None:
        """``build_store_job`` for ``tokens`` (None: finished) against the prediction."""
        r = self.reqs[rid]
        t = r.req.num_tokens if tokens is None else tokens
        s = min(t // TPC, len(r.block_ids) // BPC)
        offered = r.keys[r.next_stored : s]
        predicted = self.predict_store(offered) if offered else ([], 0)
        plan = self.sched.build_store_job(rid, tokens)
        if predicted is None:
            self.rejections += 1
            assert plan is None
            assert self.sched.store_rejections == self.rejections
            return
        assert self.sched.store_rejections == self.rejections
        r.next_stored = max(r.next_stored, s)
        if not predicted[0]:
            assert plan is None
            return
        assert plan is not None
        self.apply_store(offered, plan.keys, plan.evicted, predicted)
        first = r.keys.index(plan.keys[0])
        assert plan.chunks == tuple((0, r.keys.index(k)) for k in plan.keys)
        assert plan.src_block_ids == tuple(
            r.block_ids[j * BPC + i] for _, j in plan.chunks for i in range(BPC))
        assert plan.block_indices == (first * BPC,)
        self.jobs[plan.job_id] = (rid, True, plan.keys)
        r.jobs.add(plan.job_id)

    # -- rules

    @precondition(lambda self: len(self.reqs) < 8)
    @rule(seq=st.integers(0, len(SEQS) - 1),
          num_tokens=st.integers(1, MAX_TOKENS) | st.integers(TPC, MAX_TOKENS))
    def new_request(self, seq: int, num_tokens: int) -> None:
        rid = f"r{self.next_req}"
        self.next_req += 1
        req = Req(rid, SEQS[seq][: num_tokens // BS], num_tokens)
        keys = [offload_key(h, 0) for h in req.block_hashes[BPC - 1 :: BPC]]
        self.reqs[rid] = Ref(req, keys)
        self.sched.on_new_request(req)

    @precondition(lambda self: bool(self.live("waiting")))
    @rule(data=st.data())
    def look_up(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live("waiting")))
        r = self.reqs[rid]
        # the oracle (spec §4.2-§4.5, one FA group, no local hit)
        count, pending = 0, False
        for k in r.keys:
            if k not in self.ref:
                break
            count += 1
            pending = pending or self.ref[k] < 0
        if not r.keys or count == 0:
            expected: int | None = 0
        elif pending or any(k in self.loading for k in r.keys[:count]):
            expected = None
        else:
            expected = count * TPC
        m = self.sched.get_num_new_matched_tokens(r.req, 0)
        assert m.tokens == expected, (m, expected, r.keys, self.ref)
        assert m.load_async == bool(expected)
        if expected is None:
            return
        ext = expected
        alloc = self.gpu.allocate_new(rid, ([],), 0, ext, ext)
        assert alloc is not None
        plan = self.sched.update_state_after_alloc(r.req, alloc.blocks, ext)
        r.block_ids = [b.block_id for b in alloc.blocks[0]]
        self.sched.update_block_ids(rid, alloc.new_block_ids)
        if not ext:
            assert plan is None
            r.phase = "running"
            return
        assert plan is not None
        n = ext // TPC
        assert plan.keys == tuple(r.keys[:n])
        assert plan.chunks == tuple((0, j) for j in range(n))
        assert plan.dst_block_ids == tuple(r.block_ids)
        assert (plan.group_sizes, plan.block_indices, plan.hazards) == ((n * BPC,), (0,), ())
        for k in plan.keys:
            assert self.ref[k] >= 0
            self.ref[k] += 1
        self.loading |= set(plan.keys)
        self.jobs[plan.job_id] = (rid, False, plan.keys)
        r.jobs.add(plan.job_id)
        r.phase, r.computed, r.next_stored = "loading", ext, n

    @precondition(lambda self: any(self.reqs[r].computed < self.reqs[r].req.num_tokens
                                   for r in self.live("running")))
    @rule(data=st.data(), chunk=st.integers(1, 10))
    def compute_step(self, data: st.DataObject, chunk: int) -> None:
        todo = [r for r in self.live("running") if self.reqs[r].computed < self.reqs[r].req.num_tokens]
        rid = data.draw(st.sampled_from(todo))
        r = self.reqs[rid]
        new = min(r.req.num_tokens, r.computed + chunk)
        ids = self.gpu.allocate_more(rid, r.computed, new)
        assert ids is not None
        self.sched.update_block_ids(rid, ids)
        r.block_ids += ids[0]
        r.computed = new
        self.store_step(rid, new)

    @precondition(lambda self: any(self.reqs[r].computed == self.reqs[r].req.num_tokens
                                   for r in self.live("running")) or bool(self.live("waiting")))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        done = [r for r in self.live("running") if self.reqs[r].computed == self.reqs[r].req.num_tokens]
        rid = data.draw(st.sampled_from(done + self.live("waiting")))
        r = self.reqs[rid]
        self.sched.request_finished(rid)
        r.phase = "finished"
        self.store_step(rid, None)
        if self.gpu.req_blocks.get(rid) is not None:
            self.gpu.free(rid)
        self.sched.drop_if_idle(rid)
        if not r.jobs:
            del self.reqs[rid]

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        self.complete_one(data.draw(st.sampled_from(sorted(self.jobs))))

    def complete_one(self, job_id: int) -> None:
        rid, is_store, keys = self.jobs.pop(job_id)
        assert self.sched.complete_job(job_id) == (rid, is_store)
        for k in keys:
            if is_store:
                assert self.ref[k] == -1
                self.ref[k] = 0
            else:
                assert self.ref[k] >= 1
                self.ref[k] -= 1
        if not is_store:
            self.loading -= set(keys)
        r = self.reqs[rid]
        r.jobs.discard(job_id)
        if r.phase == "loading":
            r.phase = "running"
        if r.phase == "finished" and not r.jobs:
            del self.reqs[rid]

    def writer_store(self, keys: list[OffloadKey], pending: list[bool]) -> None:
        """Another writer of the same cache (an earlier engine, another group)
        stores ``keys``; those marked ``pending`` stay in flight."""
        predicted = self.predict_store(keys)
        plan = self.cpu.prepare_store(keys)
        if predicted is None:
            assert plan is None
            return
        assert plan is not None
        self.apply_store(keys, plan.keys, plan.evicted, predicted)
        late = tuple(k for k, p in zip(keys, pending, strict=True) if p and k in plan.keys)
        done = [k for k in plan.keys if k not in late]
        self.cpu.complete_store(done)
        for k in done:
            self.ref[k] = 0
        if late:
            self.foreign_pending.append(late)

    @rule(keys=st.lists(st.sampled_from(FOREIGN), min_size=1, max_size=4, unique=True),
          pending=st.booleans())
    def foreign_store(self, keys: list[OffloadKey], pending: bool) -> None:
        """Chunks of another group fill the cache: evictions."""
        self.writer_store(keys, [pending] * len(keys))

    @precondition(lambda self: bool(self.foreign_pending))
    @rule(data=st.data())
    def foreign_complete(self, data: st.DataObject) -> None:
        keys = self.foreign_pending.pop(data.draw(st.integers(0, len(self.foreign_pending) - 1)))
        self.cpu.complete_store(keys)
        for k in keys:
            assert self.ref[k] == -1
            self.ref[k] = 0

    @rule()
    def drain(self) -> None:
        for job_id in sorted(self.jobs):
            self.complete_one(job_id)
        while self.foreign_pending:
            keys = self.foreign_pending.pop()
            self.cpu.complete_store(keys)
            for k in keys:
                self.ref[k] = 0
        self.check_idle()

    def check_idle(self) -> None:
        assert self.sched.num_jobs == 0
        assert not self.sched.being_loaded
        assert not self.sched.block_fences
        assert self.cpu.num_pending == 0 and self.cpu.num_loading == 0
        assert all(r >= 0 for r in self.ref.values())
        assert self.sched.num_requests == len(self.reqs)
        assert all(ref.phase != "finished" for ref in self.reqs.values())

    # -- checks after every step

    @invariant()
    def agrees_with_reference(self) -> None:
        cpu, sched = self.cpu, self.sched
        cpu.check_invariants()
        for k in UNIVERSE:
            r = self.ref.get(k)
            assert cpu.ref_count(k) == r, k
            if r is None:
                assert cpu.state(k) is ChunkState.MISSING
            else:
                assert cpu.state(k) is (ChunkState.PENDING if r < 0 else
                                        ChunkState.READY if r == 0 else ChunkState.LOADING)
        assert cpu.num_used == len(self.ref) <= self.capacity
        assert sched.num_jobs == len(self.jobs)
        assert sched.being_loaded == self.loading
        assert sched.num_requests == len(self.reqs)
        for rid, ref in self.reqs.items():
            assert sched.in_flight_jobs(rid) == len(ref.jobs)
            assert sched.store_jobs_of(rid) == {j for j in ref.jobs if self.jobs[j][1]}

    def teardown(self) -> None:
        self.drain()


class OldConnectorMachine(ConnectorMachine):
    logic = "old"


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=30, derandomize=True, deadline=None)
TestConnectorMachineNew = ConnectorMachine.TestCase
TestConnectorMachineNew.settings = MACHINE_SETTINGS
TestConnectorMachineOld = OldConnectorMachine.TestCase
TestConnectorMachineOld.settings = MACHINE_SETTINGS
