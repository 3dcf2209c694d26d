"""Plots the benchmarks share."""
from __future__ import annotations

from pathlib import Path


def paired_bars(path: Path, labels: list[str], series: list[tuple[str, list[float], str]], xlabel: str,
                title: str) -> None:
    """Horizontal bars, one group per label, one bar per (name, values, colour) series; written as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3))
    height = 0.8 / len(series)
    for index, (name, values, color) in enumerate(series):
        offset = (index - (len(series) - 1) / 2) * height
        ax.barh([i + offset for i in range(len(labels))], values, height=height, color=color, label=name)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
