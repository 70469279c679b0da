"""CPU, one run, the default pair (Qwen2.5-Coder-1.5B/0.5B, bf16), greedy, 64 tokens, 4 code prompts:
torch-engine pools vs vLLM-engine pools (separate) vs vLLM native speculative decoding, at 1 and 4
streams. Run from the vLLM environment: RAY_AUTH_MODE=disabled .venv-vllm/bin/python docs/bench/vllm-engine/run.py"""
import json, os, sys, time, copy, concurrent.futures as cf
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import httpx, yaml, ray
from ray import serve
from specserve.serve import build_app
from specserve import models

PORT = 8777
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", 64))
PROMPTS = ["def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "def reverse_words(s):\n    \"\"\"Reverse the order of words in s.\"\"\"\n",
           "def flatten(xs):\n    \"\"\"Flatten a list of lists.\"\"\"\n"]
base = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "../../../manifests/local-vllm.yaml")))["applications"][0]["args"]
torch_target = {"model": "qwen2.5-coder-1.5b-instruct", "dtype": "bfloat16", "torch_threads": 2,
                "ray_actor_options": {"num_cpus": 1.0}, "max_batch_size": 8, "num_replicas": 1}
torch_draft = {"model": "qwen2.5-coder-0.5b-instruct", "dtype": "bfloat16", "torch_threads": 2,
               "ray_actor_options": {"num_cpus": 0.5}, "max_batch_size": 8, "num_replicas": 1}
vllm_target = base["target"]
vllm_draft = {**base["target"], "model": "qwen2.5-coder-0.5b-instruct", "ray_actor_options": {"num_cpus": 0.5},
              "kv_cache_memory": "512MiB"}
spec = {"proposer": "draft", "k": 4, "policy": "fixed", "draft_min_confidence": 0.0}
native_target = copy.deepcopy(vllm_target)
native_target["engine_kwargs"]["speculative_config"] = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct",
                                                        "num_speculative_tokens": 4}
SYSTEMS = {
    "torch pools (draft k=4)": {"target": torch_target, "draft": torch_draft, "speculation": spec},
    "vllm pools, separate (draft k=4)": {"target": vllm_target, "draft": vllm_draft, "speculation": spec},
    "vllm native (draft_model k=4)": {"target": native_target, "speculation": {"proposer": "native"}},
}
only = sys.argv[1:]

def one(prompt):
    started = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=1200, json={
        "model": "qwen", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    return body["usage"]["completion_tokens"], time.perf_counter() - started, body["choices"][0]["text"]

ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": PORT})
results = {}
for name, args in SYSTEMS.items():
    if only and not any(o in name for o in only):
        continue
    t = time.time()
    serve.run(build_app({"model_name": "qwen", **args}), name="bench", route_prefix="/")
    start_s = time.time() - t
    one(PROMPTS[0])  # warm-up
    row = {"start_s": round(start_s, 1)}
    for streams in (1, 4):
        t = time.perf_counter()
        if streams == 1:
            outs = [one(p) for p in PROMPTS]
        else:
            with cf.ThreadPoolExecutor(4) as pool:
                outs = list(pool.map(one, PROMPTS))
        wall = time.perf_counter() - t
        row[f"tok_s_{streams}"] = round(sum(o[0] for o in outs) / wall, 2)
        row[f"texts_{streams}"] = [o[2] for o in outs]
    results[name] = row
    print(name, {k: v for k, v in row.items() if not k.startswith("texts")}, flush=True)
    serve.delete("bench")
    time.sleep(3)
same = len({json.dumps(r["texts_1"]) for r in results.values()}) == 1
print("identical greedy texts across systems:", same)
json.dump(results, open(os.environ.get("OUT", "results.json"), "w"), indent=1)
serve.shutdown(); ray.shutdown()
