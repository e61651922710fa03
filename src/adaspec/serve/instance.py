"""One model instance: the loaded target (and draft), one engine per method string, and an
engine of its own for every request.

The backends load once. A method's engine (`engine`) is built once, on first use (a
cost-aware method measures its profile then, a head method times its head): it holds what
the method learns across requests and encodes prompts. A request gets a fresh engine of its
method on its slot's sequences (`request_engine`, under a millisecond: the heavy parts, the
head's weights and a router's policy, are shared), which learns with the method's; its
drafter's and controller's state is that request's alone and goes with it. All of them share
one cross-request history (`serve/history.py`), which the methods drafting from history read
and teach.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from adaspec.backends.base import ModelBackend
from adaspec.engine.loop import TextGenerator
from adaspec.errors import InputError
from adaspec.methods.spec import MethodSpec, parse_method
from adaspec.serve.config import ServeConfig
from adaspec.serve.history import ServedHistory

if TYPE_CHECKING:
    from adaspec.online.head_service import OnlineHead
    from adaspec.online.service import OnlineDistiller

# method parameters that name files on the server's disk: a request may not set them (it
# could make the server read any file); the server's own --method may
FILE_PARAMS = ("artifact", "disco", "profile")


class ModelInstance:
    def __init__(
        self,
        target: ModelBackend,
        tokenizer,
        draft: ModelBackend | None,
        eos_token_ids: list[int] | None,
        default_method: str,
        max_engines: int = 16,
        history: ServedHistory | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.eos_token_ids = eos_token_ids
        self.default_method = parse_method(default_method).text
        self.max_engines = max(1, max_engines)  # methods kept built (least recently used go)
        self._engines: OrderedDict[str, TextGenerator] = OrderedDict()
        self._lock = threading.Lock()
        self.history = history
        # the default engine is built now: a bad --method fails at startup, and a cost-aware
        # method measures its profile before the first request, not during it
        self.default_engine = self.engine(self.default_method)
        self.online: OnlineDistiller | OnlineHead | None = None  # see `start_online`
        # where requests decode (`open_slots`: one sequence each of the target and the draft
        # per request decoded together; `own_slot`: the models themselves)
        self.slots: list[tuple[ModelBackend, ModelBackend | None]] = [(target, draft)]

    @classmethod
    def load(cls, config: ServeConfig) -> ModelInstance:
        """Load the configured pair (a method's own `@int8/int4` wins over --weights)."""
        from adaspec.backends.load import load_backends

        spec = parse_method(config.method)
        needs_draft = spec.needs_draft_model()
        if needs_draft and not config.draft:
            raise InputError(f"method {spec.text!r} needs a draft model (--draft)")
        target, tokenizer, draft, eos = load_backends(
            config.target, config.draft if needs_draft or config.draft else None,
            config.dtype, spec.weights or config.weights,
            spec.draft_weights or config.draft_weights,
            sequences=config.sequences() + 1 if config.max_batch > 1 else 1,
            device=config.device,
        )
        try:
            history = ServedHistory.open(config.history, target, tokenizer,
                                         config.history_every, config.history_tokens)
            instance = cls(target, tokenizer, draft, eos, config.method, config.max_engines,
                           history)
        except BaseException:
            for backend in (draft, target):
                close = getattr(backend, "close", None)
                if callable(close):
                    close()
            raise
        if config.online is not None:
            try:
                instance.start_online(config)
            except BaseException:
                instance.close()
                raise
        return instance

    def start_online(self, config: ServeConfig) -> None:
        """Distil the draft on the default method's traffic (--online-distill): the draft
        head where that method drafts with it, else the draft model."""
        from torch import nn

        from adaspec.online.head_service import OnlineHead, head_drafter
        from adaspec.online.service import OnlineDistiller

        head = head_drafter(self.default_engine)
        if head is not None:  # the default method drafts with the head: it learns

            self.online = OnlineHead(config.online, head, self.target, self.target.name)
            self.online.check_engine(self.default_engine)
            return
        model = getattr(self.draft, "model", None)
        if not isinstance(model, nn.Module):
            raise InputError("--online-distill trains the draft in torch: give the draft "
                             "torch weights (--draft-weights int8, int4 or none)")
        self.online = OnlineDistiller(config.online, model, config.draft or "",
                                      config.target, config.weights)
        self.online.check_engine(self.default_engine)

    @property
    def max_context(self) -> int:
        return self.default_engine.max_context

    def check_method(self, text: str) -> MethodSpec:
        """Parse a request's method string; every mistake is a one-line InputError."""
        spec = parse_method(text)
        if spec.weights or spec.draft_weights:
            raise InputError(
                f"method {spec.text!r}: the weights are fixed when the server starts "
                "(--weights, --draft-weights); drop the '@...' part"
            )
        named = [k for k in FILE_PARAMS if spec.settings().get(k)]
        if named and spec.text != getattr(self, "default_method", None):
            raise InputError(
                f"method {spec.text!r}: {', '.join(k + '=' for k in named)} names a file; "
                "methods that read files are chosen when the server starts (--method), "
                "not per request"
            )
        if spec.needs_draft_model() and self.draft is None:
            raise InputError(f"method {spec.text!r} needs a draft model, and this server "
                             "runs without one (start it with --draft)")
        return spec

    def engine(self, method: str) -> TextGenerator:
        """The engine of a method string (built on first use; call from the worker only:
        building a cost-aware method may measure the models)."""
        from adaspec.methods.build import build_generator

        with self._lock:
            engine = self._engines.get(method)
            if engine is not None:
                self._engines.move_to_end(method)
                return engine
        spec = parse_method(method) if method == getattr(self, "default_method", None) \
            else self.check_method(method)
        engine = build_generator(spec, self.target, self.tokenizer, self.draft,
                              eos_token_ids=self.eos_token_ids,
                              history=self.history.index if self.history else None)
        with self._lock:
            self._engines[method] = engine
            while len(self._engines) > self.max_engines:
                oldest = next(iter(self._engines))
                if oldest == self.default_method:
                    self._engines.move_to_end(oldest)
                    oldest = next(iter(self._engines))
                del self._engines[oldest]
        return engine

    def open_slots(self, n: int) -> None:
        """Give each of `n` requests decoded together a sequence of its own in the target
        (and the draft): InputError naming the fix where a runtime keeps one sequence."""
        from adaspec.backends.sequences import sequences

        targets = sequences(self.target, n)
        drafts: list[ModelBackend | None] = [None] * n
        if self.draft is not None:
            drafts = list(sequences(self.draft, n))
        self.slots = list(zip(targets, drafts, strict=True))

    def own_slot(self) -> None:
        """One request at a time: the one slot is the models' own cache."""
        self.slots = [(self.target, self.draft)]

    def request_engine(self, method: str, slot: int) -> TextGenerator:
        """A new engine of `method` for one request on slot `slot`'s sequences: its own
        drafter and length controller, dropped with the request; the history, the heavy
        parts and what the method learns across requests shared with `engine`'s."""
        from adaspec.methods.build import build_generator

        shared = self.engine(method)  # checks the method (and measures a profile) once
        target, draft = self.slots[slot]
        engine = build_generator(parse_method(method), target, self.tokenizer, draft,
                              eos_token_ids=self.eos_token_ids,
                              history=self.history.index if self.history else None)
        engine.learn_with(shared)  # every request teaches the one method
        return engine

    def token_text(self, token: int) -> str:
        """One token id's text, as logprobs name it."""
        return self.tokenizer.decode([token])

    def encode(self, prompt, chat: bool, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt (text, token ids or chat turns, with the tools the model
        may call): the tokenizer only."""
        return self.default_engine.encode_prompt(prompt, chat=chat, tools=tools)

    def request_done(self, engine: TextGenerator) -> None:
        """A request finished on `engine` (the worker calls this): the history learns it."""
        if self.history is not None:
            self.history.request_done(engine)

    def close(self) -> None:
        history: ServedHistory | None = getattr(self, "history", None)
        if history is not None:
            with self._lock:
                engines = list(self._engines.values())
            history.close(engines)
        online: OnlineDistiller | OnlineHead | None = getattr(self, "online", None)
        if online is not None:
            online.close()
        for backend in (self.draft, self.target):
            close = getattr(backend, "close", None)
            if callable(close):
                close()
