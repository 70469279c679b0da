"""Waves off off on off off on off off at chat 8; per-process CPU seconds per wave (from /proc)."""
import asyncio, json, os, sys, tempfile, time
from specserve import models
from specserve.benchmarks import workloads
from specserve.benchmarks.http import run_level, start_server, stop_server, wait_healthy
import httpx
HZ = os.sysconf("SC_CLK_TCK")
def snapshot():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            name = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:60]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (name, (int(fields[11]) + int(fields[12])) / HZ, int(fields[7]), int(fields[9]))  # utime+stime, minflt
    return out
def diff(a, b):
    rows = []
    for pid, (name, cpu, _, flt) in b.items():
        c0 = a.get(pid, (name, 0.0, 0, 0))
        d = cpu - c0[1]
        if d >= 0.3:
            rows.append((round(d, 1), flt - c0[3], pid, name))
    return sorted(rows, reverse=True)
def procstat():
    f = open("/proc/stat").readline().split()[1:]
    return [int(x) for x in f]
url = "http://127.0.0.1:8000"
tok = models.load_tokenizer("qwen2.5-coder-1.5b-instruct")
w = workloads.load(["chat"], 8, 0)[0]
prompts = w.encode(tok)[:8]
server = start_server("manifests/local.yaml", os.path.join(tempfile.gettempdir(), "after-on-serve.log"))
try:
    wait_healthy(url, 900, server)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    off = {"proposer": "none"}; on = {"proposer": "draft", "k": 4, "policy": "fixed"}
    asyncio.run(run_level(url, model, prompts[:1], 4, 1, None, speculation=off))
    asyncio.run(run_level(url, model, prompts[:1], 4, 1, None, speculation=on))
    order = sys.argv[1].split(",") if len(sys.argv) > 1 else "off,off,on,off,off,on,off,off".split(",")
    for name in order:
        spec = off if name == "off" else on
        s0, p0 = snapshot(), procstat()
        wall, res = asyncio.run(run_level(url, model, prompts, 64, 8, None, speculation=spec))
        s1, p1 = snapshot(), procstat()
        toks = sum(r.tokens for r in res)
        sys_d = [b - a for a, b in zip(p0, p1)]
        print(json.dumps({"t": time.time(), "wave": name, "wall_s": round(wall, 2), "tok_s": round(toks / wall, 3),
                          "proc_stat(user,nice,sys,idle,iowait,irq,softirq,steal)": sys_d[:8],
                          "procs": diff(s0, s1)[:8]}), flush=True)
finally:
    stop_server(server)
