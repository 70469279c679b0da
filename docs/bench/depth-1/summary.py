import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
by = collections.defaultdict(lambda: [0, 0.0, 0])
texts = collections.defaultdict(set)
hist = collections.defaultdict(collections.Counter)
for r in rows:
    a = by[r["setting"]]; a[0] += r["tokens"]; a[1] += r["wall_s"]; a[2] += r["target_steps"] or 0
    texts[r["prompt"]].add(r["text"])
    for k, v in (r["k_histogram"] or {}).items():
        hist[r["setting"]][int(k)] += v
base = by["on4"][0] / by["on4"][1]
for s, (t, w, steps) in by.items():
    print(f"{s}: {t/w:.3f} tok/s ({t} tokens, {w:.1f} s, {t/steps:.2f} tokens/target pass) {t/w/base:.3f}x on4; k {dict(sorted(hist[s].items()))}")
print("outputs identical per prompt:", all(len(v) == 1 for v in texts.values()), "prompts", len(texts))
