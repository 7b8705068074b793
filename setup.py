"""The optional compiled part of kvsim (everything else is in pyproject.toml).

``sim/model/_poolops.c`` holds the GPU block pool's per-block loops. It is
``optional``: where no C compiler is at hand the install goes on without it and
``sim/model/gpu_fast.py`` runs its own Python loops, with the same results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("sim.model._poolops", ["sim/model/_poolops.c"], optional=True,
                  extra_compile_args=["-O2"]),
    ],
)
