"""Where the kernels' weights lie, as a command or ``$DYNALM_WEIGHT_PAGES`` chooses:
``huge`` (read into anonymous memory on 2 MiB pages, ``core.memory``) or ``mapped`` (the
repack cache's files mapped). Imports nothing heavy: the CLI reads it for its choices."""

from __future__ import annotations

import os

from dynalm.errors import InvalidRequest

VARIABLE = "DYNALM_WEIGHT_PAGES"
CHOICES = ("huge", "mapped")


def chosen(default: str = "huge") -> str:
    """``$DYNALM_WEIGHT_PAGES``, else ``default``; an unknown value is the user's error."""
    choice = os.environ.get(VARIABLE, default)
    if choice not in CHOICES:
        raise InvalidRequest(
            f"${VARIABLE}: unknown value {choice!r} (choose {' or '.join(CHOICES)})"
        )
    return choice
