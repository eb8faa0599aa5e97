"""A module of the user's that takes the name of a package this plugin needs.

A script saved as ``distributed.py`` runs as ``__main__``, and its
directory comes first on ``sys.path``: the plugin's ``import distributed``
would import the script again, under that name, and run its top level
inside the plugin's import (which hangs, or fails far from the cause).
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["check_not_shadowed"]

NEEDED = ("dask", "distributed")  # the packages of dask that this plugin imports


def check_not_shadowed() -> None:
    """Raise ImportError naming the file if a module that is no package
    stands where Python would import one of :data:`NEEDED` from."""
    for name in NEEDED:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is None:
            raise ImportError(
                f"{spec.origin} hides dask's {name!r} package, which the aiopar-dask plugin "
                f"imports: Python finds that file first on sys.path (a script's own "
                f"directory comes first); rename it",
                name=name,
                path=spec.origin,
            )
