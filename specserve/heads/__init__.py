"""Heads on the target model that propose draft tokens (Medusa, Hydra, ReDrafter)."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.protocol import SpecserveError

HEAD_METHODS = ("medusa", "hydra", "redrafter")


def default_heads_dir(target: str, method: str = "medusa") -> Path:
    """Where `specserve train-heads` (and `make heads`) put a registry target's heads:
    $SPECSERVE_HOME/heads/<target>-<method>."""
    from specserve.models import specserve_home

    name = Path(str(target)).name if Path(str(target)).exists() else str(target).replace("/", "--")
    return specserve_home() / "heads" / f"{name}-{method}"


def default_cache_dir() -> Path:
    """Where `specserve train-heads` caches targets' hidden states and continuations:
    $SPECSERVE_HOME/heads/cache, shared by every method (Hydra and ReDrafter heads trained
    after Medusa's reuse its hidden states)."""
    from specserve.models import specserve_home

    return specserve_home() / "heads" / "cache"


def heads_path(target: str, heads: str, method: str = "medusa") -> Path:
    """The directory `heads` names, as given in a manifest or on the command line ("default":
    where `specserve train-heads --method METHOD` puts the target's heads)."""
    return default_heads_dir(target, method) if heads == "default" else Path(heads)


def find_heads(target: str, heads: str, method: str = "medusa") -> Path | None:
    """`heads_path`, or None when no heads are there."""
    directory = heads_path(target, heads, method)
    return directory if (directory / "config.json").is_file() else None


def require_heads(target: str, heads: str, method: str | None = None) -> Path:
    """`find_heads`, refusing missing heads with the command that trains them, and heads of
    another method than `method` (None: any method; "default" then means Medusa's)."""
    directory = find_heads(target, heads, method or "medusa")
    if directory is None:
        where = heads_path(target, heads, method or "medusa")
        hint = "`make heads` (the default target, Medusa) or " if (method or "medusa") == "medusa" else ""
        raise SpecserveError(f"no {(method or 'medusa').capitalize()} heads for {target} at {where}; train them "
                             f"with {hint}`specserve train-heads --method {method or 'medusa'} --target {target} "
                             f"--out {where}`")
    if method is not None and heads_method(directory) != method:
        raise SpecserveError(f"{directory} holds {heads_method(directory)} heads, not {method} heads: use proposer "
                             f"{heads_method(directory)!r}, or train {method} heads with "
                             f"`specserve train-heads --method {method} --target {target}`")
    return directory


def heads_method(directory: str | Path) -> str:
    """The method of the heads saved in `directory` (config.json's `method`; heads saved
    before there was more than one method are Medusa's)."""
    method = json.loads((Path(directory) / "config.json").read_text()).get("method", "medusa")
    if method not in HEAD_METHODS:
        raise SpecserveError(f"{directory} holds {method!r} heads; specserve serves {', '.join(HEAD_METHODS)} heads")
    return method
