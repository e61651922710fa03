"""Constrained output (`core/grammar.py`): the grammar is checked on arrival, and every
method's output under it is constrained plain decoding's, token for token at temperature 0
and in law above it.

A tiny target and draft over the byte-level BPE tokenizer of tests/conftest.py (303 tokens):
random models that, unconstrained, write no JSON at all, so an output that parses came from
the mask. The controls: the same engines with the target's rows left unmasked, or with a
sampled draft cut at its first forbidden token (no residual), must fail the same checks.
"""

from __future__ import annotations

import json

import pytest
import torch

from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.grammar import Grammar
from adaspec.core.sampling import SamplingParams, argmax, process_logits
from adaspec.engine import loop
from adaspec.errors import InputError
from adaspec.methods.build import build_generator

from .conftest import bpe_tokenizer, sampling_backend, tiny_model
from .stats_helpers import assert_caught, assert_exact, fit_counts

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "kind"], "additionalProperties": False,
}
METHODS = ["ar", "ngram:k=4", "draft:k=4", "draft:k=3,ctrl=heuristic"]


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    return (tiny_model(vocab=len(tok), seed=0, sharpen=10.0),
            tiny_model(vocab=len(tok), seed=1, layers=1, sharpen=10.0))


def engine(method: str, models, tok, runtime=TorchBackend):
    target, draft = models
    return build_generator(method, runtime(target), tok, runtime(draft),
                        eos_token_ids=[tok.eos_token_id])


def constrained_greedy(model, grammar: Grammar, tok, prompt: list[int], n: int) -> list[int]:
    """Plain decoding under the grammar, by hand: a whole forward per token, the mask, the
    argmax."""
    eos = tok.eos_token_id
    constraint = grammar.compile(tok, model.config.vocab_size, {eos})
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(argmax(logits.masked_fill(~constraint.mask(), float("-inf"))))
            out.append(token)
            ids.append(token)
            if token == eos:
                break
            constraint.accept([token])
    return out


def test_a_grammar_is_checked_when_it_arrives():
    assert Grammar.json_schema(SCHEMA).kind == "json_schema"
    assert Grammar.json_schema(json.dumps(SCHEMA)) == Grammar.json_schema(SCHEMA)
    for bad, match in [
        (lambda: Grammar("lark", "start: ("), "Lark grammar is not usable"),
        (lambda: Grammar("regex", "[a-"), "regular expression is not usable"),
        (lambda: Grammar.json_schema({"type": "objectx"}), "JSON schema is not usable"),
        (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
        (lambda: Grammar.json_schema([1]), "must be a JSON object"),
        (lambda: Grammar("yaml", "x"), "grammar kind must be one of"),
    ]:
        with pytest.raises(InputError, match=match):
            bad()
    with pytest.raises(InputError, match="grammar must be a Grammar"):
        SamplingParams(grammar="{}")  # type: ignore[arg-type]


def test_the_constraint_masks_walks_a_draft_and_forces_what_is_fixed(tok):
    grammar = Grammar.json_schema(SCHEMA)
    c = grammar.compile(tok, len(tok), {tok.eos_token_id})
    first = c.mask()
    assert first.shape == (len(tok),) and first.sum() == 1 and tok.decode(
        first.nonzero().flatten().tolist()) == "{"
    assert tok.decode(c.forced()).startswith('{"name": "')  # the schema's fixed start
    answer = tok.encode('{"name": "Rex", "age": 7, "kind": "dog"}')
    n, masks = c.masks_along([*answer[:6], tok.encode("!")[0], *answer[6:]])
    assert n == 6 and masks.shape == (7, len(tok))  # stops at the forbidden token
    assert all(bool(masks[i, answer[i]]) for i in range(6))
    assert c.masks_along(answer)[0] == len(answer)  # left where it was
    c.accept(answer)
    assert c.done and c.mask().nonzero().flatten().tolist() == [tok.eos_token_id]
    with pytest.raises(RuntimeError, match="refused"):
        grammar.compile(tok, len(tok), {tok.eos_token_id}).accept(tok.encode("]"))


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_under_a_schema_is_constrained_plain_decoding(method, models, tok):
    target = models[0]
    grammar = Grammar.json_schema(SCHEMA)
    gen = engine(method, models, tok)
    for prompt in (tok.encode("def add(a, b):"), tok.encode("for i in range(10):")):
        want = constrained_greedy(target, grammar, tok, prompt, 40)
        res = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(grammar=grammar))
        assert res.token_ids == want, method
        grammar_drafted = res.stats.drafted_by.get("grammar", 0)
        if method == "ar":  # plain decoding stays the one-token-a-call baseline
            assert res.stats.drafted == 0
        else:  # the schema's fixed keys and quotes: drafted by the grammar, all accepted
            assert grammar_drafted >= 6, res.stats.drafted_by
        if res.finish_reason == "eos":
            record = json.loads(res.text)
            assert set(record) == {"name", "age", "kind"} and record["kind"] in ("cat", "dog")
    plain = gen.generate(tok.encode("def add(a, b):"), max_new_tokens=40)
    assert not plain.text.startswith("{")  # unconstrained, these models write no JSON


def test_unmasked_target_rows_are_caught(models, tok, monkeypatch):
    """The control: speculation whose verification reads the raw target rows drifts from
    constrained plain decoding and leaves the grammar."""
    monkeypatch.setattr(loop, "apply_masks", lambda logits, masks: logits)
    grammar = Grammar.json_schema(SCHEMA)
    prompt = tok.encode("def add(a, b):")
    want = constrained_greedy(models[0], grammar, tok, prompt, 40)
    try:
        res = engine("draft:k=4", models, tok).generate(
            prompt, max_new_tokens=40, sampling=SamplingParams(grammar=grammar))
    except RuntimeError as exc:  # the grammar itself refuses what was accepted
        assert "refused" in str(exc)
        return
    assert res.token_ids != want


class Scored(TorchBackend):
    """Records the tokens of every multi-token call (a verification: root + draft)."""

    calls: list[list[int]]

    def forward(self, tokens, *args, **kwargs):
        self.calls.append([int(t) for t in tokens.reshape(-1)])
        return super().forward(tokens, *args, **kwargs)


def test_a_deterministic_draft_spends_no_target_row_on_a_forbidden_token(models, tok):
    grammar = Grammar("regex", "[0-9]{12}")
    target = Scored(models[0])
    target.calls = []
    gen = build_generator("draft:k=4", target, tok, TorchBackend(models[1]),
                       eos_token_ids=[tok.eos_token_id])
    res = gen.generate(tok.encode("x = "), max_new_tokens=20,
                       sampling=SamplingParams(grammar=grammar))
    text = tok.decode(res.token_ids[:-1])
    assert len(text) == 12 and text.isdigit() and res.finish_reason == "eos"
    drafted = [t for call in target.calls for t in call[1:]]
    assert res.stats.drafted == len(drafted)
    assert all(tok.decode([t]).isdigit() or t == tok.eos_token_id for t in drafted)
    # unconstrained, the same draft proposes other tokens (so the cut did something)
    target.calls = []
    gen.generate(tok.encode("x = "), max_new_tokens=20)
    assert any(not tok.decode([t]).isdigit() for call in target.calls for t in call[1:])


REGEX = "(ab|ba|a|b)(a|b)"  # a handful of strings over two letters, a few token paths each
RUNS = 1500


def exact_law(model, tok, prompt: list[int], params: SamplingParams):
    """Constrained plain decoding's exact law of the whole output (token paths up to the end
    token), enumerated through the grammar: {path: probability}."""
    grammar = Grammar("regex", REGEX)
    eos = tok.eos_token_id
    law: dict[tuple[int, ...], float] = {}

    def walk(path: list[int], p: float) -> None:
        c = grammar.compile(tok, len(tok), {eos})
        c.accept(path)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + path])).logits[0, -1]
        probs = process_logits(logits.masked_fill(~c.mask(), float("-inf"))[None],
                               params)[0].double()
        for token in probs.nonzero().flatten().tolist():
            q = p * float(probs[token])
            if token == eos:
                law[(*path, eos)] = law.get((*path, eos), 0.0) + q
            else:
                walk([*path, token], q)

    walk([], 1.0)
    return law


def sampled_fit(gen, law, tok, prompt, runs: int = RUNS):
    cells = {path: i for i, path in enumerate(law)}
    counts = torch.zeros(len(cells) + 1)
    grammar = Grammar("regex", REGEX)  # checked once; each request compiles its own matcher
    for seed in range(runs):
        res = gen.generate(prompt, max_new_tokens=6, sampling=SamplingParams(
            temperature=1.0, seed=seed, grammar=grammar))
        counts[cells.get(tuple(res.token_ids), len(cells))] += 1
    exact = torch.tensor([*law.values(), 0.0])
    return fit_counts(counts, exact)


@pytest.fixture(scope="module")
def leaning(models, tok):
    """The target with a draft that ignores its context: half its mass on "a" (allowed),
    half on "x" (never allowed), a little on "b": many drafts hit a forbidden token, and
    the residual after one differs much from the target's own row."""
    from torch import nn

    draft = tiny_model(vocab=len(tok), seed=1, layers=1)
    head = nn.Linear(draft.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-10.0)
        for text, logit in (("a", 4.0), ("x", 4.0), ("b", -1.0)):
            head.bias[tok.encode(text)[0]] = logit
    draft.lm_head = head
    return models[0], draft


# the n-gram method through transformers' cache, the draft on the quicker static decoder
# (`sampling_backend`: the same weights, the same law)
@pytest.mark.parametrize(("method", "runtime"), [("draft:k=3", sampling_backend),
                                                 ("ngram:k=3", TorchBackend)],
                         ids=["draft:k=3", "ngram:k=3"])
def test_sampling_under_a_grammar_follows_constrained_plain_decoding(method, runtime, leaning,
                                                                    tok):
    prompt = tok.encode("ab ba ab ")
    law = exact_law(leaning[0], tok, prompt, SamplingParams(temperature=1.0))
    assert len(law) >= 4
    assert_exact([sampled_fit(engine(method, leaning, tok, runtime), law, tok, prompt)],
                 method)


def test_a_sampled_draft_cut_at_a_forbidden_token_is_caught(leaning, tok, monkeypatch):
    """The control: cutting a sampled draft before a forbidden token, as a deterministic
    one is cut, loses the residual its rejection would have drawn from."""
    prompt = tok.encode("ab ba ab ")
    law = exact_law(leaning[0], tok, prompt, SamplingParams(temperature=1.0))
    real = loop.Engine._constrain

    def cut_always(self, req, proposal, drafter):
        proposal, masks = real(self, req, proposal, drafter)
        allowed, _ = req.constraint.masks_along(proposal.tokens)
        return proposal.cut(allowed), masks[: allowed + 1]

    monkeypatch.setattr(loop.Engine, "_constrain", cut_always)
    assert_caught([sampled_fit(engine("draft:k=3", leaning, tok, sampling_backend), law, tok,
                               prompt, runs=2 * RUNS)])


def test_a_tree_method_refuses_a_grammar_and_an_engine_needs_a_real_tokenizer(models, tok):
    grammar = SamplingParams(grammar=Grammar.json_object())
    with pytest.raises(InputError, match="verified on chains"):
        engine("draft:tree=2x2", models, tok).generate([5, 6], sampling=grammar)
    from .conftest import CharTokenizer

    target = TorchBackend(models[0])
    with pytest.raises(InputError, match="fast\\) tokenizer"):
        build_generator("ar", target, CharTokenizer(), eos_token_ids=[0]).generate(
            [5, 6], sampling=grammar)


def test_auto_with_trees_chains_a_constrained_request(models, tok, tmp_path):
    """`auto:tree=priced` drafts trees, yet a constrained request gets chains (and its
    output is constrained plain decoding's) where a tree method refuses it (above); an
    unconstrained request of the same engine still gets trees."""
    from adaspec.draft import head_artifact

    from .test_auto import flat_profile
    from .test_head import _trained_head_drafter

    target = models[0]
    path = tmp_path / "head.pt"
    head_artifact.save(path, _trained_head_drafter(target).head,
                       torch.arange(target.config.vocab_size), {})
    gen = build_generator(f"auto:use=head,head={path},head_ms=1,k_max=4,tree=priced",
                          TorchBackend(target), tok, eos_token_ids=[tok.eos_token_id],
                          profile=flat_profile())
    trees = []
    propose = gen.drafter.propose

    def spy(req, k, controller):
        proposal = propose(req, k, controller)
        trees.append(not proposal.is_chain)
        return proposal

    gen.drafter.propose = spy
    grammar = Grammar.json_schema(SCHEMA)
    prompt = tok.encode("def add(a, b):")
    res = gen.generate(prompt, max_new_tokens=40, sampling=SamplingParams(grammar=grammar))
    assert res.token_ids == constrained_greedy(target, grammar, tok, prompt, 40)
    assert trees and not any(trees)
    trees.clear()
    for text in ("for i in range(10):", "def add(a, b):", "x = [1, 2, 3]"):
        gen.generate(tok.encode(text), max_new_tokens=30)
    assert any(trees)  # the same engine, unconstrained: trees
