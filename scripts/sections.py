"""Marked sections of a generated document: each script that owns one rewrites only its
own (docs/results.md: scripts/tcga_brca.py's and benchmarks/bench_attacks.py's)."""

from __future__ import annotations

from pathlib import Path


def write_section(out: Path, section: str, start: str, end: str) -> None:
    """Replace the section of ``out`` between ``start`` and ``end`` (``section`` carries
    both markers), or append it."""
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    out.write_text(text, encoding="utf-8")
