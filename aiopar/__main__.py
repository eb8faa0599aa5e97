"""``python -m aiopar``: the ``aiopar`` command."""

from .cli import main

raise SystemExit(main())
