"""A run's plot for the MLflow UI (`mlflow.log_figure`): its per-step decode times, one line per timed repeat, where
a stall, a warm-up tail or a drift between repeats shows at a glance and a list of numbers hides it."""
from __future__ import annotations


def step_times_figure(record: dict):
    """The step-time plot of a record that logged per-step times (artifact step_times.json), else None."""
    times = record.get("artifacts", {}).get("step_times.json")
    if not isinstance(times, dict) or not times.get("decode_step_ms"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    repeats = times.get("repeats_step_ms") or [times["decode_step_ms"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.2), layout="constrained")
    for i, steps in enumerate(repeats):
        ax.plot(range(1, len(steps) + 1), steps, lw=1, label=f"repeat {i + 1}" if len(repeats) > 1 else None)
    ax.set_xlabel("decode step")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{record.get('run_name', '')}: time per decode step")
    if len(repeats) > 1:
        ax.legend(fontsize="small")
    plt.close(fig)   # the store renders it; pyplot keeps no reference
    return fig
