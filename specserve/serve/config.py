"""Typed builder arguments (`args:` of `import_path: specserve.serve:build_app`).

Torch-free: the Serve controller and `serve run` validate these without loading a model.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from specserve.proposers.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N
from specserve.protocol import (
    ACCEPTANCES, DRAFT_POOL_PROPOSERS, HEAD_PROPOSERS, MAX_K, MAX_PIPELINE, MAX_TREE_NODES, POLICIES, PROPOSERS, SHAPES,
    Speculation, SpecserveError, TreeSpec, TypicalAcceptance, from_method,
)


DEFAULT_PIPELINE = 4  # speculation.pipeline where both pools run on CUDA devices


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Checked(_Strict):
    """Settings whose `spec()` builds a protocol object that checks them together (a tree's
    shape against its budget, solo_k against k and the policy): checked when the app is built,
    not in a replica."""

    @model_validator(mode="after")
    def _valid_spec(self):
        try:
            self.spec()
        except SpecserveError as exc:
            raise ValueError(str(exc)) from None
        return self

    def spec(self):
        raise NotImplementedError


class _DeploymentArgs(_Strict):
    """Ray Serve deployment options shared by pools and the router, passed through."""

    ALWAYS: ClassVar[tuple[str, ...]] = ("ray_actor_options", "max_ongoing_requests", "max_queued_requests")
    IF_SET: ClassVar[tuple[str, ...]] = ("num_replicas", "autoscaling_config")

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self):
        if getattr(self, "num_replicas", None) not in (None, "auto") and getattr(self, "autoscaling_config", None):
            raise ValueError("give num_replicas or autoscaling_config, not both")
        return self

    def deployment_options(self) -> dict[str, Any]:
        options = {name: getattr(self, name) for name in self.ALWAYS}
        options.update({name: getattr(self, name) for name in self.IF_SET if getattr(self, name) is not None})
        return options


class PoolArgs(_DeploymentArgs):
    """One model pool: a Ray Serve deployment whose replicas each hold the model."""

    model: str = Field(description="registry name, local directory or Hub id")
    engine: Literal["torch", "vllm"] = Field(
        "torch", description="torch: specserve's own engine (CPU, one GPU; every method). vllm: vLLM's AsyncLLM "
        "(target and draft pools; tensor parallel from engine_kwargs; chains; exact for greedy, and for sampling "
        "with 1 <= top_k <= engine_kwargs.score_logprobs, default 20); must be installed where Ray runs (make vllm-env)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="engine-specific options")
    heads: str | None = Field(None, description="target only: Medusa, Hydra or ReDrafter heads trained by `specserve "
                              "train-heads` (a directory, or 'default' for $SPECSERVE_HOME/heads/<model>-<method>, "
                              "the method being speculation.proposer's, else medusa); the target pool then becomes "
                              "a co-located pool that verifies and proposes in one pass")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA (float16 where it has no bf16) and on CPUs with native bf16 "
        "matrix products (AVX-512 or AVX-NE-CONVERT); float32 on other CPUs, where bf16 is emulated and a "
        "verify pass of k+1 tokens costs about k+1 decode steps (specserve.models.resolve_dtype)")
    device: str = "cpu"
    torch_threads: int | None = Field(None, ge=1, description="torch threads per replica (default: num_cpus)")
    kv_cache_memory: ByteSize = Field(
        ByteSize(1 << 30), description="KV cache per replica, in bytes ('2GiB', '512MiB' or a number), "
        "preallocated; least recently used requests are evicted when it is full. A token costs "
        "layers x 2 x kv_heads x head_dim x dtype bytes (28 KiB for Qwen2.5-1.5B in bf16, 56 KiB in fp32)")
    cuda_graphs: bool | None = Field(
        None, description="torch engine on CUDA: run decode and chain-verify passes (up to 16 requests, 8 new "
        "tokens each, 8192 positions) as static-shape passes replayed as CUDA graphs, each shape captured on "
        "first use; trees and prefill run eagerly. Exact: in float32 the logits equal the eager pass's. On an "
        "H100 a batch-1 decode step of Qwen2.5-Coder-1.5B's shapes took 5.2 ms against 31.5 eager "
        "(docs/bench/gpu-h100/cuda-graphs.md). Default: on for CUDA devices; CUDA only")
    linear_layout: Literal["auto", "one_row", "many_rows", "both"] = Field(
        "auto", description="torch engine on CPU: the oneDNN layout the linears are prepacked in. one_row is "
        "the fastest for a lone decode step; many_rows for verify passes and batched decode (a 5-row verify "
        "of the float32 1.5B target ran ~2x faster in it on AVX2, a lone step 5-20% slower); both keeps the "
        "two (twice the projections' memory) and lets each pass take its own. auto: both in float32, "
        "one_row in bf16")
    quantize: Literal["none", "int8"] = Field(
        "none", description="draft pools on the torch engine, CPU: int8 runs the draft's linears with int8 "
        "weights (one scale per output channel) and activations quantized per pass, PyTorch's x86 dynamic "
        "int8 kernel. The output stays exact: the draft only proposes and the target verifies; the draft's "
        "agreement with the target may drop a little (on HumanEval the 0.5B draft's accepted length was "
        "unchanged). A 2-core AVX2 CPU ran the 0.5B draft's matrices 3-5x faster than in float32. The target "
        "defines the output and is never quantized")
    greedy_screen: bool | None = Field(
        None, description="target pools on the torch engine, CPU, float32: greedy tokens through an int8 screen "
        "of the output layer: int8 logits with a proven error bound per token, then float32 logits for the few "
        "tokens that could still be the largest (specserve/engine/greedy_screen.py). The token is the float32 "
        "argmax, always; sampled requests still get full float32 logits. Reads a quarter of the output layer's "
        "bytes: a decode step of the float32 1.5B target on a 2-core AVX2 CPU went from 396 to 367 ms. Default: "
        "on where it applies (float32 on CPU, x86 int8 kernels); false turns it off")
    prefill_chunk_tokens: int = Field(
        256, ge=16, description="most prompt tokens one pass computes beyond decode rounds: a longer prompt "
        "is cached chunk by chunk, riding along with the other requests' rounds instead of stalling them")
    time_decode_passes: bool = Field(
        True, description="target pools on the torch engine: time decode passes of 1 to max_batch_size calls "
        "when a replica starts (about 5 s for the float32 1.5B target on a 2-core CPU), so the router predicts "
        "what turning speculation off would decode at from them (LoadModel.off_goodput); false skips it, and "
        "the prediction extrapolates the step times the pool reports while it runs")
    # Continuous batching: calls that arrive while a forward pass runs join the next one.
    max_batch_size: int = Field(16, ge=1, le=1024)
    batch_wait_timeout_s: float = Field(0.002, ge=0, le=1)
    batch_join_fraction: float = Field(
        0.5, ge=0, le=1, description="a pass may wait up to this share of a pass for calls of requests "
        "due back (answered in an earlier pass, expected from their usual return time), so streams "
        "share passes instead of splitting into alternating half-full ones; 0 turns it off")
    abandoned_cache_s: float = Field(
        300, gt=0, description="a request's cache that no call has touched for this long is released at the "
        "next health check: its router died mid-request and will never release it (a live request whose "
        "cache is dropped only recomputes it from the token ids its next call carries)")
    # Ray Serve deployment options, passed through.
    num_replicas: int | Literal["auto"] | None = None
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: str | None = None
    # A pool call only waits in the replica's batcher, which is cheap; the routers bound the
    # requests. At this cap the replica rejects calls and Serve's routers back off and probe
    # it, which on a busy replica stalled one router's draft calls for over a minute.
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int = Field(-1, ge=-1)
    health_check_period_s: float = Field(10, gt=0)
    health_check_timeout_s: float = Field(60, gt=0)

    ALWAYS: ClassVar[tuple[str, ...]] = _DeploymentArgs.ALWAYS + ("health_check_period_s", "health_check_timeout_s")
    IF_SET: ClassVar[tuple[str, ...]] = _DeploymentArgs.IF_SET + ("placement_group_bundles", "placement_group_strategy")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "max_cached_tokens" in data:
            raise ValueError("max_cached_tokens was replaced by kv_cache_memory, a budget in bytes: write e.g. "
                             "kv_cache_memory: 2GiB (a Qwen2.5-1.5B token costs 28 KiB in bf16)")
        return data

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @model_validator(mode="after")
    def _graphs_need_cuda(self):
        if self.cuda_graphs and not self.on_cuda:
            raise ValueError(f"cuda_graphs needs a CUDA device, not device: {self.device}")
        if self.greedy_screen and (self.on_cuda or self.engine != "torch"):
            raise ValueError(f"greedy_screen is the torch engine's on CPU; not {self.engine} on {self.device}")
        if self.quantize != "none" and (self.on_cuda or self.engine != "torch"):
            raise ValueError(f"quantize: {self.quantize} is the torch engine's on CPU; "
                             f"not {self.engine} on {self.device} (vLLM quantizes through engine_kwargs)")
        return self


class TreeArgs(_Checked):
    """Method `tree`: how the draft grows its token tree each round (see TreeSpec)."""

    budget: int = Field(TreeSpec.budget, ge=1, le=MAX_TREE_NODES, description="most draft nodes per round")
    depth: int = Field(TreeSpec.depth, ge=1, le=MAX_K, description="most levels per round")
    width: int = Field(TreeSpec.width, ge=1, le=MAX_TREE_NODES, description="new nodes per level (dynamic)")
    min_score: float = Field(TreeSpec.min_score, ge=0, lt=1,
                             description="skip nodes whose path probability under the draft is lower (dynamic)")
    shape: list[list[int]] | str | None = Field(None, description="a static shape: paths of child ranks, e.g. "
                                                "[[0], [1], [0, 0]], or a known shape's name (mc_sim_7b_63: "
                                                "Medusa's and Hydra's 63-node default); budget and depth then "
                                                "follow from it")
    rerank: bool = Field(False, description="dynamic: grow width nodes a level to depth, then keep the budget "
                         "best by path probability (EAGLE-2's reranking); trees whose children a draft model "
                         "draws (sampled requests) grow under the budget instead")

    def spec(self) -> TreeSpec:
        return TreeSpec(**self.model_dump())  # TreeSpec turns the shape's lists into tuples


class TypicalArgs(_Strict):
    """Medusa's typical acceptance (LOSSY; used only with `acceptance: typical`)."""

    posterior_threshold: float = Field(TypicalAcceptance.posterior_threshold, gt=0, le=1)
    posterior_alpha: float = Field(TypicalAcceptance.posterior_alpha, gt=0, le=1)


class NgramArgs(_Strict):
    """Prompt lookup (proposer `ngram`, and the fallback while a draft pool is down)."""

    max_n: int = Field(DEFAULT_MAX_N, ge=1, le=16, description="longest n-gram looked up (tried first)")
    min_n: int = Field(DEFAULT_MIN_N, ge=1, le=16, description="shortest n-gram looked up (1 also matches "
                       "single tokens: drafts in about twice as many rounds for few more accepted tokens)")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_n > self.max_n:
            raise ValueError(f"ngram.min_n ({self.min_n}) must not exceed ngram.max_n ({self.max_n})")
        return self


class SpeculationArgs(_Checked):
    """Deployment-wide defaults; a request may override any of proposer, shape, k, tree and
    acceptance (`"speculation"` in the request body)."""

    proposer: Literal[PROPOSERS] = Field("draft", description="none | draft (a draft pool) | medusa | hydra "  # type: ignore[valid-type]
                                         "| redrafter (heads on the target, co-located) | ngram (prompt lookup, no model) | native (vLLM's own "
                                         "speculative decoding in a vllm target pool with engine_kwargs.speculative_config)")
    shape: Literal[SHAPES] = Field("chain", description="chain (k tokens) | tree (dynamic, or static "  # type: ignore[valid-type]
                                   "when tree.shape is set)")
    k: int = Field(4, ge=0, le=MAX_K, description="chain length")
    tree: TreeArgs = Field(default_factory=TreeArgs)
    acceptance: Literal[ACCEPTANCES] = Field("exact", description="exact (lossless) | typical (Medusa's "  # type: ignore[valid-type]
                                             "typical acceptance: LOSSY, opt-in)")
    typical: TypicalArgs = Field(default_factory=TypicalArgs)
    policy: Literal[POLICIES] = Field("adaptive", description="adaptive (load-aware: each round drafts 0..k "  # type: ignore[valid-type]
                                      "levels, whichever the measured acceptance and pool load say is fastest) "
                                      "| fixed (k levels every round)")
    solo_k: int | None = Field(
        None, ge=0, le=MAX_K, description="adaptive chains: the longest chain the policy may draft for a request "
        "alone in the router's rounds (at least k; default k). Alone, a deep draft where the draft model is sure "
        "costs only that request's round; with other requests in flight every round stays at k at most, since a "
        "deep draft in a shared batch makes every request wait (code on a 2-core CPU, cap 8 for everyone: 1.06x "
        "always on's k = 4 at 1 stream, 0.70x at 8 streams; docs/bench/adaptive-cap8-avx2)")
    ngram: NgramArgs = Field(default_factory=NgramArgs)
    draft_min_confidence: float = Field(0.5, ge=0, le=1)
    draft_top_m: int = Field(256, ge=1)
    # A draft pool silent this long (no reply to any call) beyond a call's expected time, and then
    # not answering a ping within it, is taken for down: the round drafts by prompt lookup. A busy
    # pool is waited for (serve/liveness.py).
    draft_timeout_s: float = Field(5.0, gt=0)
    # After a draft failure, rounds draft by prompt lookup for this long before trying the pool again.
    draft_retry_after_s: float = Field(2.0, ge=0)
    draft_ahead: bool | None = Field(
        None, description="while a round verifies, the draft pool drafts the next round on the guess that the "
        "whole chain is accepted and the bonus token is the draft's own next token; a round whose guess held "
        "starts with its draft in hand. Greedy draft chains only (exact: a greedy round emits the target's "
        "argmax whatever the draft). Default: on where the target and draft pools both run on CUDA devices, "
        "where the draft's steps run beside the target's verify (vLLM pools on an H200: 1.50x tokens/s at 1 "
        "stream, docs/bench/gpu-h200-vllm-4); off on CPUs, where the pools share cores and it only adds work")

    pipeline: int | None = Field(
        None, ge=0, le=MAX_PIPELINE, description="greedy draft chains: the draft pool drafts one running stream "
        "(its decode steps, not a new request per round) and up to this many k-token verifies of it run at once, each on the guess "
        "that the chunks before it are accepted; a rejected token ends the stream and a new one starts after the "
        "target's token. Exact (every emitted token is the target's argmax after tokens it accepted). 0: off, "
        "rounds take turns. Needs policy fixed (the load-aware policy picks k round by round). A request may set it "
        "too (`speculation.pipeline`). Default: 4 where the target and draft pools both run on CUDA devices and the "
        "policy is fixed (vLLM pools on an H200: 1.53-1.87x vLLM's own speculative decoding at 1 stream, "
        "docs/bench/gpu-h200-vllm-5); else 0")

    @model_validator(mode="before")
    @classmethod
    def _legacy_method(cls, data):
        """`method: none | draft | tree` is the older spelling of proposer + shape."""
        if isinstance(data, dict) and "method" in data:
            data = dict(data)
            try:
                proposer, shape = from_method(data.pop("method"), data.get("proposer"), data.get("shape"))
            except SpecserveError as exc:
                raise ValueError(str(exc)) from None
            data.update({name: value for name, value in (("proposer", proposer), ("shape", shape)) if value})
        return data

    def spec(self) -> Speculation:
        return Speculation(proposer=self.proposer, shape=self.shape, k=self.k, tree=self.tree.spec(),
                           acceptance=self.acceptance, typical=TypicalAcceptance(**self.typical.model_dump()),
                           policy=self.policy, pipeline=self.pipeline or 0, solo_k=self.solo_k or 0)


class RouterArgs(_DeploymentArgs):
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    num_replicas: int | Literal["auto"] | None = None
    autoscaling_config: dict[str, Any] | None = None
    # Beyond ongoing + queued requests the HTTP proxy answers 503 (Serve backpressure).
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(64, ge=-1)
    # A target call that fails because its replica died is retried on another replica.
    target_retry_timeout_s: float = Field(120.0, gt=0)


class AuthArgs(_Strict):
    """An API key every request must carry (HTTP `Authorization: Bearer <key>`, gRPC metadata
    `authorization: Bearer <key>`); health checks and the metrics port stay open. Name where the
    key is, never the key: the args are visible in Serve's config and dashboard."""

    api_key_env: str | None = Field(None, min_length=1, description="an environment variable holding the key "
                                    "(set on every node, e.g. from a Kubernetes Secret)")
    api_key_file: str | None = Field(None, min_length=1, description="a file holding the key (e.g. a mounted "
                                     "Kubernetes Secret); one key per line to accept several while rotating; "
                                     "read again when it changes")

    @model_validator(mode="after")
    def _a_source(self):
        if self.api_key_env is None and self.api_key_file is None:
            raise ValueError("auth needs api_key_env or api_key_file (or leave auth out to serve without a key)")
        return self


class LimitsArgs(_Strict):
    """What one request may ask for; over a limit it gets a 4xx (gRPC INVALID_ARGUMENT) naming the
    field. The defaults bound what a client can make the server hold without getting in the way
    of ordinary requests."""

    max_request_bytes: ByteSize = Field(ByteSize(2 << 20), ge=1024, description="largest HTTP request body "
                                        "or gRPC request message ('2MiB'); HTTP answers 413")
    max_prompt_tokens: int | None = Field(None, ge=1, description="most prompt tokens (default: the model's "
                                          "context less one)")
    max_tokens: int | None = Field(None, ge=1, description="largest max_tokens a request may ask for (default: "
                                   "no cap but the context; prompt + max_tokens must fit in it either way)")
    max_stop_sequences: int = Field(8, ge=0, le=64)
    # Streamed text is held back by the longest stop sequence, and every round searches for each.
    max_stop_length: int = Field(256, ge=1, le=4096, description="longest stop sequence, in characters")
    timeout_s: float = Field(600.0, gt=0, description="a request's deadline unless it asks for another "
                             "(`timeout_s` in the body or gRPC request); past it the request stops and its "
                             "caches are freed")
    max_timeout_s: float = Field(3600.0, gt=0, description="longest deadline a request may ask for")

    @model_validator(mode="after")
    def _timeouts_ordered(self):
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"limits.timeout_s ({self.timeout_s:g}) must not exceed limits.max_timeout_s "
                             f"({self.max_timeout_s:g})")
        return self


class AppArgs(_Strict):
    model_name: str | None = Field(None, description="name served at /v1/models (default: target.model)")
    target: PoolArgs
    draft: PoolArgs | None = None
    speculation: SpeculationArgs = Field(default_factory=SpeculationArgs)
    router: RouterArgs = Field(default_factory=RouterArgs)
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request gives none (shortened "
                                    "to what the context leaves)")
    auth: AuthArgs | None = Field(None, description="an API key for every request (default: none)")
    limits: LimitsArgs = Field(default_factory=LimitsArgs)
    # Compare the two tokenizers when the app is built (needs the tokenizer files locally or a
    # reachable hub); the pools compare again at start-up either way.
    check_vocabulary_at_build: bool = True
    fast_replica_calls: bool = Field(
        True, description="run the router and the pools in Ray Serve's throughput-optimized mode "
        "(RAY_SERVE_THROUGHPUT_OPTIMIZED=1 in each deployment's runtime_env: the router's calls to the pools go over "
        "gRPC straight to the replica, user code runs on each replica's own event loop, access logs are buffered; "
        "direct ingress stays off and replica logs still reach stderr). It cut the router's time per round outside "
        "the pools' compute from 21 to 14 ms on a 2-core CPU (README, 'Calls between replicas'). A pool's own "
        "ray_actor_options.runtime_env.env_vars win over it")

    @model_validator(mode="after")
    def _cross_field(self) -> AppArgs:
        proposer = self.speculation.proposer
        if proposer in DRAFT_POOL_PROPOSERS and self.draft is None:
            raise ValueError(f"speculation.proposer {proposer!r} needs a draft pool: add `draft:`, "
                             "or use proposer 'none' (or 'medusa' / 'hydra' / 'redrafter' with `target.heads`)")
        if proposer in HEAD_PROPOSERS and self.target.heads is None:
            raise ValueError(f"speculation.proposer {proposer!r} needs heads on the target: set `target.heads` "
                             "to a directory written by `specserve train-heads` (or 'default')")
        if proposer == "native" and (self.target.engine != "vllm" or "speculative_config" not in self.target.engine_kwargs):
            raise ValueError("speculation.proposer 'native' runs vLLM's own speculative decoding inside the target "
                             "pool: set target.engine: vllm and target.engine_kwargs.speculative_config (vLLM's, e.g. "
                             "{method: ngram, num_speculative_tokens: 4})")
        if self.limits.max_tokens is not None and self.max_tokens_default > self.limits.max_tokens:
            raise ValueError(f"max_tokens_default ({self.max_tokens_default}) must not exceed limits.max_tokens "
                             f"({self.limits.max_tokens})")
        if self.speculation.draft_ahead and self.draft is None:
            raise ValueError("speculation.draft_ahead drafts the next round in the draft pool while a round "
                             "verifies: it needs a draft pool (`draft:`)")
        if self.speculation.pipeline and self.draft is None:
            raise ValueError("speculation.pipeline verifies a draft pool's streamed draft: it needs a draft pool "
                             "(`draft:`)")
        if self.speculation.pipeline and self.speculation.policy != "fixed":
            raise ValueError("speculation.pipeline streams k-token chunks every round: set speculation.policy: fixed "
                             "(the adaptive policy picks k round by round)")
        on_cuda = self.draft is not None and self.target.on_cuda and self.draft.on_cuda
        if self.speculation.draft_ahead is None:
            self.speculation.draft_ahead = on_cuda
        if self.speculation.pipeline is None:
            self.speculation.pipeline = DEFAULT_PIPELINE if on_cuda and self.speculation.policy == "fixed" else 0
        if self.draft is not None and self.draft.heads is not None:
            raise ValueError("heads belong to the target pool (`target.heads`), not the draft pool")
        if self.draft is not None and self.draft.greedy_screen:
            raise ValueError("draft.greedy_screen: a draft's proposals read its logits as probabilities; the screen "
                             "serves greedy verification in the target pool (`target.greedy_screen`)")
        if self.target.quantize != "none":
            raise ValueError(f"target.quantize: {self.target.quantize} would change the output: the target defines "
                             "it (every method's output equals the target's own). Quantize the draft pool instead")
        return self

    @property
    def served_name(self) -> str:
        return self.model_name or self.target.model
