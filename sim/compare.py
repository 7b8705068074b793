"""Compatibility shim: the compare API moved to :mod:`sim.tools.compare`.

``sim.compare.compare_runs`` and ``sim.compare.load_compare`` are documented
entry points of earlier releases; they keep working through this module.
"""

from sim.tools.compare import compare_runs, compare_table, load_compare

#: the name of earlier releases
format_table = compare_table

__all__ = ["compare_runs", "compare_table", "format_table", "load_compare"]
