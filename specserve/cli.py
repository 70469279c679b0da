"""Command line: ``specserve models list|pull``, ``specserve generate`` and ``specserve chat``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import models
from .models import ModelError, UnknownModelError
from .protocol import PROPOSERS, SpecserveError, TreeSpec

EXIT_OK = 0
EXIT_ERROR = 1  # a model error: download, integrity, conversion ...
EXIT_USAGE = 2  # bad arguments, unknown model names (argparse uses 2 as well)
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------- models


def _cmd_models_list(args: argparse.Namespace) -> int:
    rows = models.list_models()
    table = [("NAME", "CACHED", "SIZE", "DESCRIPTION")]
    for r in rows:
        table.append(
            (r["name"], "yes" if r["cached"] else "no", models._human(r["size_bytes"]), r["description"])
        )
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    print(f"\ncache: {models.specserve_home() / 'models'}  (set SPECSERVE_HOME to move it)")
    return EXIT_OK


def _cmd_models_pull(args: argparse.Namespace) -> int:
    for name in args.names:  # validate every name before downloading anything
        models.get_spec(name)
    for name in args.names:
        models.pull(name, force=args.force, log=lambda msg: print(msg, flush=True))
    return EXIT_OK


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list and download the registry models")
    msub = p.add_subparsers(dest="models_command", metavar="{list,pull}", required=True)

    p_list = msub.add_parser("list", help="show the registry models and whether they are cached")
    p_list.set_defaults(func=_cmd_models_list)

    p_pull = msub.add_parser("pull", help="download, verify and convert registry models")
    p_pull.add_argument("names", nargs="+", metavar="NAME", help="registry model name(s)")
    p_pull.add_argument("--force", action="store_true", help="pull again even when already cached")
    p_pull.set_defaults(func=_cmd_models_pull)


# --------------------------------------------------------------------------- generate


def _cmd_generate(args: argparse.Namespace) -> int:
    from .decoder import SpeculativeDecoder
    from .loading import set_torch_threads
    from .protocol import DRAFT_POOL_PROPOSERS, SamplingParams, Speculation

    spec = Speculation(proposer=_default_proposer(args), k=args.k, tree=_tree_spec(args)).overridden(
        method=args.method, proposer=args.proposer, shape=args.shape, acceptance=args.acceptance, policy=args.policy,
        solo_k=args.solo_k)
    if spec.proposer in DRAFT_POOL_PROPOSERS and not args.draft:
        raise SpecserveError(f"proposer {spec.proposer} needs --draft MODEL (or use --proposer none)")
    heads = None
    if spec.co_located:  # missing heads, or heads of another method, fail before loading gigabytes
        from .heads import require_heads

        heads = str(require_heads(args.target, args.heads or "default", spec.proposer))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))
    set_torch_threads(args.threads)
    decoder = SpeculativeDecoder.from_pretrained(
        args.target, draft=args.draft if spec.proposer in DRAFT_POOL_PROPOSERS else None,
        heads=heads, dtype=args.dtype, device=args.device,
        speculation=spec, draft_min_confidence=args.draft_confidence,
        draft_quantize=args.draft_quantize)
    prompts = args.prompt
    if args.chat:  # the template writes the special tokens itself
        tok = decoder.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)
                   for p in prompts]
    outputs = decoder.generate(prompts, params)
    report = decoder.last_report
    if args.json:
        import json

        print(json.dumps({
            "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                         "stats": o.stats.as_dict()} for o in outputs],
            "tokens_per_second": round(report.tokens_per_second, 3),
            "seconds": round(report.seconds, 3),
            "stats": report.stats.as_dict(),
        }, indent=1))
        return EXIT_OK
    for o in outputs:
        print(o.text)
        print(f"--- finish_reason={o.finish_reason} tokens={len(o.token_ids)}")
    s = report.stats
    print(f"speculation: {spec.describe()}  dtype={models.resolve_dtype(args.dtype, args.device)}")
    print(f"tokens/s:                 {report.tokens_per_second:.2f}  ({s.generated_tokens} tokens in {report.seconds:.2f} s)")
    print(f"mean accepted length:     {s.mean_accepted_length:.2f}  (tokens per target step, bonus included)")
    print(f"acceptance rate:          {s.acceptance_rate:.3f}  ({s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens)")
    print(f"target forward passes:    {decoder.verifier.worker.forward_passes}")
    return EXIT_OK


def _default_proposer(args: argparse.Namespace) -> str:
    """draft with --draft, the heads' own method with --heads, else none."""
    if args.draft:
        return "draft"
    if args.heads:
        from .heads import find_heads, heads_method

        directory = find_heads(args.target, args.heads)
        return heads_method(directory) if directory is not None else "medusa"
    return "none"


def _tree_spec(args: argparse.Namespace):
    import json

    shape = args.tree_shape
    if shape and shape.lstrip().startswith("["):
        try:
            shape = tuple(tuple(int(r) for r in path) for path in json.loads(args.tree_shape))
        except (ValueError, TypeError):
            raise SpecserveError("--tree-shape takes JSON paths of child ranks, e.g. '[[0], [1], [0, 0]]', "
                                 "or a shape's name (mc_sim_7b_63)") from None
    return TreeSpec(budget=args.tree_budget, depth=args.tree_depth, width=args.tree_width,
                    min_score=args.tree_min_score, shape=shape, rerank=args.tree_rerank)


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with speculative decoding in this process",
                              description="Generate with a target model and (optionally) a draft model, "
                                          "then print the text and the speculation statistics.")
    p.add_argument("--target", required=True, help="registry name, local directory or Hub id")
    p.add_argument("--draft", help="draft model (same tokenizer as the target)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat to decode several prompts as one batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")
    p.add_argument("--proposer", choices=list(PROPOSERS),
                   help="where drafts come from: ngram = prompt lookup, no model (default: draft with --draft, "
                        "the heads' method (medusa, hydra or redrafter) with --heads, else none)")
    p.add_argument("--shape", choices=["chain", "tree"], help="a chain of -k tokens (default) or a token tree")
    p.add_argument("--method", choices=["draft", "tree", "none"],
                   help="older spelling: draft = --proposer draft --shape chain, tree = --proposer draft --shape tree")
    p.add_argument("--heads", help="Medusa, Hydra or ReDrafter heads from `specserve train-heads` (a directory; "
                                   "default with --proposer medusa|hydra|redrafter: "
                                   "$SPECSERVE_HOME/heads/<target>-<proposer>)")
    p.add_argument("--acceptance", choices=["exact", "typical"],
                   help="exact (default, lossless) or typical (Medusa's typical acceptance: LOSSY)")
    p.add_argument("-k", "--k", type=int, default=4, help="draft tokens per round (default 4)")
    p.add_argument("--policy", choices=["fixed", "adaptive"], default="fixed",
                   help="fixed: draft k (a tree: its depth) every round (default); adaptive: the load-aware "
                        "policy drafts 0..k per round, whichever its measurements say is fastest")
    p.add_argument("--solo-k", type=int, default=None,
                   help="--policy adaptive, a chain: the longest chain while one prompt decodes alone (at least k; "
                        "default k)")
    defaults = TreeSpec()
    p.add_argument("--tree-budget", type=int, default=defaults.budget,
                   help=f"--shape tree: most draft nodes per round (default {defaults.budget})")
    p.add_argument("--tree-depth", type=int, default=defaults.depth,
                   help=f"--shape tree: most levels per round (default {defaults.depth})")
    p.add_argument("--tree-width", type=int, default=defaults.width,
                   help=f"--shape tree: new nodes per level (default {defaults.width})")
    p.add_argument("--tree-min-score", type=float, default=defaults.min_score,
                   help="--shape tree: skip nodes whose path probability under the draft is lower "
                        f"(default {defaults.min_score})")
    p.add_argument("--tree-rerank", action="store_true",
                   help="--shape tree, dynamic: grow --tree-width nodes a level to --tree-depth, then keep the "
                        "--tree-budget best by path probability (EAGLE-2's reranking; sampled draft-model trees "
                        "grow under the budget instead)")
    p.add_argument("--tree-shape", help="--shape tree: a static shape, JSON paths of child ranks, "
                                        "e.g. '[[0], [1], [0, 0]]', or a shape's name: mc_sim_7b_63 (Medusa's "
                                        "and Hydra's 63-node default) (default: dynamic)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="same seed, same output")
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default auto: bfloat16 on "
                   "CUDA and on CPUs with native bf16 matrix products, else float32)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    p.add_argument("--draft-confidence", type=float, default=0.5,
                   help="stop a draft chain early once the draft's own probability of its token falls "
                        "below this (default 0.5; 0 always drafts k tokens)")
    p.add_argument("--draft-quantize", choices=["none", "int8"], default="none",
                   help="int8: the draft's linears in int8 on CPU (faster drafts; the output stays the target's)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.set_defaults(func=_cmd_generate)


# --------------------------------------------------------------------------- bench


def _cmd_bench(args: argparse.Namespace) -> int:
    from .benchmarks.suite import main as bench_main

    return bench_main(args.bench_args)


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", add_help=False, prefix_chars="\0",
                              help="benchmark specserve against its peers (specserve bench --help)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)


def _cmd_replay_heads(args: argparse.Namespace) -> int:
    from specserve.benchmarks.replay import main as replay_main

    return replay_main(args.replay_args)


def add_replay_heads_parser(subparsers) -> None:
    p = subparsers.add_parser("replay-heads", add_help=False, prefix_chars="\0",
                              help="accepted length of head trees offline, from the target's greedy continuations "
                                   "(specserve replay-heads --help)")
    p.add_argument("replay_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_replay_heads)


# --------------------------------------------------------------------------- chat


def _cmd_chat(args: argparse.Namespace) -> int:
    import urllib.error

    import grpc

    from .chat import chat, grpc_stream, http_error_message, http_stream, prompts

    reply, models_of = http_stream(args.http) if args.http else grpc_stream(args.grpc, args.application)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.speculation:
        params["speculation"] = json.loads(args.speculation)
    try:
        model = args.model or models_of()[0]
        chat(reply, model, params, iter(args.message) if args.message else prompts())
    except grpc.RpcError as exc:
        print(f"specserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_ERROR
    except urllib.error.HTTPError as exc:
        print(f"specserve: error: HTTP {exc.code}: {http_error_message(exc)}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a running specserve over gRPC (default) or HTTP",
                              description="Streams each reply. Without --message, reads turns from stdin "
                              "until an empty line.")
    transport = p.add_mutually_exclusive_group()
    transport.add_argument("--grpc", default="localhost:9000", metavar="HOST:PORT",
                           help="Serve's gRPC proxy (default localhost:9000)")
    transport.add_argument("--http", metavar="URL", help="the HTTP API instead, e.g. http://localhost:8000")
    p.add_argument("--application", help="gRPC: the Serve application's name (when the cluster runs several)")
    p.add_argument("--model", help="default: the first the server lists")
    p.add_argument("--message", action="append", help="a user turn (repeatable); no stdin")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int)
    p.add_argument("--speculation", help='the per-request override as JSON, e.g. \'{"proposer": "none"}\'')
    p.set_defaults(func=_cmd_chat)


# --------------------------------------------------------------------------- train-heads


def _cmd_train_heads(args: argparse.Namespace) -> int:
    from .heads import default_cache_dir
    from .heads.train import TrainOptions, train_heads, validate_options

    options = TrainOptions(
        method=args.method, num_heads=args.heads, num_layers=args.layers, steps=args.steps, lr=args.lr,
        batch_size=args.batch_size, seq_len=args.seq_len, max_tokens=args.max_tokens,
        generated_tokens=args.generated_tokens, generated_share=args.generated_share, chat_turns=args.chat_turns,
        head_vocab_size=args.head_vocab, own_lm_head=args.own_lm_head, prefix_window=args.prefix_window,
        seed=args.seed, dtype=args.dtype, teacher_top=args.teacher_top, dropout=args.dropout,
        weight_decay=args.weight_decay,
        device=args.device, threads=args.threads, checkpoint_every=args.checkpoint_every,
        progress=not args.no_progress)
    validate_options(options)  # before any model is loaded
    result = train_heads(args.target, args.out, options, resume=args.resume, force=args.force,
                          cache_dir=args.cache_dir or default_cache_dir(), log=lambda msg: print(msg, flush=True))
    report = result.report
    print(f"heads: {result.out_dir}  ({report['steps']} steps in {report['train_seconds']:.0f} s, "
          f"{report['train_tokens']} training tokens, head vocabulary {report['head_vocab_size']})")
    print("held-out top-1 accuracy (head i predicts token t+i+2):")
    own = report["heldout_own_accuracy_after"]
    for i, (before, after) in enumerate(zip(report["heldout_accuracy_before"], report["heldout_accuracy_after"])):
        own_text = f"; on the target's own continuations {own[i]:.3f}" if own else ""
        print(f"  head {i}: {after:.3f} on text (untrained {before:.3f}){own_text}")
    if report["score_temperatures"]:
        print("score temperatures (trees divide each head's logits by them): "
              + " ".join(f"{t:.3f}" for t in report["score_temperatures"]))
    return EXIT_OK


def _cmd_export_heads(args: argparse.Namespace) -> int:
    from .heads.medusa import export_vllm, read_config
    from .models import lm_head_weight, parse_dtype

    config = read_config(args.heads)  # refuses Hydra and ReDrafter heads: vLLM has no such model
    target = args.target or config.target
    if target is None:
        raise SpecserveError(f"{args.heads} does not name its target: give --target")
    out = export_vllm(args.heads, lm_head_weight(target), args.out, parse_dtype(args.dtype))
    print(f"vLLM Medusa heads: {out}  (speculative_config: {{method: medusa, model: {out}, "
          f"num_speculative_tokens: <= {config.num_heads}}})")
    return EXIT_OK


def add_export_heads_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export-heads", help="write Medusa heads in the layout vLLM loads (for native mode's method: medusa)",
        description="Write Medusa heads trained by `specserve train-heads` in the layout vLLM's Medusa model "
                    "loads, for `speculative_config: {method: medusa, model: OUT}` (native mode, or vLLM itself). "
                    "It spans the whole vocabulary (vLLM cannot load a truncated one): vocabulary x hidden "
                    "values per projection, 0.9 GB in float32 for Qwen2.5-1.5B.")
    p.add_argument("heads", help="a directory written by `specserve train-heads --method medusa`")
    p.add_argument("--target", help="the model the heads were trained on (default: the one their config names)")
    p.add_argument("--out", help="where to write them (default HEADS/vllm)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16: vLLM casts the "
                                                      "weights to the target's dtype when it loads them")
    p.set_defaults(func=_cmd_export_heads)


def add_train_heads_parser(subparsers) -> None:
    from .heads.train import TrainOptions

    d = TrainOptions()
    p = subparsers.add_parser(
        "train-heads", help="train Medusa, Hydra or ReDrafter heads on a target from offline text",
        description="Train Medusa, Hydra or ReDrafter heads by distillation from the target on offline text (HumanEval, MT-Bench, "
                    "Python's standard library; the prompts the benchmarks use are held out). The target's "
                    "hidden states are cached under --cache-dir, which every method shares; OUT/checkpoint.pt lets "
                    "--resume continue.")
    p.add_argument("--method", default="medusa",
                   help="head method: medusa (default; heads on h_t), hydra (heads that also read the tokens "
                        "drafted before them) or redrafter (one recurrent drafter, beam search; --heads is its "
                        "number of steps, the longest beam it serves)")
    p.add_argument("--target", required=True, help="registry name, local directory or Hub id")
    p.add_argument("--out", help="where the heads go (default $SPECSERVE_HOME/heads/<target>-<method>)")
    p.add_argument("--heads", type=int, default=d.num_heads, help=f"number of heads (default {d.num_heads})")
    p.add_argument("--layers", type=int, default=d.num_layers,
                   help=f"residual blocks per head (default {d.num_layers}; hydra, redrafter: the input block counts "
                        "as one)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"positions per step (default {d.batch_size})")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help=f"tokens per forward pass while caching hidden states (default {d.seq_len})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help=f"training text budget in tokens (default {d.max_tokens})")
    p.add_argument("--generated-tokens", type=int, default=d.generated_tokens,
                   help=f"self-distillation: tokens the target writes as training text, continuing training "
                        f"prompts greedily (default {d.generated_tokens}; 0: none)")
    p.add_argument("--generated-share", type=float, default=d.generated_share,
                   help=f"share of each step's positions drawn from those continuations "
                        f"(default {d.generated_share})")
    p.add_argument("--chat-turns", type=int, choices=(1, 2), default=d.chat_turns,
                   help=f"MT-Bench turns the target answers for those continuations (default {d.chat_turns}; 2: "
                        "also each question's second turn, after its own first answer: at most 256 more "
                        "tokens per question, on top of --generated-tokens)")
    p.add_argument("--head-vocab", type=int, help="tokens the heads can propose (default: the whole vocabulary "
                                                  "up to 65536 tokens, else the 32768 most frequent)")
    p.add_argument("--own-lm-head", action="store_true",
                   help="medusa: train a copy of the lm_head per head (default: share the target's, frozen)")
    p.add_argument("--prefix-window", type=int, default=d.prefix_window,
                   help="hydra: Hydra++ prefix attention over the target's last N hidden states before the "
                        "heads (default 0: off; 16 is a good start)")
    p.add_argument("--dropout", type=float, default=d.dropout,
                   help=f"while training, dropout on the hidden state the heads read and on their features "
                        f"(default {d.dropout}; Hydra++ trains with 0.2)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW weight decay (default {d.weight_decay}; Hydra++ trains with 0.1)")
    p.add_argument("--teacher-top", type=int, default=d.teacher_top,
                   help=f"distil from the target's {d.teacher_top} most likely tokens per position, computed once "
                        f"before training (default {d.teacher_top}; 0: its whole distribution, every step: slower)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"same seed, same heads (default {d.seed})")
    p.add_argument("--dtype", default=d.dtype,
                   help=f"the target's dtype while caching hidden states (default {d.dtype}); heads train in float32")
    p.add_argument("--device", help="cuda when available, else cpu (default)")
    p.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help=f"steps between checkpoints (default {d.checkpoint_every})")
    p.add_argument("--cache-dir", help="where the target's hidden states and continuations are cached (default "
                                       "$SPECSERVE_HOME/heads/cache, shared by every method and target: the files "
                                       "are named by a hash of what made them)")
    p.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out (a finished run: "
                   "evaluate and fit the score temperatures again, training no further)")
    p.add_argument("--force", action="store_true", help="train again over heads already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_train_heads)


# --------------------------------------------------------------------------- kuberay


def _cmd_kuberay_render(args: argparse.Namespace) -> int:
    from . import kuberay

    if args.check:
        stale = kuberay.stale_files()
        for rel in stale:
            print(f"stale: deploy/{rel} (run `specserve kuberay render`)", file=sys.stderr)
        return EXIT_ERROR if stale else EXIT_OK
    from pathlib import Path

    if args.registry and Path(args.out).resolve() == kuberay.DEPLOY:
        raise SpecserveError("--registry: give --out too; deploy/ holds the files rendered with the plain image "
                             "names (tests/test_deploy.py compares them)")
    for path in kuberay.write_all(Path(args.out), registry=args.registry or ""):
        print(f"wrote {path}")
    return EXIT_OK


def _cmd_kuberay_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import kuberay

    errors = [e for name in args.files for e in kuberay.check_file(Path(name))]
    for line in errors:
        print(line, file=sys.stderr)
    if not errors:
        print(f"ok: {len(args.files)} file(s) valid against the KubeRay {kuberay.KUBERAY_VERSION} CRD, "
              "ServeDeploySchema and specserve's args")
    return EXIT_ERROR if errors else EXIT_OK


def _cmd_kuberay_crd(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import kuberay

    out = kuberay.write_crd_schema(Path(args.crd).read_text())
    print(f"wrote {out}")
    return EXIT_OK


def add_kuberay_parser(subparsers) -> None:
    from .kuberay import DEPLOY

    p = subparsers.add_parser("kuberay", help="KubeRay RayServices under deploy/, generated from manifests/*.yaml")
    sub = p.add_subparsers(dest="kuberay_command", metavar="{render,check,crd}", required=True)
    render = sub.add_parser("render", help="write deploy/*/rayservice.yaml and deploy/monitoring/ from the manifests")
    render.add_argument("--check", action="store_true", help="write nothing; exit 1 when a committed file is stale")
    render.add_argument("--registry", help="image registry prefix, e.g. registry.example.com/ml: the pods run "
                        "REGISTRY/specserve:<tag> (needs --out)")
    render.add_argument("--out", default=str(DEPLOY),
                        help="folder to write into (default: the repository's deploy/)")
    render.set_defaults(func=_cmd_kuberay_render)
    chk = sub.add_parser("check", help="validate RayService files offline: the CRD schema (unknown fields "
                         "rejected), then serveConfigV2 against ServeDeploySchema and specserve's args")
    chk.add_argument("files", nargs="+", metavar="FILE")
    chk.set_defaults(func=_cmd_kuberay_check)
    crd = sub.add_parser("crd", help="vendor the RayService v1 schema from a KubeRay CRD file "
                         "(ray.io_rayservices.yaml) into deploy/crds/")
    crd.add_argument("crd", metavar="CRD_YAML")
    crd.set_defaults(func=_cmd_kuberay_crd)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="Exact speculative decoding for LLMs, served on Ray Serve."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_models_parser(subparsers)
    add_generate_parser(subparsers)
    add_bench_parser(subparsers)
    add_replay_heads_parser(subparsers)
    add_chat_parser(subparsers)
    add_train_heads_parser(subparsers)
    add_export_heads_parser(subparsers)
    add_kuberay_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or EXIT_OK)
    except (UnknownModelError, SpecserveError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModelError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
