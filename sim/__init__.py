"""kvsim: a discrete-event simulator of vLLM KV-cache CPU offloading."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.io.results import load_results
    from sim.tools.sweep import load_sweep

__all__ = ["load_results", "load_sweep"]


def __getattr__(name: str) -> Any:
    """Lazy exports, so that ``import sim`` stays light."""
    if name == "load_results":
        from sim.io.results import load_results  # noqa: PLC0415 -- `import sim` stays light

        return load_results
    if name == "load_sweep":
        from sim.tools.sweep import load_sweep  # noqa: PLC0415 -- `import sim` stays light

        return load_sweep
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
