"""Integration: autoscaling on the session's Ray cluster. An application deployed from a config,
the way `serve run manifests/local.yaml` deploys one, with specserve's application-level policy
(specserve.serve.autoscaling) and short delays: load takes the target pool (SmolLM2-135M, fp32)
from 1 to 2 replicas and back, and every stream stays exact while replicas come and go."""

import threading
import time

import pytest

from conftest import PORT, SMOL
from test_serve import concurrent_streams, wait_for

pytestmark = [pytest.mark.serve, pytest.mark.slow]

APP = "autoscale"
PROMPTS = ["def add(a, b):", "The capital of France is", "import numpy as np\n", "Once upon a time",
           "1, 2, 3, 4,", "class Stack:"]


@pytest.fixture(scope="module")
def autoscale_app(cluster):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from specserve.serve.autoscaling import POLICY_FUNCTION

    pool = {"dtype": "float32", "torch_threads": 1, "ray_actor_options": {"num_cpus": 0.25},
            "health_check_period_s": 60, "health_check_timeout_s": 30}
    config = ServeDeploySchema.model_validate({
        "http_options": {"host": "127.0.0.1", "port": PORT},
        "applications": [{
            "name": APP, "route_prefix": f"/{APP}", "import_path": "specserve.serve:build_app",
            # 3 tokens per pass per replica: 6 concurrent target-only streams want 2 replicas
            "autoscaling_policy": {"policy_function": POLICY_FUNCTION,
                                   "policy_kwargs": {"target_tokens_per_replica": 3}},
            "args": {
                "model_name": "smol-autoscale",
                "target": {"model": SMOL, **pool, "autoscaling_config": {
                    "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3,
                    "look_back_period_s": 2, "metrics_interval_s": 1}},
                "speculation": {"proposer": "none"},
                "router": {"max_ongoing_requests": 16, "max_queued_requests": 16},
            },
        }],
    })
    _get_global_client().deploy_apps(config, _blocking=True)
    yield
    serve.delete(APP)


def target_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["TargetPool"]
    return deployment.replica_states.get("RUNNING", 0)


def test_load_scales_the_target_pool_out_and_back_and_streams_stay_exact(autoscale_app, reference):
    tokenizer, _, greedy_text, _ = reference
    expected = [greedy_text(tokenizer.encode(p), 48) for p in PROMPTS]
    assert wait_for(lambda: target_replicas() == 1, timeout=60)
    outputs, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            outputs.append(concurrent_streams(PROMPTS, 48, base=f"http://127.0.0.1:{PORT}/{APP}",
                                              model="smol-autoscale"))

    worker = threading.Thread(target=load)
    worker.start()
    try:
        scaled_out = wait_for(lambda: target_replicas() == 2, timeout=120)
        time.sleep(2)  # let streams run across both replicas
    finally:
        stop.set()
        worker.join()
    assert scaled_out, "the target pool never reached 2 replicas under load"
    assert wait_for(lambda: target_replicas() == 1, timeout=120), "the target pool never scaled back"
    assert outputs and all(texts == expected for texts in outputs)
