"""Write the decision fuzzer's random check/1 scenarios as a JSON list.

    python scripts/fuzz_batch.py SEED COUNT [START] > batch.json

Scenario ``i`` is ``sim.tools.fuzz.scenario_at(SEED, i)`` for ``i`` in
``START .. START + COUNT - 1`` (the same ones ``kvsim fuzz --seed SEED`` scans).
The list feeds ``scripts/vllm_check.py --batch batch.json --against LOGIC``,
which decides each with a real vLLM and compares with kvsim.
"""

from __future__ import annotations

import json
import sys

from sim.tools.fuzz import scenario_at


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    seed, count = int(argv[0]), int(argv[1])
    start = int(argv[2]) if len(argv) == 3 else 0
    batch = [scenario_at(seed, i).check_data() for i in range(start, start + count)]
    json.dump(batch, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
