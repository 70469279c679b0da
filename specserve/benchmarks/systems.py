"""What `specserve bench` measures: the systems, and the result of one system on one workload.

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

# (specserve method, options): one line per variant; "none" first (it is the baseline).
SPECSERVE_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("draft", {"k": K}),
    ("tree", {}),  # the decoder's default tree; a variant: ("tree", {"tree": {"budget": 16, "depth": 6}})
    ("medusa", {"shape": "tree"}),  # heads from `make heads`, co-located; a dynamic tree as deep as the heads
]
HEAD_METHODS = ("medusa",)  # need heads on the target (--heads)

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
    suffix = " ".join(f"{key}={value}" for key, value in options.items() if not isinstance(value, dict))
    nested = " ".join(f"{k}={v}" for value in options.values() if isinstance(value, dict) for k, v in value.items())
    return " ".join(part for part in (f"specserve {method}", suffix, nested) if part)


def specserve_systems() -> list[System]:
    return [System(variant_name(method, options), "specserve", method, dict(options),
                   needs_draft=method not in ("none", "ngram", "medusa", "hydra", "redrafter"))
            for method, options in SPECSERVE_VARIANTS]


def transformers_systems() -> list[System]:
    return [
        System("transformers target only", "transformers", "none"),
        System("transformers assisted", "transformers", "assisted", {"assistant_model": "draft"}, needs_draft=True),
        System("transformers prompt lookup", "transformers", "prompt_lookup", {"prompt_lookup_num_tokens": 10}),
    ]


def vllm_systems() -> list[System]:
    """Options are vLLM's `speculative_config` ("draft" stands for the draft model's directory)."""
    return [
        System("vllm none", "vllm", "none"),
        System(f"vllm draft_model k={K}", "vllm", "draft_model",
               {"method": "draft_model", "model": "draft", "num_speculative_tokens": K}, needs_draft=True),
        System(f"vllm ngram k={K}", "vllm", "ngram",
               {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
    ]


def all_systems() -> list[System]:
    return specserve_systems() + transformers_systems() + vllm_systems()


# --------------------------------------------------------------------------- results


@dataclass
class PromptRun:
    id: str
    seconds: float
    token_ids: list[int]


@dataclass
class LibraryRun:
    """One system on one workload, batch 1, each prompt in turn."""

    system: str
    engine: str
    method: str
    workload: str
    status: str = OK
    reason: str = ""  # why it cannot run, or why it failed
    note: str = ""  # how it ran, when that differs from the defaults
    startup_s: float | None = None  # vLLM: building the engine (load, compile, warm-up), not counted in tok/s
    prompts: list[PromptRun] = field(default_factory=list)
    target_steps: int = 0  # target forward passes (specserve only)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # filled in by compare(): the same engine's target-only run, and specserve none
    reference: str = ""
    same_as_reference: int | None = None
    first_difference: list[int | None] = field(default_factory=list)  # per prompt; None = identical
    same_as_specserve_none: int | None = None
    speedup: float | None = None

    @property
    def tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.prompts)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def latency_p50_s(self) -> float | None:
        return statistics.median(p.seconds for p in self.prompts) if self.prompts else None

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
        return self.same_as_reference is not None and self.same_as_reference < len(self.prompts)

    def as_dict(self) -> dict:
        data = asdict(self)
        for name in ("tokens", "seconds", "tokens_per_second", "latency_p50_s", "mean_accepted_length",
                     "acceptance_rate", "mismatch"):
            data[name] = getattr(self, name)
        return data


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(runs: list[LibraryRun]) -> None:
    """Fill in speedups against specserve none and output checks against each engine's target only."""
    done = [r for r in runs if r.status == OK]
    for run in done:
        baseline = next((r for r in done if r.workload == run.workload and r.engine == "specserve"
                         and r.method == "none"), None)
        reference = next((r for r in done if r.workload == run.workload and r.engine == run.engine
                          and r.method == "none"), None)
        if baseline is not None and baseline.tokens_per_second:
            run.speedup = run.tokens_per_second / baseline.tokens_per_second
            run.same_as_specserve_none = sum(a.token_ids == b.token_ids for a, b in zip(run.prompts, baseline.prompts))
        if reference is not None and reference is not run:
            run.reference = reference.system
            run.first_difference = [first_difference(a.token_ids, b.token_ids)
                                    for a, b in zip(run.prompts, reference.prompts)]
            run.same_as_reference = sum(d is None for d in run.first_difference)


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
    ttft_s: list[float] = field(default_factory=list)  # per request
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks, all requests
    texts: list[str] = field(default_factory=list)
    speedup: float | None = None  # throughput over specserve none at the same concurrency
    same_as_reference: int | None = None  # outputs equal to specserve none's at the same concurrency

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_accepted_length(self) -> float | None:
        return self.tokens / self.target_steps if self.target_steps else None

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
                    mismatch=self.mismatch)
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
