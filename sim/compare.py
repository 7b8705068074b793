"""Compatibility shim: the compare API moved to :mod:`sim.tools.compare`.

``sim.compare.compare_runs`` and ``sim.compare.load_compare`` are documented
entry points of earlier releases; they keep working through this module.
"""

from sim.tools.compare import compare_runs, format_table, load_compare

__all__ = ["compare_runs", "format_table", "load_compare"]
