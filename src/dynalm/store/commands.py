"""The store's CLI commands (pull, list, rm) as plain functions that ``cli.py`` calls.

Results go to stdout, status lines and progress to stderr; failures raise DynaError.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from dynalm.store.catalog import ModelStore, format_size


def _size(path: Path) -> int:
    """Bytes of a model file, or of every file in a model directory."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size


def pull_command(model: str, *, store: ModelStore | None = None) -> Path:
    """Pull a catalog model or a Hugging Face repo (with a progress bar) and print where
    it lies."""
    store = store or ModelStore()
    path = store.pull(model)
    Console(stderr=True).print(f"[green]ready:[/] {model} ({format_size(_size(path))})")
    Console(highlight=False, soft_wrap=True).print(str(path))
    return path


def list_command(*, store: ModelStore | None = None, catalog: bool = False) -> None:
    """Print a table of the pulled models, or with ``catalog`` of the catalog's models."""
    store = store or ModelStore()
    if catalog:  # a table, then each entry's sources on lines of their own (never folded)
        table = Table("NAME", "SIZE", "SHA256", box=None, highlight=False)
        table.add_column("DESCRIPTION", overflow="fold")
        sources = []
        for e in store.catalog.values():
            size = format_size(e.size) if e.size is not None else "-"
            sha = e.sha256[:12] if e.sha256 else "from the Hub"
            table.add_row(e.key, size, sha, e.description)
            for s in e.sources:
                where = f"{s.label} {s.filename}" if hasattr(s, "filename") else s.label
                sources.append(f"  {e.key}  {where}")
        out = Console(highlight=False, soft_wrap=True)
        out.print(table)
        out.print("\nsources (tried in order):\n" + "\n".join(sources))
        return
    models = store.list()
    if not models:
        Console(stderr=True).print(
            "no models pulled yet; try `dynalm pull smollm2` (`dynalm list --catalog` shows "
            "the catalog)"
        )
        return
    table = Table("NAME", "SIZE", "SHA256", box=None, highlight=False)
    table.add_column("SOURCE", overflow="fold")
    table.add_column("PULLED")
    for m in models:
        pulled = m.pulled_at.replace("T", " ")[:16]
        sha = m.sha256[:12] if m.sha256 else "-"
        table.add_row(m.name, format_size(m.size), sha, m.source, pulled)
    Console().print(table)


def rm_command(model: str, *, store: ModelStore | None = None) -> None:
    """Delete a pulled model from the store."""
    for removed in (store or ModelStore()).remove(model):
        Console(highlight=False).print(f"removed {removed.name} ({format_size(removed.size)})")
