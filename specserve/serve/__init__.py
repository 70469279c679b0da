"""Ray Serve application: `import_path: specserve.serve:build_app`.

    DraftPool  (small model, own replicas)  \\
                                             Router (HTTP ingress, owns requests, drives rounds)
    TargetPool (large model, own replicas)  /
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


def _pool_options(name: str, pool: PoolArgs) -> dict:
    return {
        "name": name,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER_CLASS),
        **pool.deployment_options(),
    }


def build_app(args: dict | AppArgs) -> Application:
    """Build the specserve application from typed, cross-validated arguments."""
    from specserve.serve.pools import DraftPool, TargetPool
    from specserve.serve.router import Router

    config = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    check_vocabularies(config)
    target = TargetPool.options(**_pool_options("TargetPool", config.target)).bind(config.target.model_dump())
    draft = None
    if config.draft is not None:
        draft = DraftPool.options(**_pool_options("DraftPool", config.draft)).bind(
            config.draft.model_dump(), config.speculation.model_dump())
    return Router.options(name="Router", **config.router.deployment_options()).bind(
        target, draft, config.model_dump())
