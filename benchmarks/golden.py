"""Byte-identity check of kvsim's outputs against a baseline commit.

A refactor or a faster implementation must not change what kvsim writes. This
script runs a fixed set of commands once with the code of a baseline commit
(a ``git worktree`` of ``--base``, default ``HEAD``) and once with the working
tree, then compares every output file byte for byte:

* ``kvsim run scenarios/default.toml``
* ``kvsim compare scenarios/default.toml`` (``compare.json`` less its
  ``timing`` section; ``compare.md`` is not compared as it holds wall times)
* ``kvsim sweep scenarios/whatif/cpu-ram-12.toml``
* ``kvsim regress scenarios/crash`` (its printed table)
* ``kvsim fuzz --budget 20000 --seed 1`` (the library files it writes)
* the first 3,000 requests of the Mooncake conversation trace on
  ``scenarios/mooncake-deepseek-v4.toml`` (needs the trace; ``KVSIM_TRACES``
  or ``../shared/traces``)

Compared: every ``*.parquet``, ``summary.json``, ``compare.json`` (less
``timing``), ``sweep.parquet``, reproducer and fuzz library files, and the
regress table. Not compared: ``run_info.json``, ``*.png``, ``compare.md`` and
progress output (wall-clock by design).

The baseline's outputs are kept under ``results/.golden/<commit>/`` so a second
comparison against the same commit reruns only the working tree.

    python benchmarks/golden.py [--base REV] [--only NAME ...] [--keep]

Exit status 0 when every file is identical, 1 otherwise (the differing files
are listed).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import sim.startup  # first: a signal while it starts ends in one line

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "results" / ".golden"


def _traces() -> Path:
    env = os.environ.get("KVSIM_TRACES")
    return Path(env) if env else ROOT.parent / "shared" / "traces"


def commands(tree: Path, out: Path) -> dict[str, list[str]]:
    """The kvsim command lines, run from ``tree``, writing under ``out``."""
    mooncake = _traces() / "conversation_trace.jsonl"
    return {
        "run": ["run", "scenarios/default.toml", "--out", str(out / "run"), "-q"],
        "compare": ["compare", "scenarios/default.toml", "--out", str(out / "compare"), "-q"],
        "sweep": ["sweep", "scenarios/whatif/cpu-ram-12.toml", "--out", str(out / "sweep"), "-q",
                  "--jobs", "2"],
        "regress": ["regress", "scenarios/crash", "--jobs", "2"],
        "fuzz": ["fuzz", "--budget", "20000", "--seed", "1", "--out", str(out / "fuzz"), "-q", "--jobs", "2"],
        "mooncake": [
            "run", "scenarios/mooncake-deepseek-v4.toml", "--out", str(out / "mooncake"), "-q",
            "--set", "workload.limit=3000", "--set", f'workload.path="{mooncake}"',
        ],
    }


#: text in output files that names the folder a command wrote to (fuzz files quote
#: their command line): replaced by this placeholder before comparing
PLACEHOLDER = "<OUT>"


def run_all(tree: Path, out: Path, only: list[str]) -> None:
    """Run the commands with the code in ``tree``; outputs under ``out``.

    Each command writes into a fresh scratch folder (so that concurrent
    comparisons never share one), which is then moved to ``out/NAME``; the
    scratch path is kept in ``out/NAME.scratch`` for :func:`_normalise`.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    for name in commands(tree, out):
        if only and name not in only:
            continue
        scratch = Path(tempfile.mkdtemp(prefix="kvsim-golden-scratch-"))
        argv = commands(tree, scratch)[name]
        cmd = [sys.executable, "-c", "import sys; from sim.cli import main; sys.exit(main())", *argv]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
        (out / f"{name}.stdout").write_text(proc.stdout.replace(str(scratch), PLACEHOLDER))
        (out / f"{name}.rc").write_text(f"{proc.returncode}\n")
        shutil.rmtree(out / name, ignore_errors=True)
        if (scratch / name).exists():
            shutil.move(scratch / name, out / name)
        (out / f"{name}.scratch").write_text(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"  {name}: exit {proc.returncode}", flush=True)


def _comparable(path: Path) -> bool:
    name = path.name
    if name in {"run_info.json", "compare.md", "sweep.toml"} or name.endswith((".png", ".log")):
        return False
    return name.endswith((".parquet", ".json", ".toml", ".rc")) or name == "regress.stdout"


def _normalise(path: Path, scratch: str) -> bytes:
    """The bytes to compare: the scratch folder's path replaced by a placeholder in
    text files, and ``compare.json`` without its ``timing`` section."""
    data = path.read_bytes()
    if path.suffix in (".toml", ".json", ".md", ".txt") and scratch:
        data = data.replace(scratch.encode(), PLACEHOLDER.encode())
    if path.name == "compare.json":
        doc = json.loads(data)
        doc.pop("timing", None)
        return json.dumps(doc, sort_keys=True).encode()
    return data


def compare_trees(base: Path, new: Path, base_scratch: str = "", new_scratch: str = "") -> list[str]:
    """Relative paths that differ, are missing or are extra."""
    problems: list[str] = []
    base_files = {p.relative_to(base) for p in base.rglob("*") if p.is_file() and _comparable(p)}
    new_files = {p.relative_to(new) for p in new.rglob("*") if p.is_file() and _comparable(p)}
    for rel in sorted(base_files - new_files):
        problems.append(f"missing: {rel}")
    for rel in sorted(new_files - base_files):
        problems.append(f"extra:   {rel}")
    for rel in sorted(base_files & new_files):
        a, b = base / rel, new / rel
        same = filecmp.cmp(a, b, shallow=False) or _normalise(a, base_scratch) == _normalise(b, new_scratch)
        if not same:
            problems.append(f"differs: {rel}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="baseline commit (default HEAD)")
    ap.add_argument("--only", nargs="*", default=[], help="only these commands (run, compare, ...)")
    ap.add_argument("--keep", action="store_true", help="keep the working tree's outputs")
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if rev.returncode != 0:
        ap.error(f"--base: {args.base!r} is not a commit of this repository")
    sha = rev.stdout.strip()
    base_out = CACHE / sha
    missing = [n for n in commands(ROOT, base_out) if (not args.only or n in args.only)
               and not (base_out / f"{n}.rc").exists()]
    if missing:
        print(f"baseline {sha[:10]}: running {', '.join(missing)}", flush=True)
        with tempfile.TemporaryDirectory(prefix="kvsim-golden-") as tmp:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT,
                           check=True, capture_output=True)
            try:
                run_all(tree, base_out, missing)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    new_out = Path(tempfile.mkdtemp(prefix="kvsim-golden-new-"))
    print("working tree: running", flush=True)
    run_all(ROOT, new_out, args.only)
    problems = []
    for name in commands(ROOT, new_out):
        if args.only and name not in args.only:
            continue
        if (base_out / name).exists():
            scratches = [(d / f"{name}.scratch").read_text() if (d / f"{name}.scratch").exists() else ""
                         for d in (base_out, new_out)]
            for rel in compare_trees(base_out / name, new_out / name, *scratches):
                problems.append(f"{name}/{rel}")
        for suffix in (".rc",) + ((".stdout",) if name == "regress" else ()):
            a, b = base_out / f"{name}{suffix}", new_out / f"{name}{suffix}"
            if a.read_bytes() != b.read_bytes():
                problems.append(f"differs: {name}{suffix}")
    if not args.keep:
        shutil.rmtree(new_out, ignore_errors=True)
    else:
        print(f"working tree outputs kept in {new_out}")
    if problems:
        print(f"{len(problems)} difference(s) against {sha[:10]}:")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"identical to {sha[:10]}")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
