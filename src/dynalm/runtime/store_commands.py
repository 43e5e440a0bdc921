"""The store's CLI commands (pull, list, rm) as plain functions that ``cli.py`` calls.

Results go to stdout, status lines and progress to stderr; failures raise DynaError.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from dynalm.runtime.registry import ModelStore, format_size


def pull_command(model: str, *, store: ModelStore | None = None) -> Path:
    """Pull a catalog model (with a progress bar) and print where it lies."""
    store = store or ModelStore()
    path = store.pull(model)
    Console(stderr=True).print(f"[green]ready:[/] {model} ({format_size(path.stat().st_size)})")
    Console(highlight=False, soft_wrap=True).print(str(path))
    return path


def list_command(*, store: ModelStore | None = None) -> None:
    """Print a table of the pulled models."""
    models = (store or ModelStore()).list()
    if not models:
        Console(stderr=True).print("no models pulled yet; try `dynalm pull smollm2`")
        return
    table = Table("NAME", "SIZE", "SHA256", box=None, highlight=False)
    table.add_column("SOURCE", overflow="fold")
    table.add_column("PULLED")
    for m in models:
        pulled = m.pulled_at.replace("T", " ")[:16]
        table.add_row(m.name, format_size(m.size), m.sha256[:12], m.source, pulled)
    Console().print(table)


def rm_command(model: str, *, store: ModelStore | None = None) -> None:
    """Delete a pulled model from the store."""
    removed = (store or ModelStore()).remove(model)
    Console(highlight=False).print(f"removed {removed.name} ({format_size(removed.size)})")
