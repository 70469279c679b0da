"""Heads on the target model that propose draft tokens (Medusa; later Hydra and ReDrafter)."""

from __future__ import annotations

from pathlib import Path

HEAD_METHODS = ("medusa",)


def default_heads_dir(target: str, method: str = "medusa") -> Path:
    """Where `specserve train-heads` (and `make heads`) put a registry target's heads:
    $SPECSERVE_HOME/heads/<target>-<method>."""
    from specserve.models import specserve_home

    name = Path(str(target)).name if Path(str(target)).exists() else str(target).replace("/", "--")
    return specserve_home() / "heads" / f"{name}-{method}"


def heads_dir_for(target: str, heads: str) -> Path:
    """`heads` as given in a manifest or on the command line ("default": where
    `specserve train-heads` puts the target's Medusa heads)."""
    return default_heads_dir(target) if heads == "default" else Path(heads)


def missing_heads_message(target: str, directory: Path) -> str:
    return (f"no Medusa heads for {target} at {directory}; train them with `make heads` (the default target) "
            f"or `specserve train-heads --method medusa --target {target} --out {directory}`")
