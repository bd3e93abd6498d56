"""PNG plots for a `pagedllm bench --compare` report (matplotlib, drawn off screen)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.benchmarking.settings import BenchSetting


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'pagedllm[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_report(
    folder: Path, settings: list[BenchSetting], results: dict[str, dict], series: dict[str, list[dict]]
) -> list[Path]:
    plt = _pyplot()
    written = [
        _over_time(plt, folder / "kv_utilization.png", series, "utilization", "KV utilization (tokens / allocated)"),
        _over_time(plt, folder / "running.png", series, "running", "running requests"),
        _memory(plt, folder / "kv_memory.png", series),
        _throughput(plt, folder / "throughput.png", results),
    ]
    block_sizes = sorted({s.block_size for s in settings})
    if len(block_sizes) > 1:
        written.append(_block_size_sweep(plt, folder / "block_size.png", settings, results))
    return written


def _over_time(plt, path: Path, series: dict[str, list[dict]], column: str, label: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, rows in series.items():
        # A sample is taken at the end of a step and holds for that step: draw steps, not ramps.
        ax.plot(
            [r["time_s"] for r in rows], [r[column] for r in rows], label=name, linewidth=1.2, drawstyle="steps-pre"
        )
    ax.set_xlabel("time since the workload was submitted (s)")
    ax.set_ylabel(label)
    if column == "utilization":
        ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _memory(plt, path: Path, series: dict[str, list[dict]]) -> Path:
    """Per setting: slots holding tokens, slots allocated, and the capacity."""
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.6 * len(series)), sharex=True, squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], series.items()):
        t = [r["time_s"] for r in rows]
        tokens = [r["tokens"] for r in rows]
        ax.fill_between(t, tokens, step="pre", color="tab:green", alpha=0.6, label="tokens held")
        ax.plot(t, [r["allocated"] for r in rows], drawstyle="steps-pre", color="tab:red", label="slots allocated")
        if rows:
            ax.axhline(rows[0]["capacity"], color="black", linestyle="--", linewidth=1, label="capacity")
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("KV slots")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time since the workload was submitted (s)")
    return _save(plt, fig, path)


def _throughput(plt, path: Path, results: dict[str, dict]) -> Path:
    names = list(results)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(names)), 4))
    width = 0.4
    out = [results[n]["output_tokens_per_s"] for n in names]
    total = [results[n]["total_tokens_per_s"] for n in names]
    ax.bar([i - width / 2 for i in x], out, width, label="output tokens/s")
    ax.bar([i + width / 2 for i in x], total, width, label="total tokens/s")
    for i, value in enumerate(out):
        ax.annotate(f"{value:.0f}", (i - width / 2, value), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("tokens per second")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def _block_size_sweep(plt, path: Path, settings: list[BenchSetting], results: dict[str, dict]) -> Path:
    fig, (waste_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for family in dict.fromkeys(s.family for s in settings):
        points = sorted(((s.block_size, results[s.name]) for s in settings if s.family == family), key=lambda p: p[0])
        sizes = [bs for bs, _ in points]
        waste_ax.plot(sizes, [100 * r["internal_waste_mean"] for _, r in points], marker="o", label=family)
        speed_ax.plot(sizes, [r["output_tokens_per_s"] for _, r in points], marker="o", label=family)
    for ax, label in ((waste_ax, "internal waste, % of allocated slots"), (speed_ax, "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
