"""Instructions per simulated request, a commit against the working tree: an A/B that
this machine's noise cannot blur.

Wall time on the 2-core VM moves by 20 % from run to run and more over a day, so a
change worth a few percent cannot be seen in ``bench_engine.py``'s req/s without many
alternated runs. The number of instructions a replay executes barely moves: this
script counts them with valgrind's callgrind for one case of ``bench_engine.py``, run
as it is timed (the fast accounting, compiled modules included), once with the code
of ``--base`` (a ``git worktree``, its compiled modules built there) and once with the
working tree (built as installed). Each count is a replay of ``--limit`` requests less
a replay of one (imports, loading the trace and set-up), divided by ``--limit - 1``.
Instructions are not time (cache misses and branch mispredictions are not counted),
but a change that runs fewer of them on the same decisions is faster.

    python benchmarks/instructions.py [--base REV] [--case NAME] [--limit N] [--sources]

``--sources`` compares the Python sources (``KVSIM_PURE=1``) and builds nothing. Needs
valgrind (``apt install valgrind``). About 3 minutes for the base's build and 1 to 2
for the counts at the default 400 requests.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import sim.startup  # first: a signal while it starts ends in one line
from sim.tools.run import child_preexec

ROOT = Path(__file__).resolve().parent.parent
BENCH = "benchmarks/bench_engine.py"
CASES = ("default", "mooncake-spec6", "mooncake-full-attn", "mooncake-deepseek-v4", "azure-conv-llama8b")


def _start(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``cmd`` in a process group of its own (:func:`_finish` kills it whole on the way
    out: a build's compiler processes would otherwise hold its output pipes open, and run
    on, after the build itself was killed)."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=child_preexec, start_new_session=True)  # noqa: PLW1509 -- no threads


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Wait for ``procs``: each one's exit code, output and errors; on the way out (Ctrl-C,
    an error) every process group still running is killed and reaped."""
    done: list[tuple[int, str, str]] = []
    try:
        for p in procs:   # outputs are short (a build's is read as it comes): one at a time
            out, err = p.communicate()
            done.append((p.returncode, out, err))
        return done
    except BaseException:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        raise


def _callgrind(tree: Path, case: str, limit: int, sources: bool, out: Path) -> subprocess.Popen[str]:
    """Start callgrind on ``bench_engine.py --child case --limit limit`` run with the code in ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0")
    if sources:
        env["KVSIM_PURE"] = "1"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
           str(tree / BENCH), "--child", case, "--accounting", "fast", "--limit", str(limit)]
    return _start(cmd, tree, env)


def per_request(tree: Path, case: str, limit: int, sources: bool) -> tuple[float, list[str]]:
    """Instructions per simulated request (``limit`` requests less one, both counted at
    once, side by side) and the modules that ran compiled."""
    with tempfile.TemporaryDirectory(prefix="kvsim-callgrind-") as tmp:
        procs = [_callgrind(tree, case, n, sources, Path(tmp) / f"callgrind.{n}") for n in (limit, 1)]
        counts: list[int] = []
        compiled: list[str] = []
        for rc, out, err in _finish(procs):
            found = re.search(r"Collected\s*:\s*(\d+)", err)
            if rc != 0 or found is None:
                tail = (err.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"callgrind of {case} ({tree}) failed (exit {rc}): {tail}")
            counts.append(int(found.group(1)))
            compiled = compiled or json.loads(out.strip().splitlines()[-1])["compiled"]
    return (counts[0] - counts[1]) / (limit - 1), compiled


def native_modules(tree: Path) -> list[str]:
    """The modules ``tree``'s build compiles (``NATIVE_MODULES`` of its ``sim/_native.py``,
    read without importing it)."""
    module = ast.parse((tree / "sim" / "_native.py").read_text())
    for node in module.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == "NATIVE_MODULES" and node.value is not None:
            return list(ast.literal_eval(node.value))
    return []


def build(tree: Path) -> None:
    """Compile ``tree``'s hot modules in place, as ``pip install`` does (mypyc and the C loops)."""
    [(rc, _, err)] = _finish([_start([sys.executable, "setup.py", "build_ext", "--inplace"], tree)])
    if rc != 0:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"building {tree} failed: {tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the commit to compare with (default HEAD)")
    ap.add_argument("--case", default="mooncake-spec6", choices=CASES, help="the bench_engine.py case")
    ap.add_argument("--limit", type=int, default=400, help="requests replayed (default 400)")
    ap.add_argument("--sources", action="store_true", help="compare the Python sources (KVSIM_PURE=1)")
    args = ap.parse_args()
    if args.limit < 2:
        ap.error("--limit must be at least 2")
    rev = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if rev.returncode != 0:
        ap.error(f"--base: {args.base!r} is not a commit of this repository")
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed (apt install valgrind)")
    sha = rev.stdout.strip()
    what = "sources (KVSIM_PURE=1)" if args.sources else "compiled modules"
    print(f"{args.case}, {args.limit:,} requests, fast accounting, {what}; callgrind instructions")
    with tempfile.TemporaryDirectory(prefix="kvsim-instructions-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            if not args.sources:
                print(f"building {sha[:10]} ...", flush=True)
                build(tree)
            print("counting ...", flush=True)
            base, base_compiled = per_request(tree, args.case, args.limit, args.sources)
            new, new_compiled = per_request(ROOT, args.case, args.limit, args.sources)
            runs = ((sha[:10], tree, base_compiled), ("the working tree", ROOT, new_compiled))
            short = [] if args.sources else [name for name, t, done in runs
                                             if set(done) != set(native_modules(t))]
        except RuntimeError as exc:
            print(f"instructions: {exc}", file=sys.stderr)
            return 1
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False,
                           capture_output=True)
    def ran(compiled: list[str]) -> str:
        return ", ".join(m.rpartition(".")[2] for m in compiled) or "none"

    print(f"\n| code | ran compiled | instructions per request | x base |\n|---|---|---:|---:|\n"
          f"| {sha[:10]} | {ran(base_compiled)} | {base:,.0f} | 1.000 |\n"
          f"| working tree | {ran(new_compiled)} | {new:,.0f} | {new / base:.3f} |")
    for name in short:   # the two may compile different modules; each must run all of its own
        print(f"{name} ran fewer modules compiled than its build compiles: its build failed, or a source "
              "was edited since (rebuild: python setup.py build_ext --inplace)")
    return 0


if __name__ == "__main__":
    sim.startup.run_script(main)
