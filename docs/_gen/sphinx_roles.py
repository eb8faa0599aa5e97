"""A griffe extension: show the Sphinx roles of aiopar's docstrings as code.

The docstrings are written for ``help()`` and Sphinx alike, so they use
``:func:`name``` roles and ``double backticks``; Markdown shows both as code
once the role prefix is gone.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|exc|data|obj|const):`~?([^`]+)`")


class SphinxRoles(Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
