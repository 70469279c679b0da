"""OpenAI-compatible request bodies, responses and error bodies (pydantic, torch-free)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.protocol import (
    ACCEPTANCES, MAX_K, MAX_PIPELINE, POLICIES, PROPOSERS, SHAPES, SamplingParams, Speculation, TreeSpec,
)


class TreeOverride(BaseModel):
    """Per-request tree settings; unset fields keep the deployment's (see TreeArgs)."""

    model_config = ConfigDict(extra="forbid")
    budget: int | None = None
    depth: int | None = None
    width: int | None = None
    min_score: float | None = None
    shape: list[list[int]] | str | None = None  # paths of child ranks, or a name such as "mc_sim_7b_63"
    rerank: bool | None = None

    def apply_to(self, spec: TreeSpec) -> TreeSpec:
        """The deployment's spec with this request's fields; TreeSpec checks the ranges. A
        request that gives a static shape asks for that shape, reranked or not."""
        fields = self.model_dump(exclude_unset=True)
        if fields.get("shape") is not None and "rerank" not in fields:
            fields["rerank"] = False
        return replace(spec, **fields)


class TypicalOverride(BaseModel):
    model_config = ConfigDict(extra="forbid")
    posterior_threshold: float | None = Field(None, gt=0, le=1)
    posterior_alpha: float | None = Field(None, gt=0, le=1)


class SpeculationOverride(BaseModel):
    """specserve extension: per-request speculation, e.g. {"proposer": "none"}, {"k": 2},
    {"proposer": "draft", "shape": "tree", "tree": {"budget": 8, "depth": 4}} or
    {"proposer": "medusa", "acceptance": "typical"} (lossy). `method` (none | draft | tree) is
    the older spelling of proposer + shape."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = Field(None, description="older spelling: none | draft | tree")
    proposer: Literal[PROPOSERS] | None = None  # type: ignore[valid-type]
    shape: Literal[SHAPES] | None = None  # type: ignore[valid-type]
    k: int | None = Field(None, ge=0, le=MAX_K)
    tree: TreeOverride | None = None
    acceptance: Literal[ACCEPTANCES] | None = None  # type: ignore[valid-type]
    typical: TypicalOverride | None = None
    policy: Literal[POLICIES] | None = Field(None, description="adaptive | fixed; an explicit proposer, "  # type: ignore[valid-type]
                                             "shape, k or tree alone means fixed")
    pipeline: int | None = Field(None, ge=0, le=MAX_PIPELINE, description="greedy draft-pool chains: verifies at "
                                 "once on one streamed draft (0: rounds take turns)")
    solo_k: int | None = Field(None, ge=0, le=MAX_K, description="adaptive chains: the longest chain while "
                               "the request is alone in the rounds (at least k; 0: k)")

    def apply_to(self, spec: Speculation) -> Speculation:
        """The deployment's speculation with this request's settings; checks the ranges."""
        return spec.overridden(method=self.method, proposer=self.proposer, shape=self.shape, k=self.k,
                               tree=self.tree.apply_to(spec.tree) if self.tree is not None else None,
                               acceptance=self.acceptance,
                               typical=self.typical.model_dump(exclude_none=True) if self.typical else None,
                               policy=self.policy, pipeline=self.pipeline, solo_k=self.solo_k)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are ignored, like vLLM does

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="extension: 0 disables top-k")
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logprobs: Any = None
    speculation: SpeculationOverride | None = None
    timeout_s: float | None = Field(None, gt=0, description="extension: this request's deadline in seconds "
                                    "(default and cap: the deployment's limits)")
    user: str | None = None
    return_token_ids: bool = Field(False, description="extension: every choice and stream chunk also carries "
                                   "its token ids (what `resume_token_ids` takes)")
    resume_token_ids: list[int] | None = Field(None, description="extension: continue an interrupted stream of "
                                               "this same request; the token ids it already sent")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops  # how many and how long: the deployment's limits (Router.start)

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens or default_max_tokens, seed=self.seed,
            stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_GenerationBody):
    prompt: str | list[int]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        # checked here, with the body: refused later it would be a server error, not a 400
        for part in value if isinstance(value, list) else ():
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported")
            if not isinstance(part.get("text", ""), str):
                raise ValueError("a text content part's text must be a string")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content)


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _max(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, stats: dict) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculation": stats,  # extension: accepted length, acceptance rate, target steps ...
    }
