"""Heads on the target model that propose draft tokens (Medusa; later Hydra and ReDrafter)."""

from __future__ import annotations

from pathlib import Path

from specserve.protocol import SpecserveError

HEAD_METHODS = ("medusa",)


def default_heads_dir(target: str, method: str = "medusa") -> Path:
    """Where `specserve train-heads` (and `make heads`) put a registry target's heads:
    $SPECSERVE_HOME/heads/<target>-<method>."""
    from specserve.models import specserve_home

    name = Path(str(target)).name if Path(str(target)).exists() else str(target).replace("/", "--")
    return specserve_home() / "heads" / f"{name}-{method}"


def find_heads(target: str, heads: str) -> Path | None:
    """The directory `heads` names (as given in a manifest or on the command line; "default":
    where `specserve train-heads` puts the target's Medusa heads), or None when no heads are
    there."""
    directory = default_heads_dir(target) if heads == "default" else Path(heads)
    return directory if (directory / "config.json").is_file() else None


def require_heads(target: str, heads: str) -> Path:
    """`find_heads`, refusing missing heads with the command that trains them."""
    directory = find_heads(target, heads)
    if directory is None:
        where = default_heads_dir(target) if heads == "default" else Path(heads)
        raise SpecserveError(f"no Medusa heads for {target} at {where}; train them with `make heads` (the default "
                             f"target) or `specserve train-heads --method medusa --target {target} --out {where}`")
    return directory
