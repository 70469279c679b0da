"""Chat at 8 streams, waves in the order off off on off off on off off: are off waves after an on wave slower?"""
import asyncio, json, sys, time
from specserve import models
from specserve.benchmarks import workloads
from specserve.benchmarks.http import run_level, start_server, stop_server, wait_healthy
import httpx
url = "http://127.0.0.1:8000"
tok = models.load_tokenizer("qwen2.5-coder-1.5b-instruct")
w = workloads.load(["chat"], 8, 0)[0]
prompts = w.encode(tok)[:8]
server = start_server("manifests/local.yaml", "/tmp/runs/order/serve.log")
try:
    wait_healthy(url, 900, server)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    off = {"proposer": "none"}; on = {"proposer": "draft", "k": 4, "policy": "fixed"}
    asyncio.run(run_level(url, model, prompts[:1], 4, 1, None, speculation=off))
    asyncio.run(run_level(url, model, prompts[:1], 4, 1, None, speculation=on))
    for name, spec in [("off", off), ("off", off), ("on", on), ("off", off), ("off", off), ("on", on), ("off", off), ("off", off)]:
        wall, res = asyncio.run(run_level(url, model, prompts, 64, 8, None, speculation=spec))
        toks = sum(r.tokens for r in res)
        print(json.dumps({"t": time.time(), "wave": name, "wall_s": round(wall, 2), "tok_s": round(toks / wall, 3)}), flush=True)
finally:
    stop_server(server)
