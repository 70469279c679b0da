"""Fuzzing both APIs: no generated input gets a server error or goes unanswered.

    python -m specserve.benchmarks.fuzz --minutes 10 [--out DIR]
    python -m specserve.benchmarks.fuzz --minutes 10 --url http://host:8000 --grpc host:9000 [--app NAME]

- HTTP: schemathesis generates requests from the server's own OpenAPI schema (`/openapi.json`),
  valid ones and invalid ones (negative mode), from the schema as it is and with `model` pinned
  to the served name (so that valid requests get past the model check and generate). Every
  answer must be below 500 and arrive within --timeout.
- gRPC: hypothesis builds GenerateRequest and ChatRequest messages covering every field (unset,
  in range, out of range, NaN, huge, wrong strings) and sends them through Serve's gRPC proxy to
  the four generation RPCs. Every answer must be OK or a status the API documents
  (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED), never INTERNAL or UNKNOWN, and arrive
  within --timeout (DEADLINE_EXCEEDED is a hang).

The fuzzer bounds one thing itself: a request to the served model asks for at most --max-tokens
tokens (more, or none, becomes that), so that a valid long generation is not mistaken for a hang.
Without --url it starts its own local Ray cluster (on --port and --port + 1000) serving SmolLM2.
Writes fuzz.json and fuzz.md into --out; exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from specserve.grpc import specserve_pb2 as pb

MAX_TOKENS = 8
DOCUMENTED_GRPC = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"}
GENERATION_BODIES = ("CompletionRequest", "ChatCompletionRequest")


@dataclass
class Tally:
    """What one API answered: counts per status, and the inputs that failed (as reproducible
    text: a curl command, or the message in protobuf text format)."""

    api: str
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return len(self.server_errors) + len(self.hangs)

    def as_dict(self) -> dict:
        return {"api": self.api, "sent": self.sent, "statuses": dict(self.statuses), "server_errors": len(self.server_errors),
                "hangs": len(self.hangs), "examples": (self.server_errors + self.hangs)[:10],
                "seconds": round(self.seconds, 1)}


def _settings(examples: int, run_seed: int):
    # generation only: failures are recorded, not raised, so there is nothing to shrink
    def wrap(test):
        return seed(run_seed)(settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                                       suppress_health_check=list(HealthCheck))(test))
    return wrap


# ---- HTTP: schemathesis from the OpenAPI schema -------------------------------------------------

def http_schemas(url: str, served: str, timeout_s: float = 30) -> list:
    """The server's schema as it is, and a copy whose request bodies name the served model."""
    import httpx
    import schemathesis

    raw = httpx.get(f"{url}/openapi.json", timeout=timeout_s).json()
    pinned = copy.deepcopy(raw)
    for name in GENERATION_BODIES:
        pinned["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [served]}
    return [schemathesis.openapi.from_dict(raw), schemathesis.openapi.from_dict(pinned)]


def http_strategy(schemas: list):
    from schemathesis import GenerationMode

    return st.one_of(*[s.as_strategy(mode) for s in schemas for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


def bound_generation(body, served: str, max_tokens: int = MAX_TOKENS):
    """The body with at most `max_tokens` to generate, when it asks the served model for more
    (or for the default)."""
    if not isinstance(body, dict) or body.get("model") != served:
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_tokens:
            body[key] = max_tokens
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = max_tokens
    return body


def send_http_case(case, url: str, served: str, timeout_s: float, tally: Tally) -> None:
    import requests

    case.body = bound_generation(case.body, served)
    tally.sent += 1
    try:
        response = case.call(base_url=url, timeout=timeout_s)
    except requests.exceptions.Timeout:
        tally.statuses["timeout"] += 1
        tally.hangs.append(f"no answer in {timeout_s:.0f} s: {_curl(case, url)}")
        return
    except requests.exceptions.RequestException as exc:  # a stream broken off mid-way: the server failed
        tally.statuses["broken"] += 1
        tally.server_errors.append(f"{type(exc).__name__}: {exc}"[:200] + f": {_curl(case, url)}")
        return
    tally.statuses[response.status_code] += 1
    if response.status_code >= 500:
        tally.server_errors.append(f"HTTP {response.status_code} {response.text[:200]!r}: {_curl(case, url)}")


def _curl(case, url: str) -> str:
    try:
        return case.as_curl_command(base_url=url)[:600]
    except Exception:
        return f"{case.method} {case.path} body={case.body!r}"[:600]


def fuzz_http(url: str, served: str, examples: int, *, timeout_s: float = 60, run_seed: int = 0,
              schemas: list | None = None, tally: Tally | None = None) -> Tally:
    tally = tally or Tally("http")
    strategy = http_strategy(schemas or http_schemas(url, served))
    started = time.monotonic()

    @_settings(examples, run_seed)
    @given(case=strategy)
    def run(case):
        send_http_case(case, url, served, timeout_s, tally)

    run()
    tally.seconds += time.monotonic() - started
    return tally


# ---- gRPC: hypothesis strategies over every field of the messages ---------------------------------

INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)
FLOAT32 = st.floats(width=32)  # NaN and infinities included
TEXT = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=24)  # protobuf strings are UTF-8
SMALL_INTS = st.integers(-3, 40)


def _maybe(strategy):
    return st.none() | strategy


def _message(cls, **fields):
    """A message with the drawn fields; None leaves a field unset (the server's default)."""
    return st.fixed_dictionaries({k: _maybe(v) for k, v in fields.items()}).map(
        lambda drawn: cls(**{k: v for k, v in drawn.items() if v is not None}))


def sampling_strategy(wild: bool):
    """In-range values (requests that generate), or anything a field can hold."""
    if not wild:
        return _message(pb.SamplingParams, temperature=st.floats(0, 2, width=32), top_p=st.floats(0.125, 1, width=32),
                        top_k=st.integers(0, 50), max_tokens=st.integers(1, MAX_TOKENS), seed=st.integers(0, 2 ** 32),
                        stop=st.lists(st.text(min_size=1, max_size=4), max_size=3), ignore_eos=st.booleans())
    return _message(pb.SamplingParams,
                    temperature=FLOAT32, top_p=FLOAT32, top_k=SMALL_INTS | INT32, max_tokens=SMALL_INTS | INT32,
                    seed=SMALL_INTS | INT64, stop=st.lists(TEXT, max_size=10), ignore_eos=st.booleans())


WORDS = ["none", "draft", "ngram", "medusa", "hydra", "redrafter", "native", "chain", "tree", "exact", "typical",
         "adaptive", "fixed", ""]


def speculation_strategy(wild: bool):
    """In-range values for this deployment (a draft pool, no heads), or any word or string."""
    ints = st.integers(0, 8)
    if wild:
        words = st.sampled_from(WORDS) | TEXT
        proposer = shape = acceptance = policy = words
        ints = SMALL_INTS | INT32
    else:
        proposer, shape = st.sampled_from(["none", "draft", "ngram"]), st.sampled_from(["chain", "tree"])
        acceptance, policy = st.just("exact"), st.sampled_from(["adaptive", "fixed"])
    tree = _message(pb.TreeOverride, budget=ints, depth=ints, width=ints,
                    min_score=st.floats(0, 1, width=32) | (FLOAT32 if wild else st.nothing()),
                    shape=st.lists(st.lists(st.integers(-1, 4) | (INT32 if wild else st.nothing()), max_size=5).map(
                        lambda r: pb.TreePath(ranks=r)), max_size=12), rerank=st.booleans())
    return _message(pb.SpeculationOverride, proposer=proposer, shape=shape, k=ints, tree=tree, acceptance=acceptance,
                    policy=policy)


def _model(served: str, wild: bool):
    return (st.sampled_from([served, ""]) | TEXT) if wild else st.just(served)


def generate_request_strategy(served: str, wild: bool):
    prompt_ids = st.lists(st.integers(0, 49151) | (INT32 if wild else st.nothing()), max_size=24)
    if not wild:
        prompt_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=24)
    return _message(pb.GenerateRequest, model=_model(served, wild), prompt=TEXT if wild else st.text(min_size=1, max_size=24),
                    prompt_token_ids=prompt_ids,
                    sampling=sampling_strategy(wild), speculation=speculation_strategy(wild))


def chat_request_strategy(served: str, wild: bool):
    role = st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | (TEXT if wild else st.nothing())
    message = _message(pb.ChatMessage, role=role, content=TEXT)
    return _message(pb.ChatRequest, model=_model(served, wild), messages=st.lists(message, min_size=0 if wild else 1, max_size=4),
                    sampling=sampling_strategy(wild), speculation=speculation_strategy(wild))


def bound_grpc(request, served: str, max_tokens: int = MAX_TOKENS):
    if request.model == served and (not request.sampling.HasField("max_tokens") or request.sampling.max_tokens > max_tokens):
        request.sampling.max_tokens = max_tokens
    return request


def grpc_call_strategy(served: str):
    """(RPC name, request) pairs over the four generation RPCs."""
    generate = generate_request_strategy(served, False) | generate_request_strategy(served, True)
    chat = chat_request_strategy(served, False) | chat_request_strategy(served, True)
    return st.one_of(st.tuples(st.sampled_from(["Generate", "GenerateStream"]), generate),
                     st.tuples(st.sampled_from(["Chat", "ChatStream"]), chat))


def send_grpc_call(stub, rpc: str, request, *, served: str, application: str | None, timeout_s: float,
                   tally: Tally) -> None:
    from google.protobuf import text_format

    request = bound_grpc(request, served)
    tally.sent += 1
    metadata = (("application", application),) if application else ()
    try:
        reply = getattr(stub, rpc)(request, metadata=metadata, timeout=timeout_s)
        if rpc.endswith("Stream"):
            list(reply)
        code = "OK"
    except grpc.RpcError as err:
        code = err.code().name
        details = err.details()
    tally.statuses[code] += 1
    if code in DOCUMENTED_GRPC:
        return
    text = f"{rpc} {code} {details!r}: {text_format.MessageToString(request, as_one_line=True)[:500]}"
    (tally.hangs if code == "DEADLINE_EXCEEDED" else tally.server_errors).append(text)


def fuzz_grpc(target: str, served: str, examples: int, *, application: str | None, timeout_s: float = 60,
              run_seed: int = 0, tally: Tally | None = None) -> Tally:
    from specserve.grpc import specserve_pb2_grpc as pb_grpc

    tally = tally or Tally("grpc")
    started = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.SpecserveStub(channel)

        @_settings(examples, run_seed)
        @given(call=grpc_call_strategy(served))
        def run(call):
            send_grpc_call(stub, *call, served=served, application=application, timeout_s=timeout_s, tally=tally)

        run()
    tally.seconds += time.monotonic() - started
    return tally


# ---- the long run ------------------------------------------------------------------------------

def markdown(tallies: list[Tally], config: dict) -> str:
    lines = ["# Fuzzing", "", f"`{config['command']}`: {config['minutes']} min, per-request timeout "
             f"{config['timeout_s']:.0f} s, at most {MAX_TOKENS} tokens generated per request.", "",
             "| API | inputs sent | server errors (5xx / INTERNAL, UNKNOWN ...) | hangs | answers by status |",
             "|---|---|---|---|---|"]
    for t in tallies:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(t.statuses.items(), key=lambda kv: str(kv[0])))
        lines.append(f"| {t.api} | {t.sent} | {len(t.server_errors)} | {len(t.hangs)} | {statuses} |")
    examples = [e for t in tallies for e in t.server_errors + t.hangs]
    if examples:
        lines += ["", "Failing inputs (first 10):", ""] + [f"- `{e}`" for e in examples[:10]]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _server(args):
    """The endpoints to fuzz: the ones given, or a SmolLM2 app on a local cluster of our own."""
    if args.url:
        yield args.url, args.grpc, args.app
        return
    from specserve.benchmarks import reliability as rel

    with rel.local_cluster(args.port, args.port + 1000, num_cpus=4):
        rel.deploy(rel.smol_app_args(args.served_name, target_replicas=1, router_replicas=1), "fuzz", "/")
        yield f"http://127.0.0.1:{args.port}", f"127.0.0.1:{args.port + 1000}", "fuzz"


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--url", help="HTTP base URL of a running app (default: start one)")
    parser.add_argument("--grpc", help="host:port of its gRPC proxy")
    parser.add_argument("--app", help="the Serve application's name (gRPC `application` metadata)")
    parser.add_argument("--served-name", default="smol", help="the model name the app serves")
    parser.add_argument("--port", type=int, default=8985, help="HTTP port of the local cluster (gRPC: +1000)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds before a request counts as hung")
    parser.add_argument("--batch", type=int, default=100, help="examples per hypothesis run (a new seed each)")
    parser.add_argument("--out", default="bench-results/fuzz")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    http, rpc = Tally("http"), Tally("grpc")
    with _server(args) as (url, grpc_target, application):
        schemas = http_schemas(url, args.served_name)
        deadline = time.monotonic() + args.minutes * 60
        run_seed = 0
        while time.monotonic() < deadline:  # HTTP and gRPC take turns, a fresh seed each batch
            fuzz_http(url, args.served_name, args.batch, timeout_s=args.timeout, run_seed=run_seed, schemas=schemas,
                      tally=http)
            if grpc_target:
                fuzz_grpc(grpc_target, args.served_name, args.batch, application=application, timeout_s=args.timeout,
                          run_seed=run_seed, tally=rpc)
            run_seed += 1
            print(json.dumps([http.as_dict(), rpc.as_dict()]), flush=True)
    tallies = [http] + ([rpc] if rpc.sent else [])
    config = {"command": "python -m specserve.benchmarks.fuzz " + " ".join(sys.argv[1:] if argv is None else argv),
              "minutes": args.minutes, "timeout_s": args.timeout}
    (out / "fuzz.json").write_text(json.dumps({"config": config, "results": [t.as_dict() for t in tallies]}, indent=1))
    (out / "fuzz.md").write_text(markdown(tallies, config))
    print((out / "fuzz.md").read_text())
    return 1 if any(t.failed for t in tallies) else 0


if __name__ == "__main__":
    raise SystemExit(main())
