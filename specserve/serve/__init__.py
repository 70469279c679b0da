"""Ray Serve application: `import_path: specserve.serve:build_app`.

    DraftPool  (small model, own replicas)  \\
                                             Router (HTTP ingress, owns requests, drives rounds)
    TargetPool (large model, own replicas)  /

With `target.heads` the target pool is a CoLocatedPool (target + Medusa, Hydra or ReDrafter heads in one replica);
a draft pool is then optional.
"""

from __future__ import annotations

import logging

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from specserve.protocol import SpecserveError
from specserve.serve.affinity import ROUTER_CLASS
from specserve.serve.config import AppArgs, PoolArgs

logger = logging.getLogger("ray.serve")


def check_vocabularies(args: AppArgs) -> None:
    """Compare the draft's tokenizer with the target's when the app is built. Registry models
    must be pulled already (a server should not start a multi-GB download on its own)."""
    from specserve.models import is_hub_id
    from specserve.text import TextCodec, check_same_vocabulary

    if args.draft is None or not args.check_vocabulary_at_build:
        return
    try:
        target = TextCodec.for_model(args.target.model, pull_missing=False)
        draft = TextCodec.for_model(args.draft.model, pull_missing=False)
    except SpecserveError:
        raise
    except Exception as exc:
        if is_hub_id(args.target.model) or is_hub_id(args.draft.model):
            logger.warning("could not fetch tokenizers to compare them now (%s); the pools compare them at start-up", exc)
            return
        raise SpecserveError(str(exc)) from None
    check_same_vocabulary(target, draft)


def check_heads(args: AppArgs):
    """Refuse, when the app is built, heads that are missing, of another method than the
    speculation's proposer (hydra asked, medusa heads there), or made for another model: a
    replica that cannot load them would only crash-loop. Returns their directory (`default`
    resolved for the proposer's method), or None without heads."""
    import json
    from pathlib import Path

    from specserve.heads import require_heads
    from specserve.models import is_hub_id, resolve
    from specserve.protocol import HEAD_PROPOSERS

    if args.target.heads is None:
        return None
    proposer = args.speculation.proposer
    directory = require_heads(args.target.model, args.target.heads, proposer if proposer in HEAD_PROPOSERS else None)
    heads = json.loads((directory / "config.json").read_text())
    if is_hub_id(args.target.model):
        return directory  # the target's config is fetched by the replicas; they compare shapes at load
    config = json.loads((Path(resolve(args.target.model, pull_missing=False)) / "config.json").read_text())
    text = config.get("text_config", config)
    if (heads.get("hidden_size"), heads.get("vocab_size")) != (text.get("hidden_size"), text.get("vocab_size")):
        raise SpecserveError(
            f"the heads at {directory} were trained for a model with hidden size {heads.get('hidden_size')} and "
            f"{heads.get('vocab_size')} tokens; {args.target.model} has {text.get('hidden_size')} and "
            f"{text.get('vocab_size')}: train heads for this target with `specserve train-heads`")
    return directory


def check_engines(args: AppArgs) -> None:
    """Refuse, when the app is built, an engine that is not installed in this Python (the
    replicas run the same one) or that cannot serve its pool's role: a replica that cannot
    build its engine would only crash-loop."""
    from specserve.engine import require_engine

    require_engine(args.target.engine, "target")
    if args.draft is not None:
        require_engine(args.draft.engine, "draft")
    if args.target.engine == "vllm" and args.target.heads is not None:
        raise SpecserveError("target: engine vllm does not run specserve's heads; use engine: torch for "
                             "co-located heads")


def check_auth(args: AppArgs) -> None:
    """Refuse, when the app is built, an API key source (`auth:`) that is unset, unreadable or
    empty here: serving without the key it names would let everyone in. The router replicas
    read it again where they run (the Secret must be on every node)."""
    from specserve.serve.access import load_api_keys

    if args.auth is not None:
        load_api_keys(args.auth)


# Ray Serve's throughput-optimized mode for the replicas specserve builds (AppArgs.fast_replica_calls);
# direct ingress (the router serving HTTP on its own port) is left off: the proxy stays the way in,
# and replica logs still reach stderr (`serve run`'s console), as without the mode
FAST_REPLICA_CALLS_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                          "RAY_SERVE_LOG_TO_STDERR": "1"}


def with_env_defaults(options: dict, env: dict[str, str]) -> dict:
    """Deployment options with `env` added to ray_actor_options.runtime_env.env_vars, where the
    options do not set those variables themselves (theirs win).

    >>> with_env_defaults({"ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"A": "0"}}}},
    ...                   {"A": "1", "B": "1"})["ray_actor_options"]
    {'num_cpus': 1, 'runtime_env': {'env_vars': {'A': '0', 'B': '1'}}}
    """
    actor = dict(options.get("ray_actor_options") or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = env | dict(runtime_env.get("env_vars") or {})
    return options | {"ray_actor_options": actor | {"runtime_env": runtime_env}}


def _deployment_options(config: AppArgs, options: dict) -> dict:
    return with_env_defaults(options, FAST_REPLICA_CALLS_ENV) if config.fast_replica_calls else options


def _pool_options(config: AppArgs, name: str, pool: PoolArgs) -> dict:
    return _deployment_options(config, {
        "name": name,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER_CLASS),
        **pool.deployment_options(),
    })


def build_app(args: dict | AppArgs) -> Application:
    """Build the specserve application from typed, cross-validated arguments."""
    from specserve.serve.pools import CoLocatedPool, DraftPool, TargetPool
    from specserve.serve.router import Router

    config = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    check_engines(config)
    check_auth(config)
    check_vocabularies(config)
    heads = check_heads(config)
    pool, name = (CoLocatedPool, "CoLocatedPool") if heads is not None else (TargetPool, "TargetPool")
    target_args = config.target.model_dump() | ({"heads": str(heads)} if heads is not None else {})
    target = pool.options(**_pool_options(config, name, config.target)).bind(target_args)
    draft = None
    if config.draft is not None:
        draft = DraftPool.options(**_pool_options(config, "DraftPool", config.draft)).bind(
            config.draft.model_dump(), config.speculation.model_dump())
    return Router.options(name="Router", **_deployment_options(config, config.router.deployment_options())).bind(
        target, draft, config.model_dump())
