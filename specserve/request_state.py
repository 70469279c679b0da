"""Per-request bookkeeping of the round protocol, shared by the library decoder and the router.

Torch-free. A round for one request: make a ProposeRequest (if speculating), then a
VerifyRequest carrying the proposal, then `commit` the verified tokens, which applies EOS,
stop token ids and max_tokens and updates the speculation statistics.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from specserve.policy import (AcceptanceTracker, Decision, LoadModel, SpeculationPolicy, draft_catches_up,
                              switch_catch_up_tokens)
from specserve.protocol import (
    DraftShape, Proposal, ProposeRequest, SamplingParams, Speculation, SpecserveError, TokenTree, VerifyRequest,
    VerifyResult,
)
from specserve.trees import add_counts, count_ranks


@dataclass
class SpecStats:
    """Speculation counters, named after vLLM's spec-decode metrics."""

    target_steps: int = 0  # target forward passes that produced tokens for this request
    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Per sibling rank (0 = a node's first child): drafts accepted, and drafts whose parent
    # was accepted. Their ratio is the per-rank acceptance that sizes static trees
    # (specserve.trees.shape_from_acceptance).
    num_accepted_tokens_per_rank: list[int] = field(default_factory=list)
    num_reached_tokens_per_rank: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    # Rounds per drafted depth: k_histogram[k] rounds drafted k levels (0: no speculation).
    k_histogram: list[int] = field(default_factory=list)
    # The load-aware policy: rounds per reason for its choice (warmup | model | probe | measured).
    policy_decisions: dict[str, int] = field(default_factory=dict)
    # Serving only: wall time of pool calls minus the pools' compute time (transport, queueing).
    round_trip_overhead_s: float = 0.0
    # Serving with speculation.draft_ahead: next rounds' drafts asked for during a verify, and
    # those a round used (its chain and bonus token were what the draft ahead assumed).
    drafts_ahead: int = 0
    drafts_ahead_used: int = 0
    # Serving with speculation.pipeline: the draft streams started (one, then one after each
    # rejected token or each stream that ended).
    draft_streams: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step, bonus/recovered token included (1.0 = no gain)."""
        return self.generated_tokens / self.target_steps if self.target_steps else 0.0

    def merge(self, other: SpecStats) -> None:
        self.target_steps += other.target_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.generated_tokens += other.generated_tokens
        self.round_trip_overhead_s += other.round_trip_overhead_s
        self.drafts_ahead += other.drafts_ahead
        self.drafts_ahead_used += other.drafts_ahead_used
        self.draft_streams += other.draft_streams
        for reason, rounds in other.policy_decisions.items():
            self.policy_decisions[reason] = self.policy_decisions.get(reason, 0) + rounds
        for mine, theirs in ((self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                             (self.k_histogram, other.k_histogram),
                             (self.num_accepted_tokens_per_rank, other.num_accepted_tokens_per_rank),
                             (self.num_reached_tokens_per_rank, other.num_reached_tokens_per_rank)):
            add_counts(mine, theirs)

    def as_dict(self) -> dict:
        return {
            "target_steps": self.target_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "num_accepted_tokens_per_rank": list(self.num_accepted_tokens_per_rank),
            "num_reached_tokens_per_rank": list(self.num_reached_tokens_per_rank),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "k_histogram": {str(k): n for k, n in enumerate(self.k_histogram) if n},
            "speculation_off_share": round(self.k_histogram[0] / sum(self.k_histogram), 4)
            if self.k_histogram and sum(self.k_histogram) else 0.0,
            "policy_decisions": dict(self.policy_decisions),
            "round_trip_overhead_ms_per_round": round(
                1000 * self.round_trip_overhead_s / self.target_steps if self.target_steps else 0.0, 3),
            "drafts_ahead": self.drafts_ahead,
            "drafts_ahead_used": self.drafts_ahead_used,
            "draft_streams": self.draft_streams,
        }


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculation: Speculation = field(default_factory=Speculation)
    eos_token_ids: frozenset[int] = frozenset()
    max_context: int | None = None  # the models' context length: generation stops there
    # Serving: no round waits for the draft pool's prefill. The first round drafts nothing, so
    # the first token costs one target prefill (time to first token), and the draft pool
    # catches up on the prompt meanwhile, in the background (draft_sync_due).
    prefill_without_draft: bool = False
    timeout_s: float | None = None  # serving: the request's deadline, counted from its first round
    # Co-located heads: the draft the last verify pass proposed for the next round.
    held_proposal: Proposal | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_text: str | None = None  # the output text cut before a matched stop sequence
    released: bool = False  # serving: the pools were told to free this request's caches
    stats: SpecStats = field(default_factory=SpecStats)
    # The load-aware policy (speculation.policy == "adaptive"): its depth for this round, and
    # this request's measured acceptance per draft position.
    policy_k: int | None = None
    acceptance: AcceptanceTracker | None = None
    # Tokens of token_ids the draft pool has seen (at this request's last propose call): what
    # it must prefill before drafting again is the rest (priced by the policy).
    draft_synced: int = 0
    # Serving: the draft pool is catching up on this request in the background (sync_request);
    # its rounds run target-only until it has.
    draft_syncing: bool = False
    # Serving with speculation.draft_ahead: the next round's draft, drafted during the last
    # verify and kept because that round emitted exactly what it was drafted after (take_ahead).
    ahead: Proposal | None = None
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise SpecserveError("the prompt is empty: give at least one token")
        if self.max_context is not None and len(self.prompt_ids) >= self.max_context:
            raise SpecserveError(
                f"the prompt has {len(self.prompt_ids)} tokens; the model's context is "
                f"{self.max_context} tokens, leaving no room to generate"
            )
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.rng = random.Random(seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """Tokens this request may still emit."""
        room = self.params.max_tokens - len(self.output_ids)
        if self.max_context is not None:
            room = min(room, self.max_context - len(self.prompt_ids) - len(self.output_ids))
        return room

    def round_k(self) -> int:
        """Draft length (a tree: depth) this round: never draft tokens that could not be
        emitted (the round's recovered/bonus token takes one of the remaining places)."""
        if self.draft_syncing or (self.prefill_without_draft and not self.output_ids):
            return 0
        return max(0, min(self._depth(), self.room() - 1))

    def _depth(self) -> int:
        return self.speculation.depth if self.policy_k is None else self.policy_k

    @property
    def draft_unseen(self) -> int:
        """Tokens the draft pool has not seen: what it must prefill before drafting again."""
        return len(self.token_ids) - self.draft_synced

    def draft_sync_due(self, others_prefilling: bool = False, measured_level: bool = True,
                       peak_measured: bool = False) -> bool:
        """Serving: whether the draft pool should catch up on this request in the background
        now, its rounds running target-only meanwhile, instead of a round waiting for the
        catch-up (its prompt, or what it emitted while speculation was off). Due when the
        request drafts from a draft pool at this round's depth, the pool has fallen more than a
        round's sync behind (draft_catches_up), none runs already, and the depth is not pinned
        (a seeded sampled request's draws must not depend on when a catch-up ends).
        `others_prefilling`: other requests' prompts prefill now; then an adaptive request in
        its first round (nothing emitted yet) leaves its prompt's catch-up to its next round,
        where the requests in flight are a level the router's epochs measure (`measured_level`,
        MeasuredModes.measures): below it the model speculates anyway, and the catch-up left
        to the next round only puts the request out of step with the others. `peak_measured`:
        the router's recent peak of requests in rounds (RecentPeak) is such a level; then a
        wave's first requests, entering below it, leave theirs to their next round too, whether
        or not other prompts prefill: their next round decides at the wave's load.

        Why: a round that waits for its catch-up holds the target's work for it; after
        speculation came back on at 16 streams, 16 catch-ups of ~140 tokens each kept every
        request waiting on the draft pool for tens of seconds on a 2-core CPU. Why the wait in a
        burst: its requests enter one by one, so the first ones decide at the load of the few
        before them (1, 2, ... in flight, where the model speculates) what the burst's load
        would decide otherwise; at code 8 streams on a 2-core CPU 5 of a wave's 8 requests
        prefilled their prompts on the draft pool in an epoch where all 8 then ran off, and the
        wave's prompts took 32 s to prefill where always off's took 29. Why not below a
        measured level: at code 2 streams the second request of each pair, its catch-up left
        to its second round, ran 3 rounds target-only and then drafted out of step with the
        first, their rounds sharing a target pass 1.23 calls a pass against always on's 1.57,
        and its rounds 7% slower (adaptive 0.94x always on, speculating in 87% of rounds)."""
        if not self.prefill_without_draft or self.pinned_depth or self._depth() == 0:
            return False
        in_a_wave = (others_prefilling and measured_level) or (peak_measured and not measured_level)
        if in_a_wave and self.adaptive and not self.output_ids:
            return False
        return self.draft_catch_up_owed()

    def draft_catch_up_owed(self) -> bool:
        """Serving: whether this request's draft pool is a catch-up behind (draft_catches_up)
        with none running: its next drafting round starts it (draft_sync_due) or waits for it.
        Its prompt, left to its second round in a burst, or what it emitted while speculation
        was off."""
        spec = self.speculation
        return (spec.draft_cost == "pool" and not spec.co_located and not self.draft_syncing
                and self.room() > 1 and draft_catches_up(self.draft_unseen, spec.depth))

    def sync_request(self) -> ProposeRequest:
        """The background catch-up's call: a one-token draft (its prefill is the point; the
        draft is discarded) of every token so far. Marks the catch-up running."""
        self.draft_synced = len(self.token_ids)
        self.draft_syncing = True
        return ProposeRequest(self.request_id, self.token_ids, 1, self.params, 0)

    @property
    def pinned_depth(self) -> bool:
        """A seeded sampled request drafts the configured depth every round: which tokens a
        seed draws depends on the drafts it verifies, so a depth chosen from load would make
        the same seed give different (equally exact) outputs."""
        return not self.params.greedy and self.params.seed is not None

    @property
    def adaptive(self) -> bool:
        """Whether the load-aware policy picks this request's depth each round."""
        return self.speculation.adaptive and not self.pinned_depth

    def plan_round(self, policy: SpeculationPolicy, load: LoadModel, batch: float | None = None,
                   measured_off: bool = False, measured_level: bool = False, alone: bool = False) -> Decision | None:
        """Adaptive speculation: let the policy set this round's depth (0 = off) from the
        request's acceptance and the pools' load; `alone`: no other request runs rounds, so a
        chain may go to `speculation.solo_k` (Speculation.cap). `measured_level`: at this load the router's
        measured epochs (MeasuredModes) decide whether requests speculate, so the model does not
        probe from off, and a request with a draft pool drafts its whole configured depth (see
        below); `measured_off`: this epoch runs speculation off. Fixed speculation: nothing to
        decide.

        Why the whole depth there, for every request with a draft pool: the epochs then compare
        exactly always on against always off, both measured. Requests of one epoch that each
        turned a draft pool on or off by their own estimate ran worse than all on or all off
        (code at 8 and 16 streams on a 2-core CPU: 58 s and 96 s of decoding against always on's
        47 s and 70 s and always off's 45 s and 81 s): requests that skip the draft pool come back
        to the target sooner, the target's passes split into waves, and each request turned back
        on owes the draft pool a catch-up prefill. And epochs where each request picked its own
        depth (at least 1) measured what the model's estimates of that moment allowed, not
        speculation: at code 16 its acceptance estimates, learnt from the few rounds that
        speculated, sat near the 0.6 prior against ~0.85 drafted at depth 4, so it drafted one
        token a round, 1.7 tokens a round in 5.4 s (5.1 tok/s at 16 streams) where always on
        emitted 3.9 a round and beat always off. Heads and n-gram lookup have neither cost:
        there the model still picks each request's depth, off included."""
        spec = self.speculation
        if not self.adaptive:
            return None
        if self.acceptance is None:
            self.acceptance = policy.tracker(f"{spec.proposer}/{spec.shape}", spec.cap(alone=True))
        current = spec.depth if self.policy_k is None else self.policy_k
        if measured_off:
            decision = Decision(0, {}, "measured")
        elif measured_level and spec.draft_cost == "pool":
            decision = Decision(spec.depth, {}, "measured")
        else:
            decision = policy.choose(self.acceptance, load, current=current, max_k=spec.cap(alone), batch=batch,
                                     draft_cost=spec.draft_cost, catch_up=self.draft_unseen,
                                     room=self.room(), probe_from_off=not measured_level)
        self.policy_k = decision.k
        self.stats.policy_decisions[decision.reason] = self.stats.policy_decisions.get(decision.reason, 0) + 1
        if decision.k == 0:
            self.acceptance.relax()
        return decision

    @property
    def model_yield(self) -> float | None:
        """The tokens a round at the configured depth would emit on average by this request's
        acceptance so far (None before its first plan): MeasuredModes scales a level's measured
        goodput of the model by it (see "Acceptance" there)."""
        if self.acceptance is None:
            return None
        return self.acceptance.expected_tokens(self.speculation.depth)

    @property
    def needs_proposer(self) -> bool:
        """Whether this round's draft comes from a separate proposer (a draft pool, or the
        n-gram lookup). Co-located heads propose during the previous round's verify pass instead."""
        return self.speculation.proposer != "none" and not self.speculation.co_located and self.round_k() > 0

    def propose_request(self) -> ProposeRequest:
        """This round's call to the proposer, which thereby sees every token so far."""
        self.draft_synced = len(self.token_ids)
        return ProposeRequest(self.request_id, self.token_ids, self.round_k(), self.params, self.rng.getrandbits(63),
                              self.speculation.draft_tree())

    def proposal_in_hand(self) -> Proposal | None:
        """Co-located heads: the draft the previous verify pass proposed, cut to this round's
        depth (None when there is none or this round drafts nothing)."""
        k = self.round_k()
        if self.held_proposal is None or k == 0 or not self.speculation.co_located:
            return None
        return self.held_proposal.truncated(k)

    def may_draft_ahead(self, proposal: Proposal | None) -> bool:
        """Whether the draft pool may draft the next round while this round's `proposal` is
        verified: a greedy request drafting a chain from a draft pool, with room for a round
        after this one. Greedy only: a greedy round's output is the target's argmax whatever
        the draft, so drafting from a guessed context costs at most the draft's time."""
        spec = self.speculation
        return (proposal is not None and len(proposal.tree) > 0 and spec.draft_cost == "pool"
                and spec.shape == "chain" and self.params.greedy and self.room() > len(proposal.tree) + 2)

    def may_pipeline(self) -> bool:
        """Whether this request's rounds may verify a streamed draft (speculation.pipeline): a
        greedy chain from a draft pool at the configured k (not the load-aware policy), after its
        first round (the prompt's prefill, while the draft pool catches up) and with room for
        more than one chunk."""
        spec = self.speculation
        return (spec.pipeline > 0 and spec.draft_cost == "pool" and spec.shape == "chain" and spec.k > 0
                and not self.adaptive and self.params.greedy and self.stats.target_steps > 0
                and not self.draft_syncing and self.room() > spec.k + 1)

    def ahead_request(self, proposal: Proposal) -> ProposeRequest:
        """The next round's draft, asked for during this round's verify, on the guess that the
        round accepts its whole chain: k + 1 tokens after it, the first being the draft's own
        guess of the round's bonus token."""
        tokens = self.token_ids + list(proposal.tree.tokens)
        return ProposeRequest(self.request_id, tokens, len(proposal.tree) + 1, self.params, self.rng.getrandbits(63))

    def keep_ahead(self, request: ProposeRequest, ahead: Proposal | None) -> None:
        """After a round's commit: keep the draft drafted ahead (`ahead`, asked for by `request`)
        when the committed tokens are exactly the ones it was drafted after, that is the
        round's whole chain and then the draft's first token as the bonus token."""
        self.ahead = None
        if ahead is None or self.finished:
            return
        # the draft pool has seen what it drafted after: of that, all but the round's last token
        # was committed (the chain and the guess, or the accepted drafts and a correction)
        self.draft_synced = len(self.token_ids) - 1
        if len(ahead.tree) < 2:
            return
        drafted_after, guess = len(request.token_ids), ahead.tree.tokens[0]
        if len(self.token_ids) == drafted_after + 1 and self.output_ids[-1] == guess:
            self.ahead = replace(ahead, tree=TokenTree.chain(ahead.tree.tokens[1:]), compute_s=0.0)

    def take_ahead(self) -> Proposal | None:
        """This round's draft when the last round kept one (keep_ahead), cut to this round's
        depth (None: none kept, or this round drafts nothing). Taken once."""
        ahead, self.ahead = self.ahead, None
        k = self.round_k()
        if ahead is None or k == 0:
            return None
        self.stats.drafts_ahead_used += 1
        return ahead.truncated(k)

    def verify_request(self, proposal: Proposal | None) -> VerifyRequest:
        seed = self.rng.getrandbits(63)
        spec = self.speculation
        propose_next = None
        if spec.co_located:
            propose_next = DraftShape(min(spec.depth, max(0, self.room() - 2)), spec.draft_tree(),
                                      self.rng.getrandbits(63))
        typical = spec.typical if spec.lossy else None
        if proposal is None or not len(proposal.tree):
            return VerifyRequest(self.request_id, self.token_ids, self.params, seed, typical=typical,
                                 propose_next=propose_next)
        return VerifyRequest(self.request_id, self.token_ids, self.params, seed, proposal.tree, proposal.law,
                             proposal.dists, typical=typical, propose_next=propose_next)

    def stream_request(self) -> VerifyRequest:
        """The rest of the generation as one request, for a target that speculates itself
        (native mode): max_tokens is the room left."""
        params = replace(self.params, max_tokens=self.room())
        return VerifyRequest(self.request_id, self.token_ids, params, self.rng.getrandbits(63))

    def usage_stats(self) -> dict:
        """`usage.speculation`: the counters plus what produced them. A lossy acceptance is
        labelled as such wherever the numbers go."""
        spec = self.speculation
        return {**self.stats.as_dict(), "proposer": spec.proposer,
                "shape": "none" if spec.proposer == "none" else spec.shape,
                "acceptance": "typical (lossy)" if spec.lossy else "exact", "lossy": spec.lossy,
                "policy": "adaptive" if self.adaptive else "fixed"}

    def commit(self, result: VerifyResult, draft: TokenTree) -> list[int]:
        """Append a round's verified tokens, cut at EOS / stop ids / max_tokens. Returns the
        tokens actually emitted. `draft` is the tree the round verified."""
        self.held_proposal = result.next_proposal
        s = self.stats
        s.target_steps += 1
        depth = max(draft.depths) if len(draft) else 0  # positions count by depth: a tree has many nodes each
        add_counts(s.k_histogram, [0] * depth + [1])
        if self.acceptance is not None:
            self.acceptance.observe(depth, result.num_accepted, len(draft), asked=self.round_k())
        if len(draft):
            s.num_drafts += 1
            s.num_draft_tokens += len(draft)
            s.num_accepted_tokens += result.num_accepted
            add_counts(s.num_accepted_tokens_per_pos, [1] * result.num_accepted + [0] * (depth - result.num_accepted))
            accepted, reached = count_ranks(draft, draft.path_of(result.tokens[: result.num_accepted]))
            add_counts(s.num_accepted_tokens_per_rank, accepted)
            add_counts(s.num_reached_tokens_per_rank, reached)
        emitted = self._append(result.tokens)
        s.generated_tokens += len(emitted)
        return emitted

    def _append(self, tokens: list[int]) -> list[int]:
        """Append output tokens up to the end of the generation (EOS, a stop id, max_tokens or
        the context), setting `finish_reason` there. Returns the tokens appended."""
        emitted: list[int] = []
        for token in tokens:
            if self.room() <= 0:
                break
            emitted.append(token)
            self.output_ids.append(token)
            if (not self.params.ignore_eos and token in self.eos_token_ids) or token in self.params.stop_token_ids:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and self.room() <= 0:
            self.finish_reason = "length"
        return emitted

    def resume(self, token_ids: list[int], decode) -> None:
        """Continue an interrupted generation of this same request: `token_ids` are what an
        earlier run of it already sent. They become the start of the output (they count against
        max_tokens, and EOS, stop ids and stop strings end the request as if it had generated
        them) and the rounds continue after them. Greedy, the continuation is the one the
        interrupted run would have made; sampled, it is drawn from the target's distribution
        given them (a seed's draws restart, so a seeded run differs from an uninterrupted one)."""
        appended = len(self._append(token_ids))
        if appended < len(token_ids):
            raise SpecserveError(f"resume_token_ids go on after the generation ended at token {appended} "
                                 f"({self.finish_reason}): send only the tokens the interrupted stream sent")
        self.finish_at_stop_string(decode)

    def finish_at_stop_string(self, decode) -> str | None:
        """If the decoded output contains a stop string, cut the output after the token that
        completes the earliest one and return the text before it (OpenAI semantics: the stop
        sequence itself is not returned). `decode(ids) -> str`."""
        if not self.params.stop:
            return None
        text = decode(self.output_ids)
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        keep = next(n for n in range(1, len(self.output_ids) + 1)
                    if any(s in decode(self.output_ids[:n]) for s in self.params.stop))
        self.stats.generated_tokens -= len(self.output_ids) - keep
        del self.output_ids[keep:]
        self.finish_reason = "stop"
        self.stop_text = text[:cut]
        return self.stop_text


def catch_up_owed(states: Iterable[RequestState]) -> bool:
    """Whether any of these requests owes its draft pool a catch-up that its next drafting
    round starts (RequestState.draft_catch_up_owed)."""
    return any(state.draft_catch_up_owed() for state in states)


def switch_cost_s(load: LoadModel, states: Iterable[RequestState]) -> float:
    """What switching these requests to the model would cost now: their draft pools'
    catch-ups (LoadModel.catch_up_s of switch_catch_up_tokens), summed over every one of
    them, so that it does not depend on which request's round begins an epoch. A request
    still in its first round adds nothing: its draft pool prefills its prompt alongside the
    target's prefill, what speculating costs at all (always on pays it too)."""
    return load.catch_up_s(switch_catch_up_tokens(
        (state.draft_unseen, state.speculation.depth) for state in states
        if state.speculation.draft_cost == "pool" and state.stats.target_steps > 0))


def room_tokens(states: Iterable[RequestState]) -> float | None:
    """The tokens these requests may still emit, on average (RequestState.room; None for none):
    how long a switch to the model has to earn its catch-ups back (MeasuredModes, "Paying back")."""
    rooms = [state.room() for state in states]
    return sum(rooms) / len(rooms) if rooms else None
