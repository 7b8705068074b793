"""kvsim's decisions against the real vLLM releases it models, one decision at a time.

For each installed release (``$KVSIM_VLLM_VENVS``: ``VERSION=VENV`` pairs,
comma-separated, each made by ``scripts/install-vllm-cpu.sh VERSION``), the
harness ``scripts/vllm_check.py`` runs inside that environment and decides
check/1 scenarios with vLLM's own KVCacheManager, CPUOffloadingManager and
OffloadingConnector scheduler:

* the whole crash library against its ``[expect.LOGIC]`` tables (written from
  the real releases, never from kvsim);
* 400 random scenarios of the decision fuzzer against kvsim's own decision
  under the same logic, every outcome field compared.

``.ci/run`` installs 0.29.0, 0.30.0 and 0.33.0 and sets the variable; in CI its
absence is a failure, elsewhere the tests are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, VLLM_LOGIC_OF

LOGIC_OF = VLLM_LOGIC_OF


def _harness(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(python), str(ROOT / "scripts" / "vllm_check.py"), "-q", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_the_crash_library_matches_the_real_release(vllm_python: tuple[str, Path]) -> None:
    version, python = vllm_python
    files = sorted(str(p) for p in (ROOT / "scenarios" / "crash").rglob("*.toml"))
    p = _harness(python, "--expect", LOGIC_OF[version], *files)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    m = re.search(r"vllm (\S+): (\d+) of (\d+) expectations", last)
    assert m is not None, last
    # every file states [expect.old] and [expect.new]; [expect.latest] the 31 hand-made cases
    assert m[1] == version and m[2] == m[3] and int(m[3]) >= (len(files) if version != "0.33.0" else 31), last


def test_random_scenarios_match_kvsim(vllm_python: tuple[str, Path], tmp_path: Path) -> None:
    version, python = vllm_python
    batch = tmp_path / "batch.json"
    with batch.open("w", encoding="utf-8") as f:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_batch.py"), "2026", "400"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=f, check=True, timeout=300)
    p = _harness(python, "--batch", str(batch), "--against", LOGIC_OF[version])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    agree, _, total = last.partition(" cases agree")[0].rpartition(": ")[2].partition(" of ")
    assert agree == total and int(total) >= 350, last   # a few cases the harness cannot build are skipped
