"""kvsim: a discrete-event simulator of vLLM KV-cache CPU offloading.

Reading results back (columns: ``docs/columns.md``): :func:`load_results` (one
run folder), :func:`load_runs` (the requests of many runs, one long table),
:func:`summaries` (one row per run), :func:`load_sweep` (a sweep folder).
"""

from typing import TYPE_CHECKING, Any

from sim import _native

_native.install()   # the compiled hot modules, or their sources when stale or KVSIM_PURE=1

if TYPE_CHECKING:
    from sim.io.results import load_results, load_runs, summaries
    from sim.tools.sweep import load_sweep

__all__ = ["load_results", "load_runs", "load_sweep", "summaries"]


def __getattr__(name: str) -> Any:
    """Lazy exports, so that ``import sim`` stays light."""
    if name in ("load_results", "load_runs", "summaries"):
        from sim.io import results  # noqa: PLC0415 -- `import sim` stays light

        return getattr(results, name)
    if name == "load_sweep":
        from sim.tools.sweep import load_sweep  # noqa: PLC0415 -- `import sim` stays light

        return load_sweep
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
