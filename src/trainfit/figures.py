"""Pictures written to files: matplotlib on its file-only backend (imported only when a figure is
asked for), the checks a --plot path gets before any work, and stacked bars of memory breakdowns
(one colour per component, read by name)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainfit.config.schema import ConfigError

COLORS = {"params": "#4C72B0", "master_params": "#8172B2", "grads": "#DD8452", "optimizer": "#C44E52",
          "activations": "#55A868", "logits": "#937860", "buffers": "#8C8C8C", "reserved_margin": "#DADADA",
          "non_tensor": "#E4D8B4"}


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or a clear error when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'trainfit[plot]'") from err
    return plt


def stack_bars(ax: Any, labels: list[str], breakdowns: Sequence[Any], names: Sequence[str],
               scale: float) -> None:
    """One stacked bar per breakdown (a MemoryBreakdown: `names` are its fields), one colour per component
    (components that are all zero skipped)."""
    bottoms = [0.0] * len(breakdowns)
    for name in names:
        heights = [getattr(b, name) / scale for b in breakdowns]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=name, color=COLORS[name], width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]


FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff")
"""What --plot can write (matplotlib's Agg, PDF, SVG and PS backends, with Pillow for jpg/webp/tif)."""


def check_figure_path(option: str, path: str | Path) -> None:
    """Fail before any work when a figure could not be written there."""
    out = Path(path)
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in FIGURE_FORMATS:
        raise ConfigError(f"{option} {str(path)!r}: " + (f"unknown image type .{suffix}" if suffix else "no extension")
                          + f"; end the name with one of .{', .'.join(FIGURE_FORMATS)} (e.g. memory.png)")
    parent = out.absolute().parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise ConfigError(f"{option} {str(path)!r}: the folder {str(parent)!r} {what}; create it or write elsewhere")


def save_figure(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
