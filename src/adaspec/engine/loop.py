"""The speculative decode loop, with nothing model-specific in it.

One step: the drafter proposes up to k tokens, the target scores [last token] + draft in one
forward pass, the verifier accepts a prefix plus one correction/bonus token, and the target
cache rolls back to the accepted context. With no drafter the same loop is plain decoding.
A tree drafter (MCSD) makes the step draft a token tree instead: the target scores every node
in one pass (tree mask + positions), a tree verifier walks it from the root, and both caches
are compacted to the accepted path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from adaspec.backends.base import ForwardOutput, ModelBackend
from adaspec.control.base import LengthController
from adaspec.control.static import StaticLength
from adaspec.draft.base import Drafter, DraftProposal
from adaspec.draft.model_tree import TreeDrafter
from adaspec.engine.metrics import RequestStats
from adaspec.engine.sampling import SamplingParams, process_logits
from adaspec.engine.token_tree import TokenTree, TreeProposal
from adaspec.errors import InputError
from adaspec.verify.base import Verifier
from adaspec.verify.greedy import GreedyVerifier
from adaspec.verify.multi_candidate import (
    GreedyTreeVerifier,
    MCSSWithoutReplacementVerifier,
    TreeVerifier,
)
from adaspec.verify.speculative import SpeculativeSampler


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: RequestStats
    finish_reason: str  # "eos" | "length" | "stop"
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class StreamChunk:
    text: str  # newly final text (held back while it could still be part of a stop string)
    token_ids: list[int]  # tokens accepted in this step


class Engine:
    """Target backend + tokenizer + decoding method (drafter, length controller, verifier)."""

    def __init__(
        self,
        target: ModelBackend,
        tokenizer,
        drafter: Drafter | None = None,
        controller: LengthController | None = None,
        verifier: Verifier | TreeVerifier | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_context: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.controller = controller or StaticLength(4)
        self.verifier = verifier  # None: greedy at temperature 0, speculative sampling above
        self.eos_token_ids = set(
            eos_token_ids if eos_token_ids is not None else _eos_ids(tokenizer)
        )
        limits = [target.max_context, max_context or target.max_context]
        if drafter is not None and hasattr(drafter, "backend"):
            limits.append(drafter.backend.max_context)
        self.max_context = min(limits)

    # ----------------------------------------------------------------- input
    def encode_prompt(
        self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = True
    ) -> list[int]:
        """Token ids of a prompt: text, token ids, or a chat as a list of
        {"role", "content"} messages ending with a user turn (multi-turn conversations)."""
        if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            return self._encode_messages(list(prompt), chat)  # type: ignore[arg-type]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("prompt is empty: give some text to continue")
            return self._encode_messages([{"role": "user", "content": prompt}], chat)
        ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InputError(
                f"prompt has token ids outside the vocabulary "
                f"[0, {self.target.vocab_size}): {bad[:5]}"
            )
        return ids

    def _encode_messages(self, messages: list[dict], chat: bool) -> list[int]:
        if any(not str(m.get("content", "")).strip() for m in messages):
            raise InputError("a chat message is empty: every turn needs some text")
        if self.tokenizer is None:
            raise InputError("this engine has no tokenizer: pass the prompt as token ids")
        if chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        text = "\n".join(str(m["content"]) for m in messages)  # no template: plain turns
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

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

    # ------------------------------------------------------------------ loop
    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool = True,
    ) -> Iterator[StreamChunk | GenerationResult]:
        """Yield StreamChunks as tokens are accepted, then the final GenerationResult."""
        sampling = sampling or SamplingParams()
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError("stop strings must be non-empty strings")
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        self._check_lengths(prompt_ids, max_new_tokens)
        yield from self._decode(prompt_ids, max_new_tokens, sampling, list(stop))

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool = True,
    ) -> GenerationResult:
        result = None
        for item in self.stream(prompt, max_new_tokens, sampling, stop, chat):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    def _verifier_for(self, sampling: SamplingParams) -> Verifier:
        if isinstance(self.verifier, TreeVerifier):
            raise InputError(
                f"verifier {self.verifier.name!r} walks token trees; give the drafter a tree "
                "(tree=...) or use verify=speculative or greedy"
            )
        if self.verifier is not None:
            if isinstance(self.verifier, GreedyVerifier) and not sampling.greedy:
                raise InputError(
                    "the greedy verifier only keeps the output exact at temperature 0; use "
                    "verify=speculative (or leave verify unset) for temperature > 0"
                )
            return self.verifier
        return GreedyVerifier() if sampling.greedy else SpeculativeSampler()

    def _tree_verifier_for(self, sampling: SamplingParams) -> TreeVerifier:
        verifier = self.verifier
        if verifier is None:
            return GreedyTreeVerifier() if sampling.greedy else MCSSWithoutReplacementVerifier()
        if not isinstance(verifier, TreeVerifier):
            raise InputError(
                f"verifier {verifier.name!r} checks chains; a token tree needs verify=mcss, "
                "mcss-wor, mcns or greedy"
            )
        if isinstance(verifier, GreedyTreeVerifier) and not sampling.greedy:
            raise InputError(
                "the greedy verifier only keeps the output exact at temperature 0; use "
                "verify=mcss-wor, mcss or mcns (or leave verify unset) for temperature > 0"
            )
        return verifier

    # A router engine (adaspec.route) asks the prefill for the prompt's hidden state at this
    # layer and picks the drafter, controller and verifier in `_route`, so the routing
    # decision costs no second prefill. Plain engines do neither.
    prefill_hidden_layer: int | None = None

    def _route(
        self,
        prompt_ids: list[int],
        prefill: ForwardOutput,
        sampling: SamplingParams,
        stats: RequestStats,
    ) -> None:
        """Hook between the prefill and the first token: choose this request's method."""

    def _request_verifier(self, sampling: SamplingParams) -> Verifier | TreeVerifier:
        if isinstance(self.drafter, TreeDrafter):
            return self._tree_verifier_for(sampling)
        return self._verifier_for(sampling)

    def _decode(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, stop: list[str]
    ) -> Iterator[StreamChunk | GenerationResult]:
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        generator = sampling.generator()
        self._request_verifier(sampling)  # bad settings fail before any compute
        text_out = _TextAssembler(self.tokenizer, stop)
        t_start = time.perf_counter()

        prefill = self.target.prefill(
            torch.tensor(prompt_ids), hidden_layer=self.prefill_hidden_layer
        )
        self._route(prompt_ids, prefill, sampling, stats)
        verifier = self._request_verifier(sampling)  # for the method the router chose
        first = _pick(prefill.logits[-1:], sampling, generator, verifier)
        stats.target_calls += 1
        stats.prefill_time = time.perf_counter() - t_start - stats.route_time
        self.controller.start()
        # The draft prefills its copy of the prompt only once a step will draft: after the
        # first token is out (time to first token stays the target's prefill alone), and
        # never for a request that ends at its first token.
        drafter_started = False

        context = prompt_ids + [first]
        generated: list[int] = []
        step_tokens = [first]
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
            piece, hit_stop = text_out.push(generated, final=finish is not None)
            if hit_stop:
                finish = "stop"
                kept = text_out.tokens_through_stop(generated)
                emitted = emitted[: max(0, len(emitted) - (len(generated) - kept))]
                del generated[kept:]
            if piece or emitted:
                yield StreamChunk(text=piece, token_ids=emitted)
            if finish is not None:
                break

            if self.drafter is not None and not drafter_started:
                t0 = time.perf_counter()
                self.drafter.start(prompt_ids)
                stats.draft_prefill_time = time.perf_counter() - t0
                stats.draft_time += stats.draft_prefill_time
                drafter_started = True
            remaining = max_new_tokens - len(generated)
            k = min(
                self.controller.max_tokens(), remaining - 1, self.max_context - len(context) - 1
            )
            if isinstance(self.drafter, TreeDrafter):
                step_tokens = self._tree_step(context, k, sampling, generator, verifier, stats)
            else:
                step_tokens = self._chain_step(context, k, sampling, generator, verifier, stats)
            context = context + step_tokens
            if self.drafter is not None:
                t0 = time.perf_counter()
                self.drafter.commit(context)
                stats.draft_time += time.perf_counter() - t0

        stats.new_tokens = len(generated)
        stats.wall_time = time.perf_counter() - t_start
        yield GenerationResult(
            text=text_out.final_text(generated),
            token_ids=generated,
            stats=stats,
            finish_reason=finish,
            prompt_ids=prompt_ids,
        )

    def _chain_step(
        self,
        context: list[int],
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,
        verifier: Verifier,
        stats: RequestStats,
    ) -> list[int]:
        """Draft up to k tokens, score [last token] + draft, verify; the accepted tokens."""
        proposal = DraftProposal(tokens=[])
        if self.drafter is not None and k > 0:
            t0 = time.perf_counter()
            proposal = self.drafter.propose(context, k, self.controller, sampling, generator)
            stats.draft_time += time.perf_counter() - t0
            stats.draft_calls += proposal.forward_calls
            proposal.tokens = proposal.tokens[:k]

        t0 = time.perf_counter()
        draft = proposal.tokens
        fed = torch.tensor([context[-1], *draft])
        target_logits = self.target.forward(fed).logits
        stats.target_calls += 1
        target_probs = (
            target_logits
            if isinstance(verifier, GreedyVerifier)
            else process_logits(target_logits, sampling)
        )
        draft_probs = proposal.probs[: len(draft)] if proposal.probs is not None else None
        verdict = verifier.verify(draft, draft_probs, target_probs, generator)
        self.target.truncate(len(context) + verdict.accepted)
        stats.verify_time += time.perf_counter() - t0

        if draft:
            stats.drafted += len(draft)
            stats.accepted += verdict.accepted
            stats.steps.append((len(draft), verdict.accepted))
            self.controller.update(len(draft), verdict.accepted)
        return [*draft[: verdict.accepted], verdict.next_token]

    def _tree_step(
        self,
        context: list[int],
        depth: int,
        sampling: SamplingParams,
        generator: torch.Generator,
        verifier: TreeVerifier,
        stats: RequestStats,
    ) -> list[int]:
        """Draft a token tree below the last token, score every node in one target pass
        (tree mask + positions), walk it with the tree verifier, and compact both caches to
        the accepted path; the accepted tokens."""
        assert isinstance(self.drafter, TreeDrafter)
        root = len(context) - 1  # cache index and position of the root (the last token)
        if depth > 0:
            t0 = time.perf_counter()
            proposal = self.drafter.propose_tree(
                context, depth, sampling, generator, verifier.replacement
            )
            stats.draft_time += time.perf_counter() - t0
            stats.draft_calls += proposal.forward_calls
        else:
            proposal = TreeProposal(tree=TokenTree.root(context[-1]))
        tree = proposal.tree

        t0 = time.perf_counter()
        tokens, positions, mask = tree.flatten(root)
        target_logits = self.target.forward(tokens, positions, mask).logits
        stats.target_calls += 1
        target_probs = (
            target_logits
            if isinstance(verifier, GreedyTreeVerifier)
            else process_logits(target_logits, sampling)
        )
        verdict = verifier.verify_tree(tree, proposal.probs, target_probs, generator)
        if verdict.path == list(range(1, verdict.accepted + 1)):  # a prefix of the cache
            self.target.truncate(root + 1 + verdict.accepted)
        else:
            self.target.keep(torch.tensor([*range(root + 1), *(root + i for i in verdict.path)]))
        stats.verify_time += time.perf_counter() - t0

        if tree.depth:
            # Drafted counts positions (levels), not nodes: acceptance compares with chains.
            stats.drafted += tree.depth
            stats.accepted += verdict.accepted
            stats.steps.append((tree.depth, verdict.accepted))
            self.controller.update(tree.depth, verdict.accepted)
            t0 = time.perf_counter()
            self.drafter.accept_path(verdict.path)
            stats.draft_time += time.perf_counter() - t0
        return [*(tree.tokens[i] for i in verdict.path), verdict.next_token]


def _pick(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator,
    verifier: Verifier | TreeVerifier,
) -> int:
    """The first token comes straight from the prefill: a verification of an empty draft."""
    greedy = isinstance(verifier, (GreedyVerifier, GreedyTreeVerifier))
    probs = logits if greedy else process_logits(logits, sampling)
    if isinstance(verifier, TreeVerifier):
        return verifier.verify_tree(TokenTree.root(0), None, probs, generator).next_token
    return verifier.verify([], None, probs, generator).next_token


def _eos_ids(tokenizer) -> list[int]:
    ids: list[int] = []
    if tokenizer is None:
        return ids
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    for extra in getattr(tokenizer, "adaspec_eos_token_ids", []) or []:
        ids.append(int(extra))
    return ids


class _TextAssembler:
    """Turns accepted tokens into final text, holding back what may still become a stop
    string or an incomplete UTF-8 character."""

    STABLE_EVERY = 16  # tokens between updates of the decoded prefix kept

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.sent = 0  # characters already handed out
        self.cut: int | None = None  # where a stop string begins
        # Decoding every generated token again at each step cost 1.4 ms a step at 256
        # tokens; a prefix that ends on a whole character decodes the same on its own, so
        # its text is kept and only the tokens after it are decoded. (Not when the tokenizer
        # rewrites spaces across tokens: then the whole text is decoded each time.)
        self._incremental = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._stable: list[int] = []
        self._stable_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        n = len(self._stable)
        if not self._incremental or ids[:n] != self._stable:
            self._stable, self._stable_text = [], ""
            n = 0
        text = self._stable_text + self._decode(ids[n:])
        if len(ids) - n >= self.STABLE_EVERY and not text.endswith("\ufffd"):
            self._stable, self._stable_text = list(ids), text
        return text

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        text = self._text(ids)
        hit = False
        for s in self.stop:
            pos = text.find(s)
            if pos != -1 and (self.cut is None or pos < self.cut):
                self.cut = pos
                hit = True
        if self.cut is not None:
            safe = self.cut
        elif final:
            safe = len(text)
        else:
            safe = len(text) - _held_back(text, self.stop)
        piece = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return piece, hit

    def tokens_through_stop(self, ids: list[int]) -> int:
        """The fewest leading tokens whose text already reaches the stop string."""
        assert self.cut is not None
        n = len(ids)
        while n > 1 and self._reaches_stop(ids[: n - 1]):
            n -= 1
        return n

    def _reaches_stop(self, ids: list[int]) -> bool:
        text = self._text(ids)
        return any(text.find(s) == self.cut for s in self.stop)

    def final_text(self, ids: list[int]) -> str:
        text = self._text(ids)
        return text[: self.cut] if self.cut is not None else text


def _held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` that could still start a stop string or be a partial
    multi-byte character."""
    hold = 0
    while hold < len(text) and text[len(text) - 1 - hold] == "\ufffd":
        hold += 1
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold
