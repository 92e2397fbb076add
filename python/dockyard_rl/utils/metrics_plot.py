"""metrics.png: training reward, training resolve rate and validation curves of a run, drawn from
its metrics.jsonl (so a resumed run's plot covers every step): `plot_metrics`.
"""

from __future__ import annotations

import math
import os
import pathlib

from dockyard_rl.utils.metric_names import APPLY_RATE_KEY, RESOLVE_RATE_KEY, REWARD_KEY
from dockyard_rl.utils.metrics_jsonl import read_jsonl


def plot_metrics(
    metrics_path: str | os.PathLike[str], plot_path: str | os.PathLike[str], title: str = ""
) -> pathlib.Path:
    """Draws training reward, training resolve rate and validation curves from metrics.jsonl.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch, no display).
    Non-finite values are gaps. Written atomically; returns `plot_path`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series: dict[str, dict[int, float]] = {}
    for row in read_jsonl(metrics_path):
        for key, value in row.items():
            if "/" in key and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(key, {})[row["step"]] = float(value)  # last row of a step wins

    figure = Figure(figsize=(15, 4.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3)
    panels = (
        ("Training reward", [f"train/{REWARD_KEY}"]),
        ("Training resolve rate", [f"train/{RESOLVE_RATE_KEY}", f"train/{APPLY_RATE_KEY}"]),
        ("Validation", [f"val/{RESOLVE_RATE_KEY}", f"val/{REWARD_KEY}", f"val/{APPLY_RATE_KEY}"]),
    )
    for ax, (panel_title, keys) in zip(axes, panels):
        drawn = False
        for key in keys:
            if key not in series:
                continue
            steps = sorted(series[key])
            values = [series[key][s] for s in steps]
            style = {"marker": "o", "markersize": 4} if key.startswith("val/") else {}
            (line,) = ax.plot(
                steps, values, label=key, alpha=0.5 if len(steps) > 20 else 1, **style
            )
            if not key.startswith("val/") and len(steps) > 20:
                window = max(2, len(steps) // 10)
                ax.plot(
                    steps[window - 1 :],
                    _moving_average(values, window),
                    color=line.get_color(),
                    label=f"{key} (mean of {window})",
                )
            drawn = True
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    plot_path = pathlib.Path(plot_path)
    tmp = plot_path.with_name(plot_path.name + ".tmp")
    figure.savefig(tmp, format="png")
    os.replace(tmp, plot_path)
    return plot_path


def _moving_average(values: list[float], window: int) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [(sums[i] - sums[i - window]) / window for i in range(window, len(sums))]
