"""A round timeline of one SSD request: the target's verification and the speculator's cache builds.

Lane 1 (target, core 0): per round a verification bar (coloured by whether the speculation
it verified was a cache hit) followed by the wait for the speculator's response. Lane 2
(speculator, core 1): per round the cache build that ran while that round was verified.
Input: the per-round dicts of ``benchmarks.rounds.SSDRounds`` (see its docstring for the
alignment of builds).
"""
from __future__ import annotations

from pathlib import Path

CAPTION = ("Build bars are placed from the target's clock: the worker starts building right after it sends a "
           "response, so each build starts where the target received the previous response (transfer latency "
           "ignored); its length is the build_s the worker reports with the next response. Verification includes "
           "forming the proposal and rejection sampling. The first round of a request verifies nothing: the "
           "speculator drafts the new sequence's first speculation just in time.")


def plot_timeline(rounds: list[dict], path: Path, title: str, k: int, max_rounds: int = 40) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rounds = rounds[:max_rounds]
    if not rounds:
        raise ValueError("no rounds to plot")
    t0 = rounds[0]["start"]
    colors = {"hit": "#2e7d32", "miss": "#ef6c00", "none": "#9e9e9e", "wait": "#cfd8dc",
              "build": "#1565c0", "cut": "#90caf9"}
    fig, ax = plt.subplots(figsize=(13, 3.6))
    end = 0.0
    for r in rounds:
        start = r["start"] - t0
        verify = (r["verify_ms"] or 0.0) / 1e3
        wait = (r["wait_ms"] if r["wait_ms"] is not None else r["admit_wait_ms"] or 0.0) / 1e3
        kind = "none" if r["hit"] is None else ("hit" if r["hit"] else "miss")
        if verify:
            ax.broken_barh([(start, verify)], (1.15, 0.7), facecolors=colors[kind], edgecolor="white", linewidth=0.5)
        ax.broken_barh([(start + verify, wait)], (1.15, 0.7), facecolors=colors["wait"], edgecolor="white",
                       linewidth=0.5)
        end = max(end, start + verify + wait)
        if r["build_start"] is not None and r["build_ms"]:
            full = r["build_steps"] == k
            ax.broken_barh([(r["build_start"] - t0, r["build_ms"] / 1e3)], (0.15, 0.7),
                           facecolors=colors["build" if full else "cut"], edgecolor="white", linewidth=0.5)
            end = max(end, r["build_start"] - t0 + r["build_ms"] / 1e3)
    ax.set_yticks([0.5, 1.5], ["speculator\n(core 1): build", "target\n(core 0)"])
    ax.set_ylim(0, 2)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds since the request's first decode round")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=colors["hit"], label="verify (cache hit)"),
                       Patch(color=colors["miss"], label="verify (miss: fallback draft)"),
                       Patch(color=colors["wait"], label="wait for speculator"),
                       Patch(color=colors["build"], label=f"build, all K={k} steps"),
                       Patch(color=colors["cut"], label="build, cut short by the next request")],
              loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=5, fontsize=8, frameon=False)
    fig.text(0.01, 0.01, CAPTION, fontsize=7, wrap=True, va="bottom")
    fig.subplots_adjust(bottom=0.42, left=0.09, right=0.99, top=0.9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
