"""Seeded random check scenarios for property tests (one distribution, used by
the hypothesis tests and by the non-vacuity test alike)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sim.io.check import CheckScenario, parse_check


@dataclass(frozen=True)
class Case:
    seed: int
    scenario: CheckScenario


def build_case(seed: int) -> Case:
    rng = random.Random(seed)
    tph = rng.choice([4, 8, 16])
    bpc = rng.choice([1, 1, 2, 4])
    groups: list[dict[str, object]] = []
    pattern = rng.random()
    if pattern < 0.8:
        # a coarse sliding-window group whose chunk grid a finer group (a finer
        # window group, or a finer full-attention group) can cut: spec §6.5
        bs_c = tph * rng.choice([2, 4, 8])
        t = bs_c * bpc
        fine_fa = pattern < 0.25
        groups.append({"kind": "full", "tokens_per_block": tph if fine_fa else tph * rng.choice([4, 8])})
        window = rng.choice([t, 2 * t, t // 2 or 1, t - tph, bs_c, t + bs_c, 3 * t // 2])
        groups.append({"kind": "sliding_window", "tokens_per_block": bs_c, "window": max(1, window)})
        if not fine_fa:
            bs_f = tph * rng.choice([1, 1, 2])
            groups.append({"kind": "sliding_window", "tokens_per_block": bs_f,
                           "window": rng.choice([bs_f, 2 * bs_f, 4 * bs_f, 128])})
    else:
        if rng.random() < 0.9:
            groups.append({"kind": "full", "tokens_per_block": tph * rng.choice([1, 2, 4, 8])})
        for _ in range(rng.choice([1, 1, 2])):
            bs = tph * rng.choice([1, 2, 4, 8])
            kind = rng.choices(["sliding_window", "chunked_local"], [0.85, 0.15])[0]
            g: dict[str, object] = {"kind": kind, "tokens_per_block": bs}
            if kind == "sliding_window":
                g["window"] = rng.choice([bs // 2 or 1, bs, 2 * bs, 3 * bs - tph, 128, 4 * bs + 1, 100])
            else:
                g["attention_chunk"] = bs * bpc * rng.choice([1, 2, 4])  # multiple of tpc: safe
            groups.append(g)
    if rng.random() < 0.25:
        rng.choice(groups)["eagle"] = True
    lcm = 1
    for g in groups:
        b = int(g["tokens_per_block"])  # type: ignore[call-overload]
        lcm = lcm * b // __import__("math").gcd(lcm, b)
    max_tpc = max(int(g["tokens_per_block"]) for g in groups) * bpc  # type: ignore[call-overload]
    num_tokens = rng.randint(max_tpc + 1, max(max_tpc + 2, 12 * max_tpc))
    local = 0
    if rng.random() < 0.25 and num_tokens > lcm:
        local = lcm * rng.randint(0, (num_tokens - 1) // lcm)
    states: dict[str, dict[str, str]] = {}
    # a common boundary the finest group can set; every group stores the
    # chunks up to it (rounded up or down to its grid) and then a few chunks
    # near each group's edge, or random ones, are perturbed
    tpcs = [int(g["tokens_per_block"]) * bpc for g in groups]  # type: ignore[call-overload]
    boundary = min(tpcs) * rng.randint(1, max(1, num_tokens // min(tpcs)))
    if pattern < 0.8 and tpcs[1] > min(tpcs) and rng.random() < 0.8:
        # cut the coarse window group's grid: B = k*t + r*tpc_min, 0 < r*tpc_min < t
        t, f = tpcs[1], min(tpcs)
        k = rng.randint(0, max(0, (num_tokens - 1) // t - 1))
        boundary = k * t + f * rng.randint(1, max(1, t // f - 1))
    elif rng.random() < 0.2:
        boundary = rng.randint(1, num_tokens)
    hole = rng.choice([0.0, 0.0, 0.05, 0.2])
    for gi, tpc in enumerate(tpcs):
        n = num_tokens // tpc
        edge = min(n, -(-boundary // tpc) if rng.random() < 0.8 else boundary // tpc)
        if rng.random() < 0.1:
            edge = n
        table: dict[str, str] = {str(j): "present" for j in range(edge)}
        for j in range(edge):
            if rng.random() < hole:
                del table[str(j)]
        states[str(gi)] = table
    window_groups = [gi for gi, g in enumerate(groups) if g["kind"] != "full"]
    targets = [rng.choice(window_groups) for _ in range(rng.choice([0, 1, 1, 2]))]
    if pattern < 0.8 and rng.random() < 0.95:
        targets.append(1)
    for n_target, gi in enumerate(targets):
        tpc = tpcs[gi]
        j = -(-boundary // tpc) - rng.choice([2, 2, 1, 3])
        if gi == 1 and n_target == len(targets) - 1 and pattern < 0.8:
            # the chunk just left of the window OLD verifies (spec §6.5)
            j = -(-boundary // tpc) - -(-int(groups[1]["window"]) // tpc) - 1  # type: ignore[call-overload]
        if 0 <= j < num_tokens // tpc:
            st = rng.choices(["missing", "pending", "loading"], [6, 1, 1])[0]
            states[str(gi)].pop(str(j), None)
            if st != "missing":
                states[str(gi)][str(j)] = st
    data = {"schema": "check/1", "groups": groups, "blocks_per_chunk": bpc,
            "tokens_per_hash": tph, "num_tokens": num_tokens, "gpu_computed_tokens": local,
            "chunk_states": states, "cpu_capacity_chunks": 100_000}
    return Case(seed, parse_check(data, f"case{seed}"))
