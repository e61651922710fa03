"""DISCO on the draft head (issue 66, part 1): the head's drafts recorded per position from
its features (no model call), the simulation and the classifier's rows reading them by
position, and `head:ctrl=disco` exact and paired with the head it learned."""

from __future__ import annotations

import pytest
import torch

from adaspec.control.disco_features import FeatureSpec
from adaspec.lab.disco.dataset import Sample, rows
from adaspec.lab.disco.head_data import collect_head, head_sample
from adaspec.lab.disco.simulate import Costs, simulate
from adaspec.lab.head import data as head_data
from adaspec.lab.head import train as head_train

from .conftest import tiny_model
from .test_head import _trained_head_drafter, assert_exact_and_drafting

SPEC = FeatureSpec()


def _greedy_rows(model, n: int, prompt: int, answer: int, seed: int) -> list[dict]:
    """Recorded rows of the tiny target's own greedy answers to random prompts, as
    `head_data.collect` writes them."""
    g = torch.Generator().manual_seed(seed)
    tap = head_data.FeatureTap(model, ())
    out = []
    try:
        for i in range(n):
            ids = torch.randint(3, model.config.vocab_size, (prompt,), generator=g)
            with torch.no_grad():
                for _ in range(answer):
                    ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax()[None]])
                logits = model(ids[None]).logits[0].float()
            top_p, top_i = torch.softmax(logits, -1).topk(4, -1)
            out.append({"id": f"tiny/{i}", "tokens": ids.to(torch.int32), "prompt_len": prompt,
                        "final": tap.outputs["final"][0].clone(), "top_ids": top_i.to(
                            torch.int32), "top_probs": top_p})
    finally:
        tap.close()
    return out


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model(vocab=40, hidden=32, seed=3)
    drafter = _trained_head_drafter(model)
    frozen = head_train.frozen_parts(model, torch.arange(40))
    return model, drafter, frozen


def test_a_heads_sample_counts_the_hits_its_training_agreement_counts(tiny):
    """On the target's own greedy answers the first position's hits are the unrolled
    agreement `row_agreement` counts (prompt hidden as the default runtime hides it); deeper
    ones leave out the chains that would have begun inside the prompt."""
    model, drafter, frozen = tiny
    cfg = head_train.TrainConfig(depth=3)
    for row in _greedy_rows(model, 3, prompt=5, answer=14, seed=7):
        s = head_sample(drafter.head, frozen, row, 3, "final", "val")
        assert s is not None and s.hits.shape == (14, 3) and s.dist.shape == (14, 3, 11)
        inside = dict(row, top_probs=row["top_probs"].clone())
        inside["top_probs"][-1] = 0  # the token after the text: not a token of the answer
        want = head_train.row_agreement(drafter.head, frozen, inside, cfg, 3,
                                        visible_from=row["prompt_len"] - 1)
        got = [int(s.hits[:, d].sum()) for d in range(3)]
        assert got[0] == want[0][0] and got[1] <= want[1][0] and got[2] <= want[2][0]
        for d in range(3):  # token i at position d: a chain began after token i - d - 1
            assert not s.hits[: d + 1, d].any()
        assert s.hits[:, 1:].any()


def test_a_chain_through_a_token_the_target_would_not_write_is_a_miss(tiny):
    """Negative control: where the text leaves the target's greedy path (a person's answer),
    the unrolled pass fed a token no real chain feeds; positions past it are misses even
    where the head's top token is the target's."""
    model, drafter, frozen = tiny
    row = _greedy_rows(model, 1, prompt=5, answer=14, seed=8)[0]
    clean = head_sample(drafter.head, frozen, row, 3, "final", "val")
    off = dict(row)
    tokens = row["tokens"].clone()
    tokens[10] = (int(tokens[10]) + 1) % 40  # the text leaves the target's path at 10
    off["tokens"] = tokens
    s = head_sample(drafter.head, frozen, off, 3, "final", "val")
    assert clean is not None and s is not None
    i = 10 - 5  # answer index of token 10
    assert not s.hits[i + 1, 1:].any() and not s.hits[i + 2, 2]
    assert s.hits.sum() < clean.hits.sum() + 1


def test_the_simulation_reads_hits_by_draft_position():
    costs = Costs(draft_ms=1.0, target_ms=[10.0, 11.0, 12.0, 13.0])
    flat = [True, True, False, True, True, True, False, True]
    by_position = [[h] * 3 for h in flat]
    assert simulate(flat, None, -1.0, 3, costs).to_dict() == \
        simulate(by_position, None, -1.0, 3, costs).to_dict()
    # the same tokens, but nothing right at position 2: longer drafts accept less
    shallow = [[h, h, False] for h in flat]
    assert simulate(shallow, None, -1.0, 3, costs).accepted < \
        simulate(by_position, None, -1.0, 3, costs).accepted
    with pytest.raises(Exception, match="drafts of up to 3"):
        simulate(by_position, None, -1.0, 4, costs)


def test_the_classifier_learns_from_the_positions_a_draft_reaches():
    hits = torch.tensor([[True, True], [True, False], [False, True], [True, True],
                         [True, True]])
    s = Sample("p", "tiny", "tiny", "train", [1], [0] * 5, torch.rand(5, 2, 11), hits)
    x, y, pos = rows([s], SPEC)
    # token 0 is the prefill's; token i at position 1 only after token i - 1 hit at 0
    reached = [(1, 0), (2, 0), (3, 0), (4, 0), (2, 1), (4, 1)]
    assert len(y) == len(reached)
    assert sorted(zip(x[:, -1].long().tolist(), y.tolist(), strict=True)) == sorted(
        (d, bool(hits[i, d])) for i, d in reached)
    assert sorted(pos.tolist()) == sorted(d for _, d in reached)


def _disco_artifact(model, drafter, frozen, path, head_file):
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft.head_artifact import fingerprint
    from adaspec.lab.disco.train_classifier import train_artifact
    from adaspec.lab.disco.tune import tune_artifact

    data = collect_head(drafter.head, frozen, _greedy_rows(model, 24, 5, 16, seed=9), 3,
                        val_fraction=0.4, progress=False,
                        provenance={"target": TorchBackend(model).name,
                                    "draft": fingerprint(head_file)})
    assert {s.split for s in data.samples} == {"train", "val"}
    art = train_artifact(data, data.suites, SPEC, epochs=60)
    costs = Costs(draft_ms=0.5, target_ms=[10.0, 12.0, 14.0, 16.0])
    tune_artifact(art, [s for s in data.samples if s.split == "val"], costs, 3,
                  log=lambda m: None)
    assert 1 <= art.sl_max <= 3
    art.save(path)


def test_head_ctrl_disco_decodes_what_plain_decoding_does(tmp_path, tiny):
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.methods.build import build_generator

    model, drafter, frozen = tiny
    head_file = tmp_path / "head.pt"
    head_artifact.save(head_file, drafter.head, torch.arange(40), {})
    _disco_artifact(model, drafter, frozen, tmp_path / "disco.pt", head_file)
    engine = build_generator(f"head:ctrl=disco,artifact={head_file},disco={tmp_path}/disco.pt,"
                             "threshold=0.3,sl_max=3", TorchBackend(model), None,
                             eos_token_ids=[])
    assert engine.controller.name == "disco" and engine.controller.tau == 0.3
    assert_exact_and_drafting(engine, model)


def test_head_ctrl_disco_refuses_another_heads_classifier(tmp_path, tiny):
    from adaspec.backends.torch.backend import TorchBackend
    from adaspec.draft import head_artifact
    from adaspec.errors import InputError
    from adaspec.methods.build import build_generator

    model, drafter, frozen = tiny
    head_file, other = tmp_path / "head.pt", tmp_path / "other.pt"
    head_artifact.save(head_file, drafter.head, torch.arange(40), {})
    head_artifact.save(other, drafter.head, torch.arange(40), {"another": "head"})
    _disco_artifact(model, drafter, frozen, tmp_path / "disco.pt", head_file)
    with pytest.raises(InputError, match="another head or target.*adaspec head disco"):
        build_generator(f"head:ctrl=disco,artifact={other},disco={tmp_path}/disco.pt",
                        TorchBackend(model), None, eos_token_ids=[])
    with pytest.raises(InputError, match="no DISCO classifier ships.*adaspec head disco"):
        build_generator(f"head:ctrl=disco,artifact={head_file}", TorchBackend(model), None,
                        eos_token_ids=[])
    with pytest.raises(InputError, match="ctrl=disco's settings"):
        build_generator(f"head:k=2,artifact={head_file},disco={tmp_path}/disco.pt",
                        TorchBackend(model), None, eos_token_ids=[])


def test_the_shipped_head_has_its_own_classifier_with_provenance():
    """The built-in head's DISCO classifier is of that head (its fingerprint), small, and
    says how it was made; it decides on the head's kept-token logits."""
    from adaspec.control.builtin import head_disco_file, provenance
    from adaspec.control.disco import DiscoLength
    from adaspec.draft.head_artifact import builtin_for, fingerprint
    from adaspec.store.catalog import TARGET_DEFAULT

    head, path = builtin_for(TARGET_DEFAULT), head_disco_file(TARGET_DEFAULT)
    assert head is not None and path.is_file() and path.stat().st_size < 1_000_000
    controller = DiscoLength.from_file(str(path))
    controller.check_models(TARGET_DEFAULT, fingerprint(head))
    record = provenance(path)
    assert any("adaspec head disco" in c for c in record["commands"])
    assert len(record["data_manifest_sha256"]) == 64 and record["date"] and record["machine"]
    sure, flat = torch.full((8192,), -30.0), torch.zeros(8192)
    sure[7] = 30.0
    controller.begin()
    controller.max_tokens()
    controller.keep_drafting(0, sure)
    p_sure = controller.last_probability
    controller.keep_drafting(0, flat)
    assert controller.last_probability < p_sure
