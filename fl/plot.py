"""The training plot: test accuracy and spent epsilon per round (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plot_rounds(rounds: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> None:
    """Accuracy or C-index (left axis) and spent epsilon (right axis, if any) against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["round"] for r in rounds]
    metric = "c_index" if rounds and rounds[0].get("c_index") is not None else "accuracy"
    label = "test C-index" if metric == "c_index" else "test accuracy"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r[metric] for r in rounds], color="tab:blue", marker="o", ms=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(label, color="tab:blue")
    ax.grid(alpha=0.3)
    eps = [r.get("epsilon") for r in rounds]
    if any(e is not None for e in eps):
        ax2 = ax.twinx()
        ax2.plot(xs, [e if e is not None else float("nan") for e in eps], color="tab:red",
                 marker="s", ms=3, label="epsilon spent")
        ax2.set_ylabel("epsilon spent", color="tab:red")
        ax2.set_ylim(bottom=0)
    ax.set_title(title or "secagg train")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
