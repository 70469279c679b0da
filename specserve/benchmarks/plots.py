"""PNG plots of a results.json document (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from specserve.benchmarks.noise import run_noise
from specserve.benchmarks.report import PLOTS, load_aware_levels


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(doc: dict, out_dir: Path) -> dict[str, str]:
    """Write the plots that the results have data for; return {plot key: file name}."""
    written = {}
    done = [r for r in doc.get("library", []) if r["status"] == "ok"]
    smallest = min((r.get("batch", 1) for r in done), default=1)
    library = [r for r in done if r.get("speedup") is not None and r.get("batch", 1) == smallest]
    if library:
        written["speedup"] = _speedup(library, out_dir / PLOTS["speedup"][0], smallest)
    batched = [{**r, "concurrency": r.get("batch", 1)} for r in done if r.get("phase", 0) == 0]
    if len({r["concurrency"] for r in batched}) > 1:  # the same axes as service mode's streams
        written["batch"] = _vs_concurrency(batched, out_dir / PLOTS["batch"][0],
                                           [("tokens_per_second", "tokens/s (all prompts of a call)")],
                                           xlabel="batch size (prompts per generate call)")
    service = [r for r in doc.get("service", []) if r["status"] == "ok"]
    if service:
        written["throughput"] = _vs_concurrency(service, out_dir / PLOTS["throughput"][0],
                                                [("throughput_tok_s", "tokens/s (all streams)")])
        written["latency"] = _vs_concurrency(service, out_dir / PLOTS["latency"][0],
                                             [("ttft_p99_s", "TTFT p99 (s)"), ("itl_p99_s", "ITL p99 (s)")])
    levels = load_aware_levels(service)
    if levels:
        written["load_aware"] = _load_aware(levels, out_dir / PLOTS["load_aware"][0], run_noise(levels))
    return written


def _speedup(runs: list[dict], path: Path, batch: int) -> str:
    plt = _pyplot()
    systems = list(dict.fromkeys(r["system"] for r in runs))
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    width = 0.8 / len(workloads)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(systems) + 2), 4.5))
    for j, workload in enumerate(workloads):
        xs, ys, bad = [], [], []
        for i, system in enumerate(systems):
            run = next((r for r in runs if r["system"] == system and r["workload"] == workload), None)
            if run is not None:
                xs.append(i + (j - (len(workloads) - 1) / 2) * width)
                ys.append(run["speedup"])
                bad.append(bool(run.get("mismatch")))
        bars = ax.bar(xs, ys, width, label=workload)
        for bar, flagged in zip(bars, bad):
            ax.annotate(f"{bar.get_height():.2f}" + (" ✗" if flagged else ""),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7,
                        color="red" if flagged else "black")
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup over specserve none (tok/s ratio)")
    ax.set_title(f"Library mode, batch {batch}: speedup over specserve none (✗ = output differs from target-only)",
                 fontsize=10)
    ax.legend(title="workload")
    return _save(plt, fig, path)


def _load_aware(levels: list[dict], path: Path, noise: dict | None = None) -> str:
    """Adaptive's ratios per level against the preset's goals (0.95x the better fixed setting, 1.0x
    always on at 1 stream): ratios, not tok/s, because a 5% gap vanishes on a 1-16 stream axis.
    Where the passes give the run's noise, a band of one standard deviation of a ratio around 1.0:
    where an adaptive equal to the better setting would measure two times in three."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    if noise is not None:
        ax.axhspan(1 - noise["ratio_sigma"], 1 + noise["ratio_sigma"], color="gray", alpha=0.15,
                   label=f"the run's noise: a ratio's ±1 sd ({noise['ratio_sigma']:.1%})")
    for workload in dict.fromkeys(lv["workload"] for lv in levels):
        mine = [lv for lv in levels if lv["workload"] == workload]
        streams = [lv["streams"] for lv in mine]
        line, = ax.plot(streams, [lv["vs_better_fixed"] for lv in mine], marker="o",
                        label=f"{workload}: adaptive / better fixed")
        ax.plot(streams, [lv["vs_on"] for lv in mine], marker="x", linestyle=":", color=line.get_color(),
                label=f"{workload}: adaptive / always on")
        steady = [(lv["streams"], lv["steady_vs_better_fixed"]) for lv in mine
                  if lv.get("steady_vs_better_fixed") is not None]  # closed-loop turns only
        if steady:
            ax.plot(*zip(*steady), marker="s", linestyle="--", color=line.get_color(), fillstyle="none",
                    label=f"{workload}: adaptive / better fixed, steady state")
        for lv in mine:
            ax.annotate(f"{lv['vs_better_fixed']:.2f}", (lv["streams"], lv["vs_better_fixed"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(0.95, color="red", linewidth=0.8, linestyle="--", label="goal: 0.95x the better fixed")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    _streams_axis(ax, sorted({lv["streams"] for lv in levels}), "concurrent streams")
    ax.set_ylabel("tok/s ratio")
    ax.set_title("Load-aware speculation: adaptive against fixed settings", fontsize=10)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _vs_concurrency(runs: list[dict], path: Path, metrics: list[tuple[str, str]],
                    xlabel: str = "concurrent streams") -> str:
    plt = _pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    fig, axes = plt.subplots(len(metrics), len(workloads), figsize=(5 * len(workloads), 3.6 * len(metrics)),
                             squeeze=False)
    for row, (key, label) in enumerate(metrics):
        for col, workload in enumerate(workloads):
            ax = axes[row][col]
            for system in dict.fromkeys(r["system"] for r in runs):
                points = sorted((r["concurrency"], r[key]) for r in runs
                                if r["system"] == system and r["workload"] == workload and r.get(key) is not None)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
            _streams_axis(ax, sorted({r["concurrency"] for r in runs}), xlabel)
            ax.set_ylabel(label)
            ax.set_title(f"{workload}: {label.split(' (')[0]}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _streams_axis(ax, levels: list[int], xlabel: str) -> None:
    """A log2 x axis ticked at the levels measured (1, 2, 4, ... streams or batch sizes)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(level) for level in levels])
    ax.set_xlabel(xlabel)


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name
