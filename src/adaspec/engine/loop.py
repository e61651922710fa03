"""The speculative decode loop, with nothing model-specific in it.

One step: the drafter proposes (a chain, or a token tree) below the last token, the target
scores every proposed node in one forward pass, the verifier accepts a path plus one token
of its own, and the target and draft caches roll back to the accepted context. With no
drafter the same loop is plain decoding. Chains and trees differ only in the proposal and
verifier objects, never in this loop.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from adaspec import verify as verification
from adaspec.backends.base import ForwardOutput, ModelBackend, common_prefix
from adaspec.control.base import LengthController
from adaspec.control.static import StaticLength
from adaspec.core.grammar import Constraint, apply_masks, mask_shift
from adaspec.core.metrics import RequestStats
from adaspec.core.proposal import Proposal
from adaspec.core.request import RequestState, StepHook
from adaspec.core.sampling import (
    SamplingParams,
    TokenLogprob,
    argmax,
    process_logits,
    token_logprobs,
    top2_gap,
)
from adaspec.core.text import TextAssembler
from adaspec.draft.base import Drafter
from adaspec.engine.batch import run_alone
from adaspec.engine.steps import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    PLAIN,
    GenerationResult,
    StreamChunk,
    TargetCall,
)
from adaspec.errors import InputError
from adaspec.verify.base import Verdict, Verifier

if TYPE_CHECKING:
    from adaspec.cost.batch import Seat


class TextGenerator(ABC):
    """What every engine offers a caller: prompts in (text, chat turns or token ids), tokens
    and text out, streamed or whole. `Engine` decodes; `route.router.RoutedGenerator` picks an
    engine per request and lets it decode."""

    target: ModelBackend
    tokenizer: object
    eos_token_ids: set[int]
    max_context: int

    # ----------------------------------------------------------------- input
    def encode_prompt(
        self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a prompt: text, token ids, or a chat as a list of
        {"role", "content"} messages ending with a user turn (multi-turn conversations; an
        assistant turn may carry `tool_calls`, a `tool` turn answers one). `tools`: the
        functions the model may call (OpenAI's shape), rendered by the chat template."""
        if tools and not (isinstance(prompt, Sequence) and prompt
                          and isinstance(prompt[0], dict)):
            raise InputError("tools need a chat (messages), not a plain prompt")
        if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            return self._encode_messages(list(cast("Sequence[dict]", prompt)), chat, tools)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("prompt is empty: give some text to continue")
            return self._encode_messages([{"role": "user", "content": prompt}], chat)
        ids = [int(t) for t in cast("Sequence[int]", prompt)]  # chats returned above
        if not ids:
            raise InputError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InputError(
                f"prompt has token ids outside the vocabulary "
                f"[0, {self.target.vocab_size}): {bad[:5]}"
            )
        return ids

    def _encode_messages(self, messages: list[dict], chat: bool,
                         tools: list[dict] | None = None) -> list[int]:
        if any(not str(m.get("content") or "").strip() and not m.get("tool_calls")
               for m in messages):
            raise InputError("a chat message is empty: every turn needs some text")
        if self.tokenizer is None:
            raise InputError("this engine has no tokenizer: pass the prompt as token ids")
        tok: Any = self.tokenizer  # a transformers tokenizer
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True,
                **({"tools": tools} if tools else {}),
            )
            if hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        if tools:
            raise InputError("tools are rendered by the model's chat template, and this "
                             "tokenizer has none")
        text = "\n".join(str(m["content"]) for m in messages)  # no template: plain turns
        return [int(t) for t in tok.encode(text, add_special_tokens=False)]

    def _check_lengths(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        total = len(prompt_ids) + max_new_tokens
        if total > self.max_context:
            raise InputError(
                f"context too long: prompt has {len(prompt_ids)} tokens + max_new_tokens "
                f"{max_new_tokens} = {total} > context window {self.max_context}; shorten the "
                "prompt or lower max_new_tokens"
            )

    # ------------------------------------------------------------------ output
    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool = True,
        *,
        recorder: StepHook | None = None,
    ) -> Generator[StreamChunk | GenerationResult, None, None]:
        """Yield StreamChunks as tokens are accepted, then the final GenerationResult;
        `recorder` sees every verification (online distillation's record)."""
        yield from run_alone(self.stream_steps(prompt, max_new_tokens, sampling, stop, chat,
                                               recorder=recorder))

    def stream_steps(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool = True,
        seat: Seat | None = None,
        recorder: StepHook | None = None,
        reuse: int | None = None,
    ) -> Iterator[StreamChunk | GenerationResult | TargetCall]:
        """`stream` with the target calls left to the caller (`steps`); bad input fails
        here, before any compute. `seat`: the request's place in a batch's round (its
        drafter prices against it); `recorder`: a hook that sees its verifications;
        `reuse`: how many leading prompt tokens the target's cache may keep of what it
        holds or take from a sibling sequence's (a server's slot: all of them; 0: a cold
        request, `cache_prompt: false`), None: what this engine's last request left there
        (a bench switching methods on one cache reuses nothing of another's)."""
        sampling = sampling or SamplingParams()
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError("stop strings must be non-empty strings")
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        self._check_lengths(prompt_ids, max_new_tokens)
        return self.steps(prompt_ids, max_new_tokens, sampling, list(stop), seat=seat,
                          recorder=recorder, reuse=reuse)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool = True,
        *,
        recorder: StepHook | None = None,
    ) -> GenerationResult:
        result = None
        for item in self.stream(prompt, max_new_tokens, sampling, stop, chat,
                                recorder=recorder):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    @abstractmethod
    def decode(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, stop: list[str]
    ) -> Iterator[StreamChunk | GenerationResult]:
        """Decode checked prompt ids."""

    def steps(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams,
        stop: list[str], *, seat: Seat | None = None, recorder: StepHook | None = None,
        reuse: int | None = None,
    ) -> Iterator[StreamChunk | GenerationResult | TargetCall]:
        """`decode`, yielding the target calls a driver may batch with other requests'
        (`TargetCall`); a generator that yields none runs its own at once."""
        return self.decode(prompt_ids, max_new_tokens, sampling, stop)

    def request_done(self) -> None:
        """The last request is over (a server says so as soon as it ends): what learns
        across requests (the cross-request history) takes it in now."""

    def learn_with(self, other: TextGenerator) -> None:
        """Learn across requests together with `other`, the same method's engine on another
        sequence of the same models (a server's slots: one method learns from all of them)."""


class Engine(TextGenerator):
    """Target backend + tokenizer + decoding method (drafter, length controller, verifier)."""

    def __init__(
        self,
        target: ModelBackend,
        tokenizer,
        drafter: Drafter | None = None,
        controller: LengthController | None = None,
        verify: str | Verifier | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_context: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.controller = controller or StaticLength(4)
        # how requests are verified (`request_verifier` picks each one's Verifier): None or
        # "default": greedy at temperature 0; above, speculative sampling (mcss-wor for a
        # drafter of trees); a name or a Verifier, checked against the drafter now
        self.verify = verify
        verification.choose(verify, self.drafts_trees)
        self.eos_token_ids = set(
            eos_token_ids if eos_token_ids is not None else tokenizer_eos_ids(tokenizer)
        )
        limits = [target.max_context, max_context or target.max_context]
        if drafter is not None and hasattr(drafter, "backend"):
            limits.append(drafter.backend.max_context)
        self.max_context = min(limits)
        if drafter is not None and drafter.needs_features:
            # a draft head reads the target's states from its verification passes
            if not target.has_features:
                raise InputError(f"drafter {drafter.name!r} reads the target's features, and "
                                 f"the {target.kind} runtime gives none")
            target.record_features(True)
        # the previous request's prompt and answer (prefix reuse: a conversation's next turn
        # resends both)
        self._last_context: list[int] = []

    @property
    def drafts_trees(self) -> bool:
        return self.drafter is not None and self.drafter.drafts_trees

    def request_done(self) -> None:
        if self.drafter is not None:
            self.drafter.learn()

    def learn_with(self, other: TextGenerator) -> None:
        if self.drafter is not None and isinstance(other, Engine) and other.drafter is not None:
            self.drafter.learn_with(other.drafter)

    def request_verifier(self, sampling: SamplingParams) -> Verifier:
        """The verifier of one request (bad settings fail here, before any compute)."""
        return verification.choose(self.verify, self._trees_for(sampling), sampling.greedy)

    def _trees_for(self, sampling: SamplingParams) -> bool:
        """Whether this request's proposals may branch: a drafter of trees that chains a
        constrained request proposes it chains (verified as chains)."""
        drafter = self.drafter
        return drafter is not None and drafter.drafts_trees and not (
            sampling.grammar is not None and drafter.chains_when_constrained)

    # ------------------------------------------------------------------ loop
    def decode(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop: list[str],
        prefill: ForwardOutput | None = None,
        stats: RequestStats | None = None,
    ) -> Iterator[StreamChunk | GenerationResult]:
        """Decode after the prompt. `prefill`: the target already scored the prompt into its
        cache (a router did, to read the prompt's state), with `stats` it started."""
        return run_alone(self.steps(prompt_ids, max_new_tokens, sampling, stop, prefill, stats))

    def steps(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop: list[str],
        prefill: ForwardOutput | None = None,
        stats: RequestStats | None = None,
        *,
        seat: Seat | None = None,
        recorder: StepHook | None = None,
        reuse: int | None = None,
    ) -> Iterator[StreamChunk | GenerationResult | TargetCall]:
        """The decode loop, yielding its chunks and the target calls it needs."""
        stats = stats or RequestStats(prompt_tokens=len(prompt_ids))
        verifier = self.request_verifier(sampling)
        req = RequestState(list(prompt_ids), max_new_tokens, sampling, sampling.generator(),
                           stats, verifier.replacement, seat, recorder,
                           constraint=self._constraint(sampling))
        if recorder is not None:
            recorder.begin(prompt_ids)
        generator = req.generator
        assert generator is not None
        text_out = TextAssembler(self.tokenizer, stop)
        t_start = time.perf_counter() - stats.prefill_time - stats.route_time

        if prefill is None:
            # A server's requests share their chat template's system turn, and a
            # conversation's next turn starts with this one's prompt and answer: the target
            # may keep what it already holds of the prefix this prompt shares with the last
            # request's context (whatever it holds of it: `reusable_prefix`).
            if reuse is None:
                reuse = common_prefix(prompt_ids, self._last_context)
            call = TargetCall(self.target, torch.tensor(prompt_ids), prompt_reuse=reuse,
                              remaining=max_new_tokens)
            yield call
            assert call.out is not None
            prefill = call.out
            stats.cached_tokens = call.cached
        self._last_context = list(prompt_ids)
        if prefill.features is not None and len(prefill.features):  # the last prompt rows'
            req.keep_features(len(prompt_ids) - len(prefill.features), prefill.features)
        masks = self._shift(req, Proposal.chain(prompt_ids[-1], []),
                            req.constraint.mask()[None] if req.constraint is not None else None)
        first = self._verify(Proposal.chain(prompt_ids[-1], []), prefill, sampling, generator,
                             verifier, rows=slice(-1, None), masks=masks).next_token
        want_logprobs = sampling.logprobs is not None
        step_logprobs = (token_logprobs(apply_masks(prefill.device_logits[-1:], masks), [first],
                                        sampling) if want_logprobs else [])
        generated_logprobs: list[TokenLogprob] = []
        stats.target_calls += 1
        stats.prefill_time = time.perf_counter() - t_start - stats.route_time
        self.controller.begin()
        # The draft prefills its copy of the prompt only once a step will draft: after the
        # first token is out (time to first token stays the target's prefill alone), and
        # never for a request that ends at its first token.
        drafter_started = False

        req.accept([first])
        if req.constraint is not None:
            req.constraint.accept([first])
        generated: list[int] = []
        step_tokens = [first]
        step_sources = [PLAIN]
        finish = None
        while True:
            # Emit this step's tokens, honouring EOS, the token budget and stop strings.
            emitted: list[int] = []
            for tok in step_tokens:
                emitted.append(tok)
                generated.append(tok)
                if tok in self.eos_token_ids:
                    finish = "eos"
                    break
                if len(generated) >= max_new_tokens:
                    finish = "length"
                    break
            generated_logprobs += step_logprobs[: len(emitted)]
            req.count_emitted(len(emitted))
            piece, hit_stop = text_out.push(generated, final=finish is not None)
            if hit_stop:
                finish = "stop"
                kept = text_out.tokens_through_stop(generated)
                emitted = emitted[: max(0, len(emitted) - (len(generated) - kept))]
                del generated[kept:]
                del generated_logprobs[kept:]
            if piece or emitted:
                yield StreamChunk(text=piece, token_ids=emitted,
                                  sources=step_sources[: len(emitted)],
                                  logprobs=step_logprobs[: len(emitted)])
            if finish is not None:
                break

            if self.drafter is not None and not drafter_started:
                t0 = time.perf_counter()
                self.drafter.begin(req)
                stats.draft_prefill_time = time.perf_counter() - t0
                stats.draft_time += stats.draft_prefill_time
                drafter_started = True
            k = min(self.controller.max_tokens(), req.remaining - 1,
                    self.max_context - len(req.context) - 1)
            step_tokens, step_sources, rows = yield from self._step(
                req, k, verifier, keep_rows=want_logprobs)
            if rows is not None:
                step_logprobs = token_logprobs(rows, step_tokens, sampling)

        self._last_context = req.context
        stats.new_tokens = len(generated)
        stats.wall_time = time.perf_counter() - t_start
        yield GenerationResult(
            text=text_out.final_text(generated),
            token_ids=generated,
            stats=stats,
            finish_reason=finish,
            prompt_ids=prompt_ids,
            logprobs=generated_logprobs if want_logprobs else None,
        )

    def _constraint(self, sampling: SamplingParams) -> Constraint | None:
        """The request's constraint, compiled for this engine's tokenizer (None: none)."""
        if sampling.grammar is None:
            return None
        if self._trees_for(sampling):
            raise InputError("constrained output (response_format, guided_grammar) is "
                             "verified on chains: use a method that drafts chains")
        return sampling.grammar.compile(self.tokenizer, self.target.vocab_size,
                                        self.eos_token_ids)

    def _step(
        self, req: RequestState, k: int, verifier: Verifier, keep_rows: bool = False,
    ) -> Generator[TargetCall, None, tuple[list[int], list[str], torch.Tensor | None]]:
        """Propose at most k levels below the last token, score root + proposal in one target
        pass, verify, roll both caches back to the accepted path; the accepted tokens, how
        each came out, and (keep_rows: logprobs asked for; the copy is not made otherwise) the
        target's logits rows [len(tokens), V] that chose them; `req.context` then holds
        them."""
        context, sampling, stats = req.context, req.sampling, req.stats
        generator = req.generator
        assert generator is not None
        remaining = req.remaining
        root = len(context) - 1  # cache index and position of the last token
        proposal = Proposal.chain(context[-1], [])
        # where the request's grammar allows one continuation only, it is the draft: certain
        # to be accepted, it costs verification rows only (the drafter sits this step out)
        forced = self._forced(req) if self.drafter is not None else []
        drafter = None if forced else self.drafter
        if forced:
            proposal = Proposal.chain(context[-1], forced, drafted_by={"grammar": len(forced)},
                                      accept=[1.0] * len(forced))
        elif self.drafter is not None and k > 0:
            if self.drafter.drafts_trees:
                req.tree_nodes = self.target.tree_room(root)
            t0 = time.perf_counter()
            proposal = self.drafter.propose(req, k, self.controller)
            stats.draft_time += time.perf_counter() - t0
            stats.draft_calls += proposal.forward_calls
            stats.head_calls += proposal.head_calls
            if proposal.depth > k:
                raise RuntimeError(f"drafter {self.drafter.name!r} proposed {proposal.depth} "
                                   f"levels, more than the {k} asked")

        masks = None
        if req.constraint is not None:  # the mask of every row the target will score
            proposal, masks = self._constrain(req, proposal, drafter)
        masks = self._shift(req, proposal, masks)
        if proposal.depth and proposal.accept is None:  # a batch prices the draft with it
            proposal = dataclasses.replace(proposal, accept=[_chain_rate(stats)] * proposal.depth)
        tokens, positions, mask = proposal.target_inputs(root)
        call = TargetCall(self.target, tokens, positions, mask, proposal=proposal, root=root,
                          fixed=not sampling.greedy and sampling.seed is not None,
                          remaining=remaining)
        t0 = time.perf_counter()
        yield call
        assert call.out is not None and call.proposal is not None
        out = call.out
        stats.target_time += call.seconds
        if call.proposal is not proposal:  # a batch verifies less of the draft
            proposal = call.proposal
            tokens = call.tokens
            if drafter is not None:
                drafter.cut(req, proposal.depth)
            if masks is not None:
                masks = masks[: proposal.depth + 1]
        parts = proposal.drafted_by or ({drafter.name: proposal.depth}
                                        if drafter is not None and proposal.depth else {})
        for part, n in parts.items():
            stats.drafted_by[part] = stats.drafted_by.get(part, 0) + n
        stats.target_calls += 1
        verdict = self._verify(proposal, out, sampling, generator, verifier, masks=masks)
        self._roll_back(root, verdict.path)
        kept = None
        if out.features is not None:  # the accepted positions' states, for a draft head
            kept = out.features[[0, *verdict.path]]
            req.keep_features(root, kept)
        alone = None
        if verifier.greedy and len(tokens) > 1 and self.target.batch_noise > 0:
            verdict, alone = self._settle_near_tie(proposal, apply_masks(out.logits, masks),
                                                   verdict, root, stats, masks)
        rows = None
        if keep_rows:  # row of node i chose the token after it; a recheck's lone row the last
            rows = apply_masks(out.device_logits, masks)[[0, *verdict.path]]
            if alone is not None:
                rows = torch.cat([rows[:-1], alone[-1:]])
        if req.recorder is not None:
            req.recorder.step(root, proposal.depth, verdict.path, out.device_logits, kept)
        stats.verify_time += time.perf_counter() - t0

        if proposal.depth:
            # Drafted counts positions (levels), not nodes: tree acceptance compares with
            # a chain's.
            stats.drafted += proposal.depth
            stats.accepted += verdict.accepted
            stats.steps.append((proposal.depth, verdict.accepted))
            stats.nodes.append(len(proposal.tree) - 1)
            if drafter is not None:  # the length rule learns from its drafter's steps only
                self.controller.update(proposal.depth, verdict.accepted)
        accepted = [*proposal.tokens_on(verdict.path), verdict.next_token]
        req.accept(accepted)
        if req.constraint is not None:
            req.constraint.accept(accepted)
        if drafter is not None:
            t0 = time.perf_counter()
            drafter.commit(req, verdict.path)
            stats.draft_time += time.perf_counter() - t0
        last = PLAIN if not proposal.depth else (
            BONUS if verdict.accepted == proposal.depth else CORRECTION
        )
        return accepted, [ACCEPTED] * verdict.accepted + [last], rows

    def _forced(self, req: RequestState) -> list[int]:
        """The tokens the request's grammar forces next, as many as the budget and the
        context leave room for (none without a grammar, or where it leaves a choice)."""
        if req.constraint is None:
            return []
        room = min(FORCED_MAX, req.remaining - 1, self.max_context - len(req.context) - 1)
        return req.constraint.forced()[: max(0, room)]

    def _shift(self, req: RequestState, proposal: Proposal, masks: torch.Tensor | None
               ) -> torch.Tensor | None:
        """What the request changes in each row the target scores [depth + 1, V]: the
        grammar's masks, a logit bias, penalties by the output so far (float: added; None:
        nothing). Verification reads the shifted rows, so every method stays exact."""
        if not req.sampling.adjusts:
            return masks
        shift = req.sampling.shift_rows(
            req.generated, proposal.tokens,
            masks.shape[1] if masks is not None else self.target.vocab_size)
        return shift if masks is None else shift + mask_shift(masks)

    def _constrain(self, req: RequestState, proposal: Proposal, drafter: Drafter | None
                   ) -> tuple[Proposal, torch.Tensor]:
        """The proposal the target scores under the request's constraint, and the mask of
        each of its rows [depth + 1, V]. A deterministic draft (or any at temperature 0) is
        cut before its first forbidden token: the target spends no row on it. A sampled draft
        keeps it: its masked target probability is 0, so the verifier rejects it and draws
        from the residual, which is what keeps sampling exact (the rows after it are never
        read)."""
        assert req.constraint is not None
        allowed, masks = req.constraint.masks_along(proposal.tokens)
        if allowed == proposal.depth:
            return proposal, masks
        if req.sampling.greedy or proposal.probs is None:
            if drafter is not None:
                drafter.cut(req, allowed)
            return proposal.cut(allowed), masks
        rest = torch.ones(proposal.depth - allowed, masks.shape[1], dtype=torch.bool)
        return proposal, torch.cat([masks, rest])

    def _settle_near_tie(
        self, proposal: Proposal, logits: torch.Tensor, verdict: Verdict, root: int,
        stats: RequestStats, masks: torch.Tensor | None = None,
    ) -> tuple[Verdict, torch.Tensor | None]:
        """Greedy on a runtime whose multi-token pass rounds otherwise than its single-token
        pass: a row whose top-2 gap is within that noise may pick another token than plain
        decoding picks. Cut the path at the first such row of the walk and re-score that row
        alone, as plain decoding does; the rows before it are settled.

        logits: [n, V] of the multi-token pass (masked by the request's constraint: masks
        [n, V], the lone row's too); the caches hold the context and the path. Returns the
        verdict and None when no row is that near, else the cut verdict and the lone pass's
        logits [1, V]."""
        walk = [0, *verdict.path]  # the rows that chose each emitted token, in order
        near = (top2_gap(logits[walk]) <= self.target.batch_noise).nonzero()
        if not len(near):
            return verdict, None
        cut = int(near[0])
        # keep the context and the path before row `cut`'s node; feed that node alone
        self.target.truncate(root + cut)
        node_token = proposal.tree.tokens[walk[cut]]
        alone = self.target.forward(torch.tensor([node_token])).device_logits
        if masks is not None:
            alone = apply_masks(alone, masks[walk[cut]][None])
        stats.target_calls += 1
        stats.rechecks += 1
        return Verdict(verdict.path[:cut], int(argmax(alone[-1]))), alone

    @staticmethod
    def _verify(proposal: Proposal, out: ForwardOutput, sampling: SamplingParams,
                generator: torch.Generator, verifier: Verifier, rows: slice = slice(None),
                masks: torch.Tensor | None = None) -> Verdict:
        """Verification runs where the model ran (a GPU's memory): a greedy verifier on the
        raw logits, the others on the processed distributions; only the verdict's few ids
        come back to the host. masks [n, V]: what the request's constraint allows at each
        of the rows (None: everything)."""
        logits = apply_masks(out.device_logits[rows], masks)
        if verifier.greedy:
            return verifier.verify(proposal, logits, generator)
        return verifier.verify(proposal, process_logits(logits, sampling), generator)

    def _roll_back(self, root: int, path: list[int]) -> None:
        """Keep the context and the accepted nodes in the target cache: a cut when they are
        its prefix (always, for a chain), else a compaction."""
        if path == list(range(1, len(path) + 1)):
            self.target.truncate(root + 1 + len(path))
        else:
            self.target.keep(torch.tensor([*range(root + 1), *(root + i for i in path)]))


FORCED_MAX = 16  # grammar-forced tokens drafted in one step


def _chain_rate(stats: RequestStats) -> float:
    """A request's running per-token acceptance: accepted tokens over accepted tokens plus
    the steps that stopped at a rejection (with one of each as a prior)."""
    rejected = sum(1 for drafted, accepted in stats.steps if accepted < drafted)
    return (stats.accepted + 1) / (stats.accepted + rejected + 2)


def tokenizer_eos_ids(tokenizer) -> list[int]:
    """The ids that end an output by the tokenizer: its eos token and adaspec's extras."""
    ids: list[int] = []
    if tokenizer is None:
        return ids
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    for extra in getattr(tokenizer, "adaspec_eos_token_ids", []) or []:
        ids.append(int(extra))
    return ids
