"""Miss-ratio curves as a picture (PNG and SVG, matplotlib's Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvoffload.sim.results import SimResult

__all__ = ["plot_curves"]


def plot_curves(results: Sequence[SimResult], stem: str | Path, title: str = "") -> list[Path]:
    """Plot the chunk miss ratio against cache size, a line per policy; write ``stem``.png/.svg.

    Serving-mode results also get the token miss ratio, dashed, where it differs from the chunk
    miss ratio (with several KV groups). Returns the written paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    try:
        policies = list(dict.fromkeys(r.policy for r in results))
        for policy in policies:
            rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.num_chunks)
            sizes = [r.num_chunks for r in rows]
            (line,) = ax.plot(sizes, [r.miss_ratio for r in rows], marker="o", label=f"{policy}")
            token_miss = [1.0 - t for r in rows if (t := r.token_hit_ratio) is not None]
            # The token line only where it says something (it equals the chunk line for one group).
            if len(token_miss) == len(rows) and any(
                abs(t - r.miss_ratio) > 1e-3 for t, r in zip(token_miss, rows, strict=True)
            ):
                ax.plot(
                    sizes,
                    token_miss,
                    linestyle="--",
                    color=line.get_color(),
                    alpha=0.6,
                    label=f"{policy} (tokens)",
                )
        if results and min(r.num_chunks for r in results) > 0:
            ax.set_xscale("log", base=2)
        classic = bool(results) and results[0].mode == "classic"
        ax.set_xlabel("cache size (objects)" if classic else "CPU cache size (chunks)")
        ax.set_ylabel("miss ratio")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(title or "miss-ratio curve")
        if policies:  # no line, no legend (matplotlib would warn)
            ax.legend()
        fig.tight_layout()
        stem = Path(stem)
        paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
        for path in paths:
            fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    finally:
        plt.close(fig)
    return paths
