"""How far a service run's ratios move by chance, and what that means for the load-aware goal.

The bench measures each setting in passes (A B C C B A ...). Always on and always off are fixed
settings, so the ratio of their tok/s is the same in every pass but for noise: its spread from
pass to pass, pooled over a run's levels, is the noise of one setting's tok/s in one pass. From it:
how much the ratio of two settings' means over the passes moves by chance, and how often an
adaptive setting that *is* the better fixed setting at every level would still measure below the
goal (`GOAL`, 0.95x the better fixed setting) at one level or at any.

    python -m specserve.benchmarks.noise docs/bench/*/results.json   # per run: misses against chance
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

GOAL = 0.95


def pass_noise(levels: Iterable[tuple[Sequence[float], Sequence[float]]]) -> tuple[float, int] | None:
    """The standard deviation of log tok/s of one setting in one pass, and its degrees of freedom,
    from (always on's, always off's) tok/s per pass at each level. Per pass, log(on / off) carries
    both settings' noise (twice one setting's variance), so the within-level variance of that log
    ratio, pooled over levels with at least two passes each, is halved. None without such a level.
    The passes are taken as independent: the turns' order cancels a linear drift from the means,
    so this is an upper bound on the noise of a mean over passes."""
    squares, freedom = 0.0, 0
    for on, off in levels:
        ratios = [math.log(a / b) for a, b in zip(on, off) if a > 0 and b > 0]
        if len(ratios) < 2:
            continue
        mean = sum(ratios) / len(ratios)
        squares += sum((r - mean) ** 2 for r in ratios)
        freedom += len(ratios) - 1
    if not freedom:
        return None
    return math.sqrt(squares / freedom / 2), freedom


def _normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def chance_at_goal(on: float, off: float, sigma: float, goal: float = GOAL) -> float:
    """The chance that an adaptive setting whose true tok/s is the better of `on` and `off`
    measures at least `goal` times the better of the two as measured, each of the three measured
    with independent log-normal noise `sigma` (the noise of a mean over the passes). Integrates
    over adaptive's measured value a: P(a - log goal >= both fixed settings' measured values)."""
    if sigma <= 0:
        return 1.0 if goal <= 1 else 0.0
    log_on, log_off, shift = math.log(on), math.log(off), math.log(goal)
    best = max(log_on, log_off)
    steps, span = 800, 8 * sigma
    width = 2 * span / steps
    total = 0.0
    for i in range(steps + 1):
        a = best - span + i * width
        density = math.exp(-0.5 * ((a - best) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
        weight = 0.5 if i in (0, steps) else 1.0
        total += weight * density * _normal_cdf((a - shift - log_on) / sigma) \
            * _normal_cdf((a - shift - log_off) / sigma)
    return min(1.0, total * width)


def run_noise(levels: list[dict]) -> dict | None:
    """The noise of a run's `load_aware_levels` and, per level, the chance that an adaptive
    setting equal to the better fixed setting meets the goal: {"pass_sigma", "freedom",
    "mean_sigma" (of a setting's mean over the passes), "ratio_sigma" (of a ratio of two such
    means), "passes", "chances" (per level), "all_levels"}.
    None where no level has both fixed settings' tok/s in more than one pass."""
    pairs = [(lv["passes"]["on"], lv["passes"]["off"]) for lv in levels
             if len(lv["passes"]["on"]) > 1 and len(lv["passes"]["on"]) == len(lv["passes"]["off"])]
    noise = pass_noise(pairs)
    if noise is None:
        return None
    pass_sigma, freedom = noise
    passes = min(len(on) for on, _ in pairs)
    mean_sigma = pass_sigma / math.sqrt(passes)
    chances = [chance_at_goal(lv["on"], lv["off"], mean_sigma) for lv in levels]
    return {"pass_sigma": pass_sigma, "freedom": freedom, "mean_sigma": mean_sigma,
            "ratio_sigma": mean_sigma * math.sqrt(2), "passes": passes, "chances": chances,
            "all_levels": math.prod(chances)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of service runs")
    args = parser.parse_args(argv)
    print("| run | levels | pass noise | ratio noise | measured >= 0.95x | expected by chance | all by chance |")
    print("|---|---|---|---|---|---|---|")
    from specserve.benchmarks.report import load_aware_levels  # the report shows this module's figures

    for path in args.results:
        doc = json.loads(path.read_text())
        levels = load_aware_levels(doc.get("service") or [] if isinstance(doc, dict) else [])
        noise = run_noise(levels)
        if noise is None:
            continue
        met = sum(lv["vs_better_fixed"] >= GOAL for lv in levels)
        print(f"| {path.parent} | {len(levels)} | {noise['pass_sigma']:.1%} | {noise['ratio_sigma']:.1%} "
              f"| {met} | {sum(noise['chances']):.1f} | {noise['all_levels']:.0%} |")


if __name__ == "__main__":
    main()
