"""The router engine on tiny fp32 models: exact whatever arm it picks, the pick and its time
in the stats, one prefill, and the policy's pick really changes the drafter."""

from __future__ import annotations

import time

import pytest
import torch

from adaspec.backends.base import ForwardOutput
from adaspec.backends.torch.backend import TorchBackend
from adaspec.core.sampling import SamplingParams
from adaspec.errors import InputError
from adaspec.methods.build import build_arm_generators, build_generator
from adaspec.route.artifact import RouterArtifact, save_artifact
from adaspec.route.policy import RouterPolicy
from adaspec.route.router import RoutedGenerator
from tests.test_engine import PROMPTS, reference_greedy

ARMS = {m: m for m in ["ar", "ngram", "draft:k=4", "draft:ctrl=heuristic,k=4"]}


def fixed_policy(dim: int, n_arms: int, arm: int) -> RouterPolicy:
    """A policy whose argmax is `arm` whatever the prompt."""
    policy = RouterPolicy(dim, n_arms, hidden=8)
    with torch.no_grad():
        policy.net[-1].weight.zero_()
        policy.net[-1].bias.zero_()
        policy.net[-1].bias[arm] = 10.0
    return policy


class CountingBackend(TorchBackend):
    """Counts prefills: the router must not add one."""

    prefills = 0

    def prefill(self, tokens, hidden_layer=None, reuse=0):
        self.prefills += 1
        return super().prefill(tokens, hidden_layer, reuse)


@pytest.fixture
def arms(target, draft):
    return build_arm_generators(ARMS, target, None, draft, eos_token_ids=[])


@pytest.mark.parametrize("arm", list(ARMS))
def test_greedy_output_is_plain_decoding_whatever_the_arm(arms, target_model, arm):
    router = RoutedGenerator(arms, force=arm)
    for prompt in PROMPTS[:3]:
        res = router.generate(prompt, max_new_tokens=24)
        assert res.token_ids == reference_greedy(target_model, prompt, 24), (arm, prompt)
        assert res.stats.route == arm


@pytest.mark.parametrize("index, arm", list(enumerate(ARMS)))
def test_policy_pick_changes_the_drafter(arms, target, index, arm):
    """Fails if routing is bypassed: each pick shows in how the request was decoded."""
    router = RoutedGenerator(arms, fixed_policy(target.hidden_size, len(ARMS), index))
    res = router.generate(PROMPTS[2], max_new_tokens=24)
    alone = arms[arm].generate(PROMPTS[2], max_new_tokens=24)
    s = res.stats
    assert s.route == arm
    assert (s.drafted, s.accepted, s.target_calls, s.draft_calls, s.steps) == (
        alone.stats.drafted,
        alone.stats.accepted,
        alone.stats.target_calls,
        alone.stats.draft_calls,
        alone.stats.steps,
    )
    kinds = {"ar": s.drafted == 0, "ngram": s.drafted > 0 and s.draft_calls == 0}
    assert kinds.get(arm, s.draft_calls > 0)


def final_state(model, prompt: list[int]) -> torch.Tensor:
    """The target's true final (normed) hidden state of the prompt's last token."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0, -1].float()


def separating_policy(a: torch.Tensor, b: torch.Tensor, n_arms: int, arm_a: int, arm_b: int):
    """A policy whose argmax is `arm_a` for state `a` and `arm_b` for state `b`: its first
    unit reads where the state lies along a - b, and the output layer turns that sign into
    the arm."""
    policy = RouterPolicy(a.numel(), n_arms, hidden=8)
    w = a - b
    with torch.no_grad():
        for p in policy.net.parameters():
            p.zero_()
        policy.net[0].weight[0] = 4 * w / w.dot(w)
        policy.net[0].bias[0] = -4 * w.dot((a + b) / 2) / w.dot(w)
        policy.net[2].weight[0, 0] = 3.0
        policy.net[4].weight[arm_a, 0] = 10.0
        policy.net[4].weight[arm_b, 0] = -10.0
    return policy


def test_the_pick_follows_the_prompts_final_hidden_state(arms, target, target_model):
    """Two prompts ending in the same token (equal embeddings, different final states): a
    policy that separates their final states sends them to different arms. Reading any other
    layer (the embeddings at layer 0 are equal for both) would give the wrong state."""
    prompts = [[5, 9, 13, 2], [17, 3, 40, 2]]
    states = [final_state(target_model, p) for p in prompts]
    names = list(ARMS)
    policy = separating_policy(*states, len(ARMS), arm_a=1, arm_b=2)
    expected = [names[policy.choose(s)] for s in states]
    assert expected == ["ngram", "draft:k=4"]  # the policy does separate the true states
    router = RoutedGenerator(arms, policy)
    results, seen = [], []
    for prompt in prompts:
        results.append(router.generate(prompt, max_new_tokens=12))
        seen.append(router.last_state)
    assert [r.stats.route for r in results] == expected
    for prompt, res, state, got in zip(prompts, results, states, seen, strict=True):
        torch.testing.assert_close(got, state, atol=1e-5, rtol=1e-5)
        assert res.token_ids == reference_greedy(target_model, prompt, 12)


def test_decision_and_its_time_are_in_the_stats(arms, target, monkeypatch):
    """A policy that takes 0.2 s to choose: the time shows as route_time, inside the request's
    wall time, and in no other part (other_time is only the remainder, so it is not summed).
    The clock is a fake one (1 us per reading, plus the policy's 0.2 s), so nothing here
    depends on how fast the machine is."""
    policy = fixed_policy(target.hidden_size, len(ARMS), 1)
    choose = policy.choose
    pause = 0.2
    clock = [0.0]

    def fake_perf_counter() -> float:
        clock[0] += 1e-6
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", fake_perf_counter)

    def slow_choose(*args, **kwargs):
        clock[0] += pause
        return choose(*args, **kwargs)

    policy.choose = slow_choose
    router = RoutedGenerator(arms, policy)
    res = router.generate(PROMPTS[0], max_new_tokens=8)
    s = res.stats
    assert s.route == "ngram" and s.to_dict()["route"] == "ngram"
    assert pause <= s.route_time < s.wall_time
    named = s.prefill_time + s.route_time + s.draft_time + s.verify_time
    assert named <= s.wall_time  # selection time counts in the latency
    assert s.prefill_time < pause and s.other_time < pause  # and only once, as route_time
    assert router.last_state is not None and router.last_state.shape == (target.hidden_size,)


def test_one_prefill_per_request(target_model, draft):
    counting = CountingBackend(target_model, name="tiny-target")
    engines = build_arm_generators(ARMS, counting, None, draft, eos_token_ids=[])
    router = RoutedGenerator(engines, fixed_policy(counting.hidden_size, len(ARMS), 2))
    router.generate(PROMPTS[1], max_new_tokens=8)
    assert counting.prefills == 1


def test_dynamic_mode_is_seeded(arms, target):
    policy = RouterPolicy(target.hidden_size, len(ARMS), hidden=8)
    with torch.no_grad():
        policy.net[-1].weight.zero_()  # uniform over arms: picks vary between seeds
    router = RoutedGenerator(arms, policy, mode="dynamic")
    picks = [
        router.generate(PROMPTS[0], 4, SamplingParams(seed=s)).stats.route for s in range(12)
    ]
    again = [
        router.generate(PROMPTS[0], 4, SamplingParams(seed=s)).stats.route for s in range(12)
    ]
    assert picks == again and len(set(picks)) > 1


def test_sampling_through_the_router_is_seeded(arms, target):
    router = RoutedGenerator(arms, fixed_policy(target.hidden_size, len(ARMS), 2))
    sp = SamplingParams(temperature=1.0, seed=7)
    assert router.generate(PROMPTS[0], 12, sp).token_ids == router.generate(
        PROMPTS[0], 12, sp
    ).token_ids


def test_router_method_from_an_artifact(tmp_path, target, draft, target_model):
    policy = fixed_policy(target.hidden_size, len(ARMS), 2)
    path = save_artifact(RouterArtifact(ARMS, "tiny-target", 0.1, "measured", policy), tmp_path
                         / "r.pt")
    engine = build_generator(f"router:{path}", target, None, draft, eos_token_ids=[])
    res = engine.generate(PROMPTS[0], max_new_tokens=16)
    assert res.stats.route == "draft:k=4"
    assert res.token_ids == reference_greedy(target_model, PROMPTS[0], 16)
    dyn = build_generator(f"router:artifact={path},mode=dynamic,seed=3", target, None, draft, [])
    assert isinstance(dyn, RoutedGenerator) and (dyn.mode, dyn.seed) == ("dynamic", 3)


def test_artifact_for_another_target_is_refused(tmp_path, target, draft):
    policy = fixed_policy(target.hidden_size, len(ARMS), 0)
    path = save_artifact(RouterArtifact(ARMS, "other-target", 0.1, "measured", policy), tmp_path
                         / "r.pt")
    with pytest.raises(InputError, match="trained for target 'other-target'"):
        build_generator(f"router:{path}", target, None, draft, [])


def test_errors(arms, target):
    with pytest.raises(InputError, match="no policy"):
        RoutedGenerator(arms).generate(PROMPTS[0], 4)
    with pytest.raises(InputError, match="no arm named"):
        RoutedGenerator(arms, force="draft:k=9").generate(PROMPTS[0], 4)
    with pytest.raises(InputError, match="scores 2 arms"):
        RoutedGenerator(arms, RouterPolicy(target.hidden_size, 2, hidden=8))
    with pytest.raises(InputError, match="routing mode"):
        RoutedGenerator(arms, mode="best")


class NoHiddenBackend(TorchBackend):
    def forward(self, tokens, positions=None, tree_mask=None, hidden_layer=None):
        out = super().forward(tokens, positions, tree_mask, None)
        return ForwardOutput(logits=out.logits)

    def prefill(self, tokens, hidden_layer=None, reuse=0):
        return ForwardOutput(logits=super().prefill(tokens).logits)


def test_backend_without_hidden_states_is_a_clear_error(target_model):
    backend = NoHiddenBackend(target_model, name="tiny-target")
    engines = build_arm_generators({"ar": "ar", "ngram": "ngram"}, backend, None, None, [])
    router = RoutedGenerator(engines, fixed_policy(backend.hidden_size, 2, 0))
    with pytest.raises(InputError, match="no hidden state"):
        router.generate(PROMPTS[0], 4)


def test_all_arms_must_accept_the_sampling_settings(target, draft):
    engines = build_arm_generators(
        {"ar": "ar", "greedy-only": "draft:k=2,verify=greedy"}, target, None, draft, []
    )
    router = RoutedGenerator(engines, fixed_policy(target.hidden_size, 2, 0))
    with pytest.raises(InputError, match="greedy verifier"):
        router.generate(PROMPTS[0], 4, SamplingParams(temperature=1.0))


def test_routers_built_per_request_draw_on_from_the_methods_generator(arms, target):
    """A server builds every request a router of its own that learns with the method's
    (`learn_with`): an unseeded dynamic pick draws on from where the last request left the
    method's generator. Without the sharing every fresh router would draw its first pick
    from the same seed, so a uniform policy would pick one arm for every request."""
    uniform = fixed_policy(target.hidden_size, len(ARMS), 0)
    with torch.no_grad():
        uniform.net[-1].bias.zero_()
    method = RoutedGenerator(arms, uniform, mode="dynamic", seed=3)
    picks = set()
    for _ in range(12):
        request = RoutedGenerator(arms, uniform, mode="dynamic", seed=3)
        request.learn_with(method)
        picks.add(request.generate(PROMPTS[0], max_new_tokens=1).stats.route)
    assert len(picks) > 1
    alone = {RoutedGenerator(arms, uniform, mode="dynamic", seed=3)
             .generate(PROMPTS[0], max_new_tokens=1).stats.route for _ in range(4)}
    assert len(alone) == 1  # the control: fresh routers apart repeat the seed's pick
