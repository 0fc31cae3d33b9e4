"""PNG plots for the experiment log (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402


def _check_series(series: dict[str, list[float]], length: int | None = None) -> None:
    if not series:
        raise ValueError("nothing to plot: pass at least one named series")
    for name, ys in series.items():
        if not ys:
            raise ValueError(f"series {name!r} is empty")
        if length is not None and len(ys) != length:
            raise ValueError(f"series {name!r} has {len(ys)} points but x has {length}")


def _save(fig: plt.Figure, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
    return path


def plot_runs(
    path: str, series: dict[str, list[float]], ylabel: str = "tok/s", title: str = ""
) -> str:
    """One line per series over run index (e.g. baseline vs speculation, interleaved runs),
    with each series' mean as a dashed line. Returns the PNG path."""
    _check_series(series)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        runs = list(range(1, len(ys) + 1))
        (line,) = ax.plot(runs, ys, marker="o", label=name)
        ax.axhline(sum(ys) / len(ys), color=line.get_color(), linestyle="--", linewidth=0.8)
    return _finish(fig, ax, path, "run", ylabel, title)


def plot_sweep(
    path: str,
    x: list[float],
    series: dict[str, list[float]],
    xlabel: str = "concurrency",
    ylabel: str = "output tok/s",
    title: str = "",
) -> str:
    """y against x on a log2 x axis (concurrency 1, 2, 4, ...), one line per series."""
    if not x:
        raise ValueError("nothing to plot: x is empty")
    if any(v <= 0 for v in x):
        raise ValueError(f"x values must be > 0 for a log2 axis, got {x}")
    _check_series(series, len(x))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v:g}" for v in x])
    return _finish(fig, ax, path, xlabel, ylabel, title)


def _finish(fig, ax, path: str, xlabel: str, ylabel: str, title: str) -> str:
    """Labels, grid and legend shared by every plot, then save."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)
