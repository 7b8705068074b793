"""Compatibility shim: the figures moved to :mod:`sim.tools.plots`.

``sim.plots.*`` is a documented entry point of earlier releases; every public
name of :mod:`sim.tools.plots` is available here too (matplotlib is still
imported only when a figure is drawn).
"""

from sim.tools.plots import *  # noqa: F403 -- the shim re-exports the whole public API
from sim.tools.plots import __all__  # noqa: F401
