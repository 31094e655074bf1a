"""The experts' load of a mixture-of-experts run, beside its loss curves: per expert, the
share of the routed (layer, token, choice) triples it received in each update (the update
events' ``expert_load``, docs/moe.md)."""

from __future__ import annotations

import numpy as np


def expert_loads(updates: list[dict]) -> list[list[float]]:
    """Each update's ``expert_load`` (dense models' updates carry none)."""
    return [e["expert_load"] for e in updates if isinstance(e.get("expert_load"), list)]


def draw(fig, loads: list[list[float]]) -> None:
    """A panel right of the figure's axes: per expert, the mean share over the updates, the
    range from the least to the most loaded update, the last update's share, and the even
    share ``1 / E`` a perfectly balanced router gives."""
    shares_UxE = np.asarray(loads, dtype=float)
    experts = np.arange(shares_UxE.shape[1])
    width, height = fig.get_size_inches()
    fig.set_size_inches(width + 5, height)
    fig.subplots_adjust(right=0.62)
    ax = fig.add_axes((0.7, 0.12, 0.28, 0.76))
    mean_E = shares_UxE.mean(axis=0)
    low_E, high_E = shares_UxE.min(axis=0), shares_UxE.max(axis=0)
    ax.bar(experts, mean_E, color="tab:blue", alpha=0.6, label="mean over updates")
    ax.errorbar(
        experts, mean_E, yerr=[mean_E - low_E, high_E - mean_E], fmt="none", ecolor="0.3",
        capsize=2, label="least to most loaded update",
    )  # fmt: skip
    ax.scatter(experts, shares_UxE[-1], color="tab:orange", s=12, zorder=3, label="last update")
    ax.axhline(1.0 / len(experts), color="tab:red", linestyle=":", label="even share 1/E")
    ax.set_xlabel("expert")
    ax.set_ylabel("share of routed (layer, token, choice)")
    ax.set_title(f"Expert load ({len(loads)} updates, sparse layers pooled)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
