"""Loss and acceptance plots of a drafter training run (matplotlib, headless)."""
from __future__ import annotations

import os

import numpy as np


def _smooth(x: np.ndarray, n: int) -> np.ndarray:
    if len(x) < n or n < 2:
        return x
    return np.convolve(x, np.ones(n) / n, mode="valid")


def plot_run(out_dir: str, metrics: list[dict], evals: list[dict], baseline: dict | None, title: str) -> list[str]:
    """loss.png (train loss, smoothed, and held-out loss) and acceptance.png (held-out mean accepted
    length over steps; per-position acceptance of the first and last evaluation and of the baseline)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6.4, 4))
    if metrics:
        steps = np.array([m["step"] for m in metrics])
        loss = np.array([m["loss"] for m in metrics])
        ax.plot(steps, loss, color="C0", alpha=0.25, lw=0.8)
        n = max(1, len(loss) // 30)
        ax.plot(steps[n - 1:] if len(loss) >= n else steps, _smooth(loss, n), color="C0", label="train")
    held = [(e["step"], e["heldout"]["loss"]) for e in evals if "heldout" in e]
    if held:
        ax.plot(*zip(*held), "o-", color="C1", label="held-out")
    if baseline is not None and "heldout" in baseline:
        ax.axhline(baseline["heldout"]["loss"], color="C2", ls="--", label="model's own drafter")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(out_dir, "loss.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    evals = [e for e in evals if "spec" in e]
    if baseline is not None and "spec" not in baseline:
        baseline = None
    if evals:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        a1.plot([e["step"] for e in evals], [e["spec"]["mean_accepted_length"] for e in evals], "o-", color="C0",
                label="trained drafter")
        if baseline is not None:
            a1.axhline(baseline["spec"]["mean_accepted_length"], color="C2", ls="--", label="model's own drafter")
        k = evals[-1]["spec"]["k"]
        a1.set(xlabel="step", ylabel=f"mean accepted length (k={k}, incl. bonus)", title="held-out, greedy")
        a1.legend()
        rows = [("initial", evals[0]), ("final", evals[-1])] + ([("model's own", baseline)] if baseline else [])
        width = 0.8 / len(rows)
        for i, (name, e) in enumerate(rows):
            rate = e["spec"]["per_position_accept_rate"]
            a2.bar(np.arange(1, len(rate) + 1) + (i - (len(rows) - 1) / 2) * width, rate, width, label=name)
        a2.set(xlabel="draft position", ylabel="accept rate", ylim=(0, 1), title="acceptance per position")
        a2.legend()
        fig.tight_layout()
        written.append(os.path.join(out_dir, "acceptance.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
