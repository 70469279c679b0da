"""1 stream through manifests/local.yaml: draft chain fixed k=4, fixed k=6, adaptive up to 4, adaptive up to 8.
Per prompt the settings take turns A B C D D C B A, the order rotated from prompt to prompt."""
import asyncio, json, sys, time
from specserve import models
from specserve.benchmarks import workloads
from specserve.benchmarks.http import run_level, start_server, stop_server, wait_healthy
import httpx
url = "http://127.0.0.1:8000"
workload = sys.argv[1]; n = int(sys.argv[2]); out = open(sys.argv[3], "a")
tok = models.load_tokenizer("qwen2.5-coder-1.5b-instruct")
w = workloads.load([workload], n, 0)[0]
prompts = w.encode(tok)[:n]
settings = {"on4": {"proposer": "draft", "k": 4, "policy": "fixed"}, "on6": {"proposer": "draft", "k": 6, "policy": "fixed"},
            "ad4": {"proposer": "draft", "k": 4, "policy": "adaptive"}, "ad8": {"proposer": "draft", "k": 8, "policy": "adaptive"}}
names = list(settings)
server = start_server("manifests/local.yaml", f"{sys.argv[3]}.serve.log")  # beside the output
try:
    wait_healthy(url, 900, server)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    for s in names:
        asyncio.run(run_level(url, model, prompts[:1], 8, 1, None, speculation=settings[s]))
    for i, p in enumerate(prompts):
        rot = names[i % 4:] + names[:i % 4]
        for s in rot + rot[::-1]:
            wall, res = asyncio.run(run_level(url, model, [p], 64, 1, None, speculation=settings[s]))
            r = res[0]
            out.write(json.dumps({"workload": workload, "prompt": i, "setting": s, "wall_s": round(wall, 3), "tokens": r.tokens,
                                  "text": r.text, "k_histogram": r.speculation.get("k_histogram"),
                                  "target_steps": r.speculation.get("target_steps")}) + "\n")
            out.flush()
finally:
    stop_server(server)
