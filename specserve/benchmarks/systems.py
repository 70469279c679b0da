"""What `specserve bench` measures: the systems, and the result of one system on one workload at
one batch size.

Adding a specserve method variant is one line in SPECSERVE_VARIANTS: (method, options), where
method is an older method name (none, draft, tree) or a proposer (medusa). In library mode the
options go to ``SpeculativeDecoder.generate(..., method=method, **options)``; in service mode
they are the request's ``speculation`` object. A method this specserve does not have, or one
the decoder or the server refuses (no heads, say), is reported as "cannot run: <reason>",
never dropped.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

K = 4  # draft tokens per round for every chain method, specserve's and its peers'
# The adaptive policy's longest chain for a request alone in the rounds (`speculation.solo_k`,
# manifests/local.yaml): with the target to itself a request drafts 0..SOLO_K, as deep as its
# measured acceptance pays (code at 1 stream: fixed k=6 1.13x k=4, docs/bench/depth-1).
SOLO_K = 8

# (specserve method, options): one line per variant; "none" first (it is the baseline).
SPECSERVE_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("draft", {"k": K}),
    ("tree", {}),  # the decoder's default tree; a variant: ("tree", {"tree": {"budget": 16, "depth": 6}})
    ("medusa", {"shape": "tree"}),  # heads from `make heads`, co-located; a dynamic tree as deep as the heads
]
HEAD_METHODS = ("medusa", "hydra", "redrafter")  # need heads on the target (--heads)
SERVED = "served"  # service mode only: no per-request override, the deployment's own speculation

OK, CANNOT_RUN, FAILED = "ok", "cannot run", "failed"


@dataclass(frozen=True)
class System:
    name: str  # what the table shows
    engine: str  # "specserve" | "transformers" | "vllm"
    method: str  # the engine's name for it; "none" is that engine's target-only decoding
    options: dict[str, Any] = field(default_factory=dict)
    needs_draft: bool = False

    @property
    def needs_heads(self) -> bool:
        return self.engine == "specserve" and self.method in HEAD_METHODS

    @property
    def target_only(self) -> bool:
        return self.method == "none"


def variant_name(method: str, options: dict[str, Any]) -> str:
    """'specserve medusa shape=tree budget=16 depth=4' from the options; a static tree shape
    appears by its name ('shape=mc_sim_7b_63'), or as its node count when it has none."""
    suffix = " ".join(f"{key}={value}" for key, value in options.items() if not isinstance(value, dict))
    nested = " ".join(f"{k}={v if k != 'shape' or isinstance(v, str) else f'{len(v)}-node'}"
                      for value in options.values() if isinstance(value, dict) for k, v in value.items())
    return " ".join(part for part in (f"specserve {method}", suffix, nested) if part)


def specserve_system(method: str, options: dict[str, Any], name: str | None = None) -> System:
    return System(name or variant_name(method, options), "specserve", method, dict(options),
                  needs_draft=method not in ("none", "ngram", "medusa", "hydra", "redrafter", SERVED))


def specserve_systems(variants: list[tuple[str, dict[str, Any]]] | None = None) -> list[System]:
    """One system per variant (default SPECSERVE_VARIANTS; a preset may bring its own)."""
    return [specserve_system(method, options) for method, options in (variants or SPECSERVE_VARIANTS)]


def transformers_systems() -> list[System]:
    return [
        System("transformers target only", "transformers", "none"),
        System("transformers assisted", "transformers", "assisted", {"assistant_model": "draft"}, needs_draft=True),
        System("transformers prompt lookup", "transformers", "prompt_lookup", {"prompt_lookup_num_tokens": 10}),
    ]


MEDUSA_HEADS = "medusa heads"  # in a vLLM system's options: the Medusa heads' vLLM layout (export-heads)


def vllm_systems(ks: list[int] | None = None) -> list[System]:
    """Options are vLLM's `speculative_config` ("draft" stands for the draft model's directory,
    MEDUSA_HEADS for specserve's Medusa heads exported to vLLM's layout: the same heads as the
    `specserve medusa` rows, each head's top-1 as a chain, vLLM's only Medusa shape). `ks`: the
    numbers of speculative tokens to run draft_model and ngram at (default K; a preset that gives
    specserve a deeper or adaptive depth gives vLLM the same depths, so each runs at its best)."""
    chains = []
    for k in ks or [K]:
        chains += [
            System(f"vllm draft_model k={k}", "vllm", "draft_model",
                   {"method": "draft_model", "model": "draft", "num_speculative_tokens": k}, needs_draft=True),
            System(f"vllm ngram k={k}", "vllm", "ngram",
                   {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
        ]
    return [System("vllm none", "vllm", "none"), *chains,
            System(f"vllm medusa k={K}", "vllm", "medusa",
                   {"method": "medusa", "model": MEDUSA_HEADS, "num_speculative_tokens": K})]


def all_systems(variants: list[tuple[str, dict[str, Any]]] | None = None, vllm_ks: list[int] | None = None) -> list[System]:
    return specserve_systems(variants) + transformers_systems() + vllm_systems(vllm_ks)


# --------------------------------------------------------------------------- results


@dataclass
class Call:
    """One generate() call: ``len(prompts)`` prompts decoded together (the batch)."""

    prompts: list[str]  # prompt ids
    seconds: float
    token_ids: list[list[int]]  # per prompt
    repeat: int = 0  # which pass over the systems (A B .. B A)


@dataclass
class LibraryRun:
    """One system on one workload at one batch size, over every repeat."""

    system: str
    engine: str
    method: str
    workload: str
    batch: int = 1
    phase: int = 0  # 1: systems derived from phase 0's measurements, run after it with their own baseline
    status: str = OK
    reason: str = ""  # why it cannot run, or why it failed
    note: str = ""  # how it ran, when that differs from the defaults
    settings: dict[str, Any] | None = None  # vLLM: the engine settings that ran (the fastest tried)
    startup_s: float | None = None  # vLLM: building the engine (load, compile, warm-up), not counted in tok/s
    calls: list[Call] = field(default_factory=list)
    target_steps: int = 0  # target forward passes (specserve only)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_rank: list[int] = field(default_factory=list)  # specserve trees
    num_reached_tokens_per_rank: list[int] = field(default_factory=list)
    # filled in by compare(): the same engine's target-only run, specserve none, vLLM's counterpart
    reference: str = ""
    same_as_reference: int | None = None
    first_difference: list[int | None] = field(default_factory=list)  # per prompt; None = identical
    same_as_specserve_none: int | None = None
    speedup: float | None = None
    vs_vllm: float | None = None  # specserve only: tok/s over vLLM's counterpart (none, or its best speculative)
    vs_vllm_system: str = ""

    @property
    def tokens(self) -> int:
        return sum(len(ids) for call in self.calls for ids in call.token_ids)

    @property
    def seconds(self) -> float:
        return sum(call.seconds for call in self.calls)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second_by_repeat(self) -> list[float]:
        """One figure per pass: their spread shows how much the machine drifted."""
        out = []
        for repeat in sorted({c.repeat for c in self.calls}):
            calls = [c for c in self.calls if c.repeat == repeat]
            seconds = sum(c.seconds for c in calls)
            out.append(sum(len(ids) for c in calls for ids in c.token_ids) / seconds if seconds else 0.0)
        return out

    @property
    def prompts(self) -> list[str]:
        """The prompt ids, in order (the first pass's)."""
        return [p for c in self.calls if c.repeat == self._first_repeat for p in c.prompts]

    @property
    def outputs(self) -> list[list[int]]:
        """The first pass's outputs, per prompt, in prompt order: what comparisons look at."""
        return [ids for c in self.calls if c.repeat == self._first_repeat for ids in c.token_ids]

    @property
    def _first_repeat(self) -> int:
        return min((c.repeat for c in self.calls), default=0)

    @property
    def latency_p50_s(self) -> float | None:
        """Median wall time of one call (a batch of ``batch`` requests, all their tokens)."""
        return statistics.median(c.seconds for c in self.calls) if self.calls else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per target forward pass, bonus included (1.0 = no gain)."""
        if self.target_steps:
            return self.tokens / self.target_steps
        if self.num_drafts:  # vLLM: one verify step per draft, plus the bonus token
            return 1 + self.num_accepted_tokens / self.num_drafts
        return None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mismatch(self) -> bool:
        return self.same_as_reference is not None and self.same_as_reference < len(self.outputs)

    def add_counts(self, accepted_per_rank: list[int], reached_per_rank: list[int]) -> None:
        from specserve.trees import add_counts

        add_counts(self.num_accepted_tokens_per_rank, accepted_per_rank)
        add_counts(self.num_reached_tokens_per_rank, reached_per_rank)

    def as_dict(self) -> dict:
        data = asdict(self)
        for name in ("tokens", "seconds", "tokens_per_second", "tokens_per_second_by_repeat", "prompts",
                     "latency_p50_s", "mean_accepted_length", "acceptance_rate", "mismatch"):
            data[name] = getattr(self, name)
        return data


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(runs: list[LibraryRun]) -> None:
    """Fill in, per workload, batch size and phase: speedups against specserve none, output checks
    against each engine's target only, and specserve's ratio to vLLM's counterpart (vLLM none for
    target-only, vLLM's fastest speculative configuration for a speculative method)."""
    groups: dict[tuple, list[LibraryRun]] = {}
    for run in runs:
        if run.status == OK:
            groups.setdefault((run.workload, run.batch, run.phase), []).append(run)
    for group in groups.values():
        _compare_group(group)


def _compare_group(done: list[LibraryRun]) -> None:
    def target_only(engine: str) -> LibraryRun | None:
        return next((r for r in done if r.engine == engine and r.method == "none"), None)

    baseline = target_only("specserve")
    vllm_speculative = [r for r in done if r.engine == "vllm" and r.method != "none" and r.tokens_per_second]
    vllm_best = max(vllm_speculative, key=lambda r: r.tokens_per_second, default=None)
    for run in done:
        if baseline is not None and baseline.tokens_per_second:
            run.speedup = run.tokens_per_second / baseline.tokens_per_second
            run.same_as_specserve_none = sum(a == b for a, b in zip(run.outputs, baseline.outputs))
        reference = target_only(run.engine)
        if reference is not None and reference is not run:
            run.reference = reference.system
            run.first_difference = [first_difference(a, b) for a, b in zip(run.outputs, reference.outputs)]
            run.same_as_reference = sum(d is None for d in run.first_difference)
        if run.engine == "specserve":
            peer = target_only("vllm") if run.method == "none" else vllm_best
            if peer is not None and peer.tokens_per_second:
                run.vs_vllm = run.tokens_per_second / peer.tokens_per_second
                run.vs_vllm_system = peer.system


@dataclass
class ServiceRun:
    """One system at one concurrency on one workload, through HTTP."""

    system: str
    method: str
    workload: str
    concurrency: int
    status: str = OK
    reason: str = ""
    wall_s: float = 0.0
    requests: int = 0
    tokens: int = 0
    target_steps: int = 0
    overhead_s: float = 0.0  # router <-> pool round trips beyond the pools' compute, all requests
    ttft_s: list[float] = field(default_factory=list)  # per request
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks, all requests
    texts: list[str] = field(default_factory=list)
    speedup: float | None = None  # throughput over specserve none at the same concurrency
    same_as_reference: int | None = None  # outputs equal to specserve none's at the same concurrency
    k_histogram: list[int] = field(default_factory=list)  # rounds per drafted depth, all requests
    pass_tokens: list[int] = field(default_factory=list)  # each pass's tokens and seconds, over its turns
    pass_wall_s: list[float] = field(default_factory=list)
    # the load-aware policy's rounds per reason (warmup, model, probe, measured), all requests
    policy_decisions: dict[str, int] = field(default_factory=dict)
    # closed-loop turns: tokens and request-seconds of the requests that ran while every stream
    # was busy (http.steady_state), summed over turns
    steady_tokens: int = 0
    steady_request_s: float = 0.0

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def add_to_pass(self, pass_index: int, tokens: int, wall_s: float) -> None:
        """One turn of a pass (a wave of requests, or one request at 1 stream)."""
        missing = pass_index + 1 - len(self.pass_tokens)
        self.pass_tokens += [0] * missing
        self.pass_wall_s += [0.0] * missing
        self.pass_tokens[pass_index] += tokens
        self.pass_wall_s[pass_index] += wall_s

    @property
    def pass_throughputs(self) -> list[float]:
        """tok/s of each pass (--service-repeats)."""
        return [t / w if w else 0.0 for t, w in zip(self.pass_tokens, self.pass_wall_s)]

    def add_k_histogram(self, histogram: dict[str, int]) -> None:
        """A request's `usage.speculation.k_histogram` ({depth: rounds})."""
        for depth, rounds in histogram.items():
            depth = int(depth)
            self.k_histogram += [0] * (depth + 1 - len(self.k_histogram))
            self.k_histogram[depth] += rounds

    def add_policy_decisions(self, decisions: dict[str, int]) -> None:
        """A request's `usage.speculation.policy_decisions` ({reason: rounds})."""
        for reason, rounds in decisions.items():
            self.policy_decisions[reason] = self.policy_decisions.get(reason, 0) + rounds

    def add_steady_state(self, tokens: int, request_s: float) -> None:
        self.steady_tokens += tokens
        self.steady_request_s += request_s

    @property
    def steady_throughput(self) -> float | None:
        """tok/s while all the streams were busy (closed-loop turns only): streams x tokens per
        request-second, i.e. the service's throughput at exactly this load."""
        return self.concurrency * self.steady_tokens / self.steady_request_s if self.steady_request_s else None

    @property
    def speculation_off_share(self) -> float | None:
        """Share of rounds that drafted nothing (the load-aware policy's k = 0, and prefill rounds)."""
        rounds = sum(self.k_histogram)
        return self.k_histogram[0] / rounds if rounds and self.method != "none" else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.tokens / self.target_steps if self.target_steps else None

    @property
    def overhead_ms_per_round(self) -> float | None:
        return 1000 * self.overhead_s / self.target_steps if self.target_steps else None

    @property
    def mismatch(self) -> bool:
        return self.same_as_reference is not None and self.same_as_reference < self.requests

    def percentile(self, name: str, q: float) -> float | None:
        values = sorted(getattr(self, name))
        if not values:
            return None
        position = (len(values) - 1) * q / 100  # linear interpolation between closest ranks
        low = int(position)
        high = min(low + 1, len(values) - 1)
        return values[low] + (values[high] - values[low]) * (position - low)

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(throughput_tok_s=self.throughput, mean_accepted_length=self.mean_accepted_length,
                    overhead_ms_per_round=self.overhead_ms_per_round, mismatch=self.mismatch,
                    speculation_off_share=self.speculation_off_share, pass_throughputs=self.pass_throughputs,
                    steady_tok_s=self.steady_throughput)
        for name in ("ttft_s", "itl_s"):
            for q in (50, 99):
                data[f"{name[:-2]}_p{q}_s"] = self.percentile(name, q)
        return data


def compare_service(runs: list[ServiceRun]) -> None:
    done = [r for r in runs if r.status == OK]
    for run in done:
        base = next((r for r in done if r.method == "none" and r.workload == run.workload
                     and r.concurrency == run.concurrency), None)
        if base is None:
            continue
        if base.throughput:
            run.speedup = run.throughput / base.throughput
        if base is not run:
            run.same_as_reference = sum(a == b for a, b in zip(run.texts, base.texts))
