"""Figures logged with runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch


def confusion_matrix_png(
    confusion: torch.Tensor, labels: list[str], path: Path, subject: str = "validation"
) -> Path:
    """`subject`: what the counts are of, the title's first words (which checkpoint, which step)."""
    import matplotlib

    # no display on training machines
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = confusion.numpy().astype(int)
    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(labels), 0.8 + 0.55 * len(labels)))
    ax.imshow(counts, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = counts.trace() / max(1, counts.sum())
    # inches: the title wraps to them rather than being cut
    width = 1.0 + 0.55 * len(labels)
    ax.set_title(
        textwrap.fill(f"{subject}: {accuracy:.2%} of {counts.sum()}", max(20, int(width * 11))),
        fontsize=9,
    )
    threshold = counts.max() / 2
    for i in range(len(labels)):
        for j in range(len(labels)):
            if counts[i, j]:
                ax.text(
                    j,
                    i,
                    counts[i, j],
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if counts[i, j] > threshold else "black",
                )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def predicted_vs_actual_png(
    predicted: torch.Tensor, actual: torch.Tensor, path: Path, title: str
) -> Path:
    """Regression: validation samples (the first few thousand) as points; the diagonal is
    perfect."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, a = predicted.double().numpy(), actual.double().numpy()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(a, p, s=8, alpha=0.6)
    if len(a):
        lo, hi = float(min(a.min(), p.min())), float(max(a.max(), p.max()))
        ax.plot([lo, hi], [lo, hi], color="gray", linewidth=1)
    ax.set_title(f"{title} ({len(a)} shown)", fontsize=9)
    ax.set_xlabel("actual")
    ax.set_ylabel("predicted")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
