"""The vLLM engine (`engine: vllm`, target and draft pools): one vLLM AsyncLLM per replica.

vLLM 0.32 takes no external draft tokens, so a round is verified by *scoring*: the request's
token ids plus its draft chain go in as a prompt with `prompt_logprobs`, and one greedy token
comes out. The rows of the draft positions (prompt logprobs) and the row after the last draft
token (the sampled token's logprobs) are the target's distributions for that round; specserve's
own acceptance turns them into tokens, with the request's own seed.

- Prefix cache: `prompt_logprobs` makes vLLM skip the prefix cache unless the request says
  `skip_reading_prefix_cache=False`, so it does. Hits are whole blocks, capped at len - 1: a
  round computes the draft, the new tokens and the rest of the last block (O(k), not
  O(context)). The rows of cached positions are not computed (garbage on the CPU runner): only
  rows after the cached prefix are read, and a round whose first row was cached (a retry of the
  same round) is scored again without the cache.
- Exactness: the logprobs are the raw model's top-N (`score_logprobs`, default 20) plus the
  draft token's. Greedy is exact (the argmax is rank 1): a greedy round asks for top-1 and reads
  each row's top token, with no full-vocabulary row. Sampling is exact when the request's
  top_k <= N: temperature, top-k and top-p then see every token they can keep. Other sampled
  requests are refused (EngineInfo.sampled_top_k_max). Chains only: a tree goes as a chain.

Draft pools (`role="draft"`): the draft generates its k tokens with vLLM. Greedy requests, and
sampled ones outside the exact regime, get the draft's greedy chain (law deterministic: exact
for any target sampling). Sampled requests with 1 <= top_k <= N are sampled by vLLM with the
round's seed, and the processed distributions they were drawn from (logprobs_mode
processed_logprobs, top-N, which hold every token top-k keeps) travel with them (law sampled).

Native mode (`speculation.proposer: native`, `engine_kwargs.speculative_config`): vLLM runs its
own speculative decoding (draft_model, eagle, medusa, ngram; `num_speculative_tokens_per_batch_size`
for load) inside the target pool behind the same router, API and failover: one vLLM request
per generation, its outputs streamed to the router as they come (`verify_stream`). Greedy
only: vLLM's sampled speculative path is not checked here (DESIGN.md), so sampled requests get
a 400.

vLLM is imported only inside this module's engine class (the router and the controller never
import it). Tensor parallelism comes from `engine_kwargs.tensor_parallel_size`; with more than
one GPU vLLM uses Ray's executor inside the replica's placement group (placement_group_bundles).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np

from specserve.engine import EngineInfo, check_streamable, sampling_refusal, vocabulary_fingerprint
from specserve.models import resolve_dtype
from specserve.protocol import (
    DETERMINISTIC, SAMPLED, PoolLoad, Proposal, ProposeRequest, SparseDist, SpecserveError, TokenTree, VerifyRequest,
    VerifyResult,
)

DEFAULT_SCORE_LOGPROBS = 20  # top-N logprobs per row: sampling is exact for top_k <= N
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a whole GPU's memory
SPECSERVE_KWARGS = ("score_logprobs",)  # engine_kwargs specserve reads; the rest go to AsyncEngineArgs


def build(pool_args: dict[str, Any], role: str, **_) -> VllmEngine:
    return VllmEngine(pool_args, role=role)


def engine_args(pool_args: dict[str, Any], model_path: str, role: str = "target") -> dict[str, Any]:
    """AsyncEngineArgs keywords for a pool: specserve's pool options, then engine_kwargs (which win).

    >>> args = engine_args({"dtype": "float32", "device": "cpu", "kv_cache_memory": 1 << 30,
    ...                     "engine_kwargs": {"max_model_len": 512, "score_logprobs": 8}}, "/m")
    >>> args["max_logprobs"], args["enforce_eager"], args["distributed_executor_backend"], args["max_model_len"]
    (8, True, 'uni', 512)
    """
    extra = {k: v for k, v in pool_args.get("engine_kwargs", {}).items() if k not in SPECSERVE_KWARGS}
    tensor_parallel = int(extra.get("tensor_parallel_size", 1))
    args = {
        # "auto" is specserve's (resolve_dtype), not vLLM's "the checkpoint's dtype": the same choice
        # as a torch pool on the same device
        "model": model_path, "dtype": resolve_dtype(pool_args["dtype"], pool_args.get("device", "cpu")), "seed": 0,
        "enable_prefix_caching": True,
        "max_logprobs": score_logprobs(pool_args),
        # one process per GPU through Ray's executor (the replica's placement group); one: in process
        "distributed_executor_backend": "ray" if tensor_parallel > 1 else "uni",
        # CUDA graphs and torch.compile cost minutes on CPU and were slower there (DESIGN.md)
        "enforce_eager": not str(pool_args.get("device", "cpu")).startswith("cuda"),
    }
    if not str(pool_args.get("device", "cpu")).startswith("cuda"):
        args["kv_cache_memory_bytes"] = int(pool_args["kv_cache_memory"])
    elif 0 < (share := float(pool_args.get("ray_actor_options", {}).get("num_gpus", 1) or 1)) < 1:
        # A replica on a fraction of a GPU (pools sharing one) asks vLLM for that fraction of its
        # memory: vLLM refuses to start while less than gpu_memory_utilization x total is free,
        # and its default (0.9) fails every pool that starts after another on the same GPU.
        args["gpu_memory_utilization"] = round(GPU_MEMORY_UTILIZATION * share, 3)
    if role == "draft":  # a draft reports the distributions it sampled from: after temperature, top-k, top-p
        args["logprobs_mode"] = "processed_logprobs"
    return args | extra


def score_logprobs(pool_args: dict[str, Any]) -> int:
    return int(pool_args.get("engine_kwargs", {}).get("score_logprobs", DEFAULT_SCORE_LOGPROBS))


def target_rows(prompt_logprobs: list, last_row: dict, start: int, num_cached: int,
                num_prompt: int) -> list[dict[int, float]] | None:
    """The target's rows for a round scored as prompt = context + draft (len(context) = start,
    num_prompt = len(prompt)): row i predicts prompt position start + i, and the last row follows
    the last draft token.

    vLLM returns prompt_logprobs in one of two layouts, told apart by their length:
    - one entry per prompt position (V1 model runner, CPU): entry j ({token id: logprob})
      predicts position j, and entries inside the cached prefix hold no real scores;
    - cached positions left out (V2 model runner, vLLM's default on CUDA): entry 0 is the
      first position's None, and entry i >= 1 predicts position num_cached + i.
    Either way a row for position j exists only when position j - 1 was computed
    (j - 1 >= num_cached). Returns None when a needed row was served from the prefix cache.

    >>> target_rows([None, {1: -0.1}, {2: -0.2}, {3: -0.3}], {4: -0.4}, start=2, num_cached=1, num_prompt=4)
    [{2: -0.2}, {3: -0.3}, {4: -0.4}]
    >>> target_rows([None, {2: -0.2}, {3: -0.3}], {4: -0.4}, start=2, num_cached=1, num_prompt=4)
    [{2: -0.2}, {3: -0.3}, {4: -0.4}]
    >>> target_rows([None, {1: -0.1}, {2: -0.2}], {4: -0.4}, start=2, num_cached=2, num_prompt=3) is None
    True
    """
    if start - 1 < num_cached:
        return None
    if len(prompt_logprobs) == num_prompt:
        offset = 0
    elif len(prompt_logprobs) == num_prompt - num_cached:
        offset = num_cached
    else:
        raise SpecserveError(f"vLLM returned {len(prompt_logprobs)} prompt logprob rows for a {num_prompt}-token "
                             f"prompt with {num_cached} cached tokens: neither layout specserve reads")
    return [dict(row) for row in prompt_logprobs[start - offset:]] + [dict(last_row)]


def dense_logits(rows: list[dict[int, float]], vocab_size: int):
    """[len(rows), vocab_size] float32 logits: each row's logprobs, -inf for the tokens the
    engine did not return. Softmax of a row is the model's distribution restricted to its
    top-N (plus the draft token): exact after any top_k <= N, since log-softmax differs from
    the logits by a constant per row."""
    import torch

    out = torch.full((len(rows), vocab_size), float("-inf"))
    for i, row in enumerate(rows):
        ids = [t for t in row if t < vocab_size]
        out[i, ids] = torch.tensor([row[t] for t in ids], dtype=torch.float32)
    return out


def row_argmax(row: dict[int, float], vocab_size: int) -> int:
    """The top token of a row of logprobs, as torch's argmax picks it over the row made dense
    (dense_logits): ids in the vocabulary only, and among equal logprobs the lowest id.

    >>> row_argmax({9: -0.5, 3: -0.5, 4: -2.0, 12: 0.0}, vocab_size=10)
    3
    """
    return min((token for token in row if token < vocab_size), key=lambda token: (-row[token], token))


def accept(request: VerifyRequest, rows: list[dict[int, float]], vocab_size: int) -> VerifyResult:
    """specserve's exact acceptance on the scored rows (a chain): greedy on each row's top token
    (no dense row: an argmax over 150k mostly -inf logits was most of a CPU verify's own time),
    or rejection sampling on the rows made dense."""
    from specserve.sampling import walk_greedy_tree

    if request.params.greedy:
        out = walk_greedy_tree(request.draft, [row_argmax(row, vocab_size) for row in rows])
        return VerifyResult(request.request_id, len(out) - 1, out)
    return accept_sampled(request, dense_logits(rows, vocab_size))


def accept_sampled(request: VerifyRequest, logits) -> VerifyResult:
    """Rejection sampling of the draft chain against the target's dense [k + 1, V] logits."""
    from specserve.sampling import LazyTargetProbs, accept_rejection_tree, densify, generator_for
    from specserve.verifier import check_sampled

    draft = request.draft
    p = LazyTargetProbs(logits, request.params)
    q = None
    if request.law == SAMPLED and len(draft):
        q = densify(request.dists, p.shape[-1])
        check_sampled(draft, q, request.request_id)
    out = accept_rejection_tree(draft, q, p, generator_for(request.seed))
    return VerifyResult(request.request_id, len(out) - 1, out)


def sparse_dists(rows: list[dict[int, float]]) -> SparseDist:
    """The processed distributions a draft sampled from, one row per token ({token: logprob},
    -inf for tokens top-k / top-p removed): [k, m] ids and probabilities, renormalised against
    float rounding. Short rows are padded with other token ids of probability 0 (distinct ids:
    densify scatters them).

    >>> d = sparse_dists([{5: math.log(0.75), 9: math.log(0.25)}, {0: 0.0}])
    >>> d.ids.tolist(), d.probs.round(2).tolist()
    ([[5, 9], [0, 1]], [[0.75, 0.25], [1.0, 0.0]])
    """
    kept = [sorted(((t, math.exp(lp)) for t, lp in row.items() if lp > float("-inf")), key=lambda x: -x[1])
            for row in rows]
    width = max(len(row) for row in kept)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    probs = np.zeros((len(rows), width), dtype=np.float32)
    for i, row in enumerate(kept):
        present = {t for t, _ in row}
        padding = itertools.islice((t for t in itertools.count() if t not in present), width - len(row))
        ids[i] = [t for t, _ in row] + list(padding)
        probs[i, : len(row)] = [p for _, p in row]
        probs[i] /= probs[i].sum()
    return SparseDist(ids, probs)


class VllmEngine:
    """See the module docstring."""

    def __init__(self, pool_args: dict[str, Any], llm=None, *, role: str = "target"):
        from specserve import models

        self.args = pool_args
        self.model_path = str(models.resolve(pool_args["model"], pull_missing=False)) \
            if not models.is_hub_id(pool_args["model"]) else pool_args["model"]
        self.role = role
        self.top_n = score_logprobs(pool_args)
        speculative = pool_args.get("engine_kwargs", {}).get("speculative_config")
        self.native = (speculative.get("method") or "draft_model") if speculative else None
        self.llm = llm or self._start()
        config = self.llm.model_config
        self.vocab_size = config.get_vocab_size()
        self._info = EngineInfo(
            engine="vllm", max_context=config.max_model_len, eos_token_ids=tuple(sorted(self._eos_ids())),
            vocabulary=vocabulary_fingerprint(pool_args["model"]), trees=False, hidden_states=False,
            proposes=role == "draft", sampled_top_k_max=0 if self.native else self.top_n, native=self.native)
        self._calls = itertools.count()
        self.in_flight = 0
        self.rounds = 0
        self.computed_tokens = 0  # prompt tokens vLLM computed (not served from its prefix cache)
        self.scored_tokens = 0  # prompt tokens sent
        self.rescored = 0  # rounds scored again without the cache (their first row was cached)
        self.last_computed = 0
        self._busy_s = 0.0
        self._load = PoolLoad(0, 0.0, 0, 0.0, 0)

    def _start(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.args, self.model_path, self.role)
        if self.native and args["speculative_config"].get("model"):  # a registry name for vLLM's draft
            from specserve import models

            draft = args["speculative_config"]["model"]
            if not models.is_hub_id(draft):
                args["speculative_config"] = {**args["speculative_config"],
                                              "model": str(models.resolve(draft, pull_missing=False))}
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    def _eos_ids(self) -> set[int]:
        from specserve.text import TextCodec

        ids = set()
        generation = self.llm.model_config.try_get_generation_config() or {}
        eos = generation.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        codec = TextCodec.for_model(self.args["model"])
        token = codec.config.get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and codec.tokenizer.token_to_id(token) is not None:
            ids.add(codec.tokenizer.token_to_id(token))
        return ids

    # ---- the Engine protocol -----------------------------------------------------------

    def info(self) -> EngineInfo:
        return self._info

    def _check_verifiable(self, request: VerifyRequest) -> None:
        if self.role != "target":
            raise SpecserveError("this pool proposes; it does not verify")
        if not request.draft.is_chain:
            raise SpecserveError("engine vllm verifies chains only; send the tree as a chain (the router does)")
        if request.typical is not None or request.propose_next is not None:
            raise SpecserveError("engine vllm runs exact acceptance without heads (no typical acceptance, "
                                 "no co-located proposals)")
        refusal = sampling_refusal(self._info, request.params)
        if refusal is not None:
            raise SpecserveError(refusal)

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        draft = request.draft
        self._check_verifiable(request)
        if self.native is not None:
            raise SpecserveError("this target pool speculates itself (native): its results stream (verify_stream)")
        started = time.perf_counter()
        self.in_flight += 1
        try:
            ids = list(request.token_ids) + list(draft.tokens)
            start = len(request.token_ids)
            # greedy acceptance needs each row's top token: vLLM's top-1 (plus the prompt token's
            # own logprob, which it always adds) costs less than top-N on a GPU (DESIGN.md)
            top = 1 if request.params.greedy else self.top_n
            out = await self._score(request.request_id, ids, read_cache=True, top=top)
            rows = self._rows(out, start, len(ids))
            if rows is None:  # a needed row came from the prefix cache: score it whole
                self.rescored += 1
                out = await self._score(request.request_id, ids, read_cache=False, top=top)
                rows = self._rows(out, start, len(ids))
        finally:
            self.in_flight -= 1
        result = accept(request, rows, self.vocab_size)
        seconds = time.perf_counter() - started
        self._busy_s += seconds
        self._load = PoolLoad(self.in_flight + 1, float(self.last_computed), 0, seconds)
        result.compute_s, result.load = seconds, self._load
        return result

    async def verify_stream(self, request: VerifyRequest) -> AsyncIterator[VerifyResult]:
        """Native mode: the rest of the request's generation from vLLM's own speculative decoding
        (greedy, request.params.max_tokens tokens: the router sends the room left), one result
        per vLLM output (a step's accepted tokens and its bonus token) as it comes. One vLLM
        request serves the whole generation, and its first token streams as soon as it exists.
        vLLM stops at the request's EOS and stop ids as specserve reports them (`info`), not at
        its own idea of EOS; closing the stream aborts the vLLM request."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_verifiable(request)
        if self.native is None:
            raise SpecserveError("only a native-mode target pool streams a generation; this one verifies drafts")
        if len(request.draft):
            raise SpecserveError("this target pool speculates itself (native); it takes no drafts")
        params = request.params
        stop_ids = (() if params.ignore_eos else self._info.eos_token_ids) + tuple(params.stop_token_ids)
        vllm_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True,
                                     stop_token_ids=list(stop_ids), detokenize=False,
                                     output_kind=RequestOutputKind.DELTA)
        async with aclosing(self._streamed_tokens(request, vllm_params, "native")) as outputs:
            async for tokens, seconds in outputs:
                self.rounds += 1
                yield VerifyResult(request.request_id, len(tokens) - 1, tokens, compute_s=seconds, load=self._load)

    async def _streamed_tokens(self, request, params, tag: str) -> AsyncIterator[tuple[list[int], float]]:
        """One vLLM request from request.token_ids with DELTA `params`: each output's new tokens
        and the seconds since the last, as they come (the pool's load noted per output). Closed,
        it closes vLLM's generator at once, which aborts the request."""
        self.in_flight += 1
        try:
            last = time.perf_counter()
            async with aclosing(self.llm.generate({"prompt_token_ids": list(request.token_ids)}, params,
                                                  f"{request.request_id}-{tag}-{next(self._calls)}")) as outputs:
                async for out in outputs:
                    tokens = list(out.outputs[0].token_ids)
                    if not tokens:
                        continue
                    now = time.perf_counter()
                    seconds, last = now - last, now
                    self._busy_s += seconds
                    self._load = PoolLoad(self.in_flight, 1.0, 0, seconds / len(tokens), len(tokens))
                    yield tokens, seconds
        finally:
            self.in_flight -= 1

    async def _score(self, request_id: str, ids: list[int], *, read_cache: bool, top: int):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top, logprobs=top,
                                skip_reading_prefix_cache=not read_cache, detokenize=False)
        out = None
        async for out in self.llm.generate({"prompt_token_ids": ids}, params, f"{request_id}-{next(self._calls)}"):
            pass
        computed = len(ids) - (out.num_cached_tokens or 0)
        self.rounds += 1
        self.scored_tokens += len(ids)
        self.computed_tokens += computed
        self.last_computed = computed
        return out

    def _rows(self, out, start: int, num_prompt: int):
        [completion] = out.outputs
        last = {t: lp.logprob for t, lp in completion.logprobs[0].items()}
        prompt = [None if row is None else {t: lp.logprob for t, lp in row.items()} for row in out.prompt_logprobs]
        return target_rows(prompt, last, start, out.num_cached_tokens or 0, num_prompt)

    async def propose(self, request: ProposeRequest) -> Proposal:
        """A chain of request.k draft tokens (a tree request gets a chain of its depth)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self.role != "draft":
            raise SpecserveError("this pool verifies; it does not propose")
        if request.k == 0:
            return Proposal(request.request_id, TokenTree(), DETERMINISTIC)
        started = time.perf_counter()
        sampled = sampling_refusal(self._info, request.params) is None and not request.params.greedy
        # FINAL_ONLY: one output when the chain is done, not one per draft step to wake this loop for
        params = SamplingParams(max_tokens=request.k, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, **(
            {"temperature": request.params.temperature, "top_k": request.params.top_k, "top_p": request.params.top_p,
             "seed": request.seed, "logprobs": self.top_n} if sampled else {"temperature": 0.0}))
        self.in_flight += 1
        try:
            out = None
            async for out in self.llm.generate({"prompt_token_ids": list(request.token_ids)}, params,
                                               f"{request.request_id}-draft-{next(self._calls)}"):
                pass
        finally:
            self.in_flight -= 1
        [completion] = out.outputs
        tokens = list(completion.token_ids)[: request.k]
        dists = sparse_dists([{t: lp.logprob for t, lp in row.items()} for row in completion.logprobs[: len(tokens)]]
                             ) if sampled else None
        seconds = time.perf_counter() - started
        self._busy_s += seconds
        self._load = PoolLoad(self.in_flight + 1, 1.0, 0, seconds / max(1, len(tokens)), max(1, len(tokens)))
        return Proposal(request.request_id, TokenTree.chain(tokens), SAMPLED if sampled else DETERMINISTIC, dists,
                        compute_s=seconds, load=self._load)

    async def propose_stream(self, request: ProposeRequest) -> AsyncIterator[Proposal]:
        """The draft's greedy continuation of request.token_ids, up to request.k tokens, as one
        running vLLM request whose tokens stream out as its decode steps make them
        (`speculation.pipeline`): each draft token costs a decode step, not a new request's
        prefill and scheduling. Greedy only (the router streams greedy chains); closing the
        stream aborts the vLLM request."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self.role != "draft":
            raise SpecserveError("this pool verifies; it does not propose")
        check_streamable(request)
        params = SamplingParams(max_tokens=max(1, request.k), temperature=0.0, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        async with aclosing(self._streamed_tokens(request, params, "stream")) as outputs:
            async for tokens, seconds in outputs:
                yield Proposal(request.request_id, TokenTree.chain(tokens), DETERMINISTIC, compute_s=seconds,
                               load=self._load)

    async def release(self, request_id: str) -> bool:
        return False  # vLLM owns its prefix cache; a finished round holds nothing of the request

    async def stats(self) -> dict:
        stats = {"engine": "vllm", "rounds": self.rounds, "scored_tokens": self.scored_tokens,
                 "computed_tokens": self.computed_tokens, "last_computed_tokens": self.last_computed,
                 "rescored_rounds": self.rescored, "busy_s": round(self._busy_s, 3), "requests": self.in_flight}
        if self.native is not None:
            stats["native"] = native_counters()
        return stats

    def load(self) -> PoolLoad:
        return self._load

    @property
    def cached_requests(self) -> int:
        return self.in_flight

    async def check_health(self) -> None:
        await self.llm.check_health()

    def shutdown(self) -> None:
        self.llm.shutdown()


def native_counters() -> dict[str, int]:
    """vLLM's speculative decoding counters in this process (num_drafts, num_draft_tokens,
    num_accepted_tokens), from the metrics AsyncLLM's front end keeps; {} where there are none."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    prefix, names = "vllm:spec_decode_", ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {m.name[len(prefix):]: int(m.value) for m in get_metrics_snapshot()
            if m.name.startswith(prefix) and m.name[len(prefix):] in names and hasattr(m, "value")}


async def greedy_reference(engine: VllmEngine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """vLLM's own greedy decoding of `prompt_ids` on the engine's AsyncLLM (tests compare)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    out = None
    async for out in engine.llm.generate({"prompt_token_ids": prompt_ids}, params, f"reference-{next(engine._calls)}"):
        pass
    return list(out.outputs[0].token_ids)
