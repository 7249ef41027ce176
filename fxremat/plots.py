"""Plots of a plan: its predicted memory timeline (and a measured one beside it, as in Hong et
al., Figure 5) and the memory/overhead trade-off curve. Needs matplotlib (``pip install
'fxremat[plot]'``), imported only when a plot is drawn.
"""

from __future__ import annotations

from .errors import format_bytes

__all__ = ["plot_timeline", "plot_tradeoff"]


def _figure(width: float, height: float):
    """A matplotlib ``Figure`` with one axes, outside pyplot (no backend or global state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("fxremat: plotting needs matplotlib; pip install 'fxremat[plot]' (or matplotlib)") from None
    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def _phase_axis(timeline) -> list[float]:
    """Event positions with the forward on [0, 1] and the backward on [1, 2]."""
    n, b = len(timeline.bytes), timeline.backward_start
    fwd = [i / max(b, 1) for i in range(b)]
    bwd = [1 + (i - b) / max(n - 1 - b, 1) for i in range(b, n)]
    return fwd + bwd


def plot_timeline(plan, path=None, *, measured=None):
    """Predicted memory over the forward and backward of ``plan`` (a :class:`fxremat.Plan`; and
    ``measured``, a :class:`~fxremat.core.Timeline`, beside it); returns the figure, saved to
    ``path`` when given. (The records are not imported here: :meth:`Plan.plot_timeline` calls
    this module.)"""
    if not plan.timeline_bytes:
        raise ValueError("fxremat: this plan has no predicted timeline; plan again with fxremat.plan")
    fig, ax = _figure(8, 4)
    predicted = plan.timeline()
    ax.plot(_phase_axis(predicted), [b / 2**20 for b in predicted.bytes], label="predicted")
    if measured is not None:
        ax.plot(_phase_axis(measured), [b / 2**20 for b in measured.bytes], label="measured", alpha=0.8)
    ax.axhline(plan.budget_bytes / 2**20, color="gray", linestyle="--", label="budget")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([0, 1, 2], ["forward start", "backward start", "end"])
    ax.set_ylabel("activation memory (MiB)")
    ax.set_title(f"fxremat plan ({plan.strategy}, {plan.objective}): peak "
                 f"{format_bytes(plan.predicted_peak_bytes)}, baseline {format_bytes(plan.baseline_peak_bytes)}")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig


def plot_tradeoff(points, path=None, *, title: str = "fxremat memory/overhead tradeoff"):
    """Predicted peak against predicted overhead, one marker per plan; saved to ``path``."""
    fig, ax = _figure(6, 4)
    xs = [100 * p.predicted_overhead for p in points]
    ys = [p.predicted_peak_bytes / 2**20 for p in points]
    ax.step(xs, ys, where="post", marker="o")
    ax.set_xlabel("predicted overhead (% of a plain training step)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
