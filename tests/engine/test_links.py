"""The transfer links in simulated time: per-piece overheads and the duplex slowdown,
as whole timelines worked out by hand."""

from __future__ import annotations

import pytest
import simpy

from sim.engine.links import Link, Transfer
from sim.model.costs import TransferModel


def timeline(h2d: TransferModel, d2h: TransferModel,
             jobs: list[tuple[float, str, int, int]]) -> list[tuple[str, float]]:
    """Run ``(submit time, direction, bytes, pieces)`` jobs on a pair of links; ``(job, end)`` in order."""
    env = simpy.Environment()
    log: list[tuple[str, float]] = []
    links = {"h2d": Link(env, "h2d", h2d, lambda x: log.append((x.req_id, env.now))),
             "d2h": Link(env, "d2h", d2h, lambda x: log.append((x.req_id, env.now)))}
    links["h2d"].other, links["d2h"].other = links["d2h"], links["h2d"]

    def submit(t: float, i: int, direction: str, nbytes: int, pieces: int):  # type: ignore[no-untyped-def]
        yield env.timeout(t)
        links[direction].submit(Transfer(i, f"{direction}{i}", direction, 1, 1, nbytes, pieces=pieces))

    for i, (t, direction, nbytes, pieces) in enumerate(jobs):
        env.process(submit(t, i, direction, nbytes, pieces))
    env.run()
    return log


def test_a_job_alone_takes_latency_pieces_and_bytes() -> None:
    link = TransferModel(1e9, 1e-3, 1e-4, 0.5)
    log = timeline(link, link, [(0.0, "h2d", 10**8, 10), (0.5, "h2d", 10**8, 0)])
    assert log == [("h2d0", pytest.approx(1e-3 + 10 * 1e-4 + 0.1)), ("h2d1", pytest.approx(0.5 + 1e-3 + 0.1))]


def test_both_directions_busy_slow_each_other_down() -> None:
    # h2d: 1 s alone from t = 0; d2h: 0.5 s alone from t = 0.2. While both run, h2d keeps half its
    # rate and d2h 0.8 of it: d2h ends at 0.2 + 0.5 / 0.8 = 0.825; by then h2d has done
    # 0.2 + 0.625 x 0.5 = 0.5125 s of its work, and the 0.4875 s left run alone: it ends at 1.3125.
    log = timeline(TransferModel(1e9, 0.0, 0.0, 0.5), TransferModel(1e9, 0.0, 0.0, 0.8),
                   [(0.0, "h2d", 10**9, 0), (0.2, "d2h", 5 * 10**8, 0)])
    assert log == [("d2h1", pytest.approx(0.825)), ("h2d0", pytest.approx(1.3125))]


def test_full_duplex_leaves_both_at_their_solo_times() -> None:
    log = timeline(TransferModel(1e9), TransferModel(1e9),
                   [(0.0, "h2d", 10**9, 0), (0.2, "d2h", 5 * 10**8, 0)])
    assert log == [("d2h1", 0.7), ("h2d0", 1.0)]


def test_a_queued_job_of_the_other_direction_keeps_it_busy() -> None:
    # d2h runs two jobs back to back (0.3 s each alone) while one h2d job of 1 s alone runs:
    # every d2h job overlaps the h2d job, so both d2h jobs take 0.3 / 0.5 = 0.6 s and end at 0.6
    # and 1.2; h2d keeps 0.9 of its rate until 1.2 (1.08 s of work), which is past its 1 s:
    # it ends at 1 / 0.9 = 1.111 s, after which the second d2h job runs alone.
    log = timeline(TransferModel(1e9, 0.0, 0.0, 0.9), TransferModel(1e9, 0.0, 0.0, 0.5),
                   [(0.0, "h2d", 10**9, 0), (0.0, "d2h", 3 * 10**8, 0), (0.0, "d2h", 3 * 10**8, 0)])
    # second d2h: starts 0.6; until 1/0.9 it does (1/0.9 - 0.6) x 0.5 of its 0.3 s, the rest alone
    done = (1 / 0.9 - 0.6) * 0.5
    assert log == [("d2h1", pytest.approx(0.6)), ("h2d0", pytest.approx(1 / 0.9)),
                   ("d2h2", pytest.approx(1 / 0.9 + 0.3 - done))]
