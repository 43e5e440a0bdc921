"""Sampler and StopMatcher on literal logits: each knob does what it says."""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.errors import InvalidRequest
from dynalm.runtime.sampling import Sampler, SamplingParams, StopMatcher

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0, 2.9], np.float32)
OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def draws(params: SamplingParams, n: int = 400, history: tuple[int, ...] = ()) -> set[int]:
    sampler = Sampler(params)
    return {sampler.sample(LOGITS, history) for _ in range(n)}


def test_greedy_is_argmax():
    assert draws(SamplingParams(temperature=0, **OFF)) == {1}


def test_top_k_keeps_the_k_best():
    assert draws(SamplingParams(temperature=1.0, **{**OFF, "top_k": 2})) == {1, 5}


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities at T=1: token 1 ~0.36, token 5 ~0.33, token 2 ~0.13 ...
    assert draws(SamplingParams(temperature=1.0, **{**OFF, "top_p": 0.6})) == {1, 5}


def test_min_p_drops_tokens_far_below_the_best():
    assert draws(SamplingParams(temperature=1.0, **{**OFF, "min_p": 0.5})) == {1, 5}


def test_high_temperature_reaches_every_token():
    assert draws(SamplingParams(temperature=5.0, **OFF), n=3000) == set(range(len(LOGITS)))


def test_same_seed_same_tokens_and_other_seed_differs():
    def sequence(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=2.0, seed=seed, **OFF))
        return [sampler.sample(LOGITS) for _ in range(50)]

    assert sequence(42) == sequence(42)
    assert sequence(42) != sequence(43)


def test_repeat_penalty_divides_positive_logits_of_recent_tokens():
    sampler = Sampler(SamplingParams(temperature=0, **{**OFF, "repeat_penalty": 2.0}))
    out = sampler.apply_penalties(LOGITS, history=[1, 4])
    assert out[1] == pytest.approx(1.5) and out[4] == pytest.approx(-2.0)
    assert sampler.sample(LOGITS, history=[1]) == 5


def test_presence_and_frequency_penalties():
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, **OFF)
    out = Sampler(params).apply_penalties(LOGITS, history=[2, 2, 3])
    assert out[2] == pytest.approx(2.0 - 0.5 - 0.5)
    assert out[3] == pytest.approx(0.5 - 0.5 - 0.25)
    assert out[1] == pytest.approx(3.0)


def test_no_penalty_no_copy_and_sampling_still_works_from_float32():
    # A plain greedy step passes the step's float32 logits through untouched (no copy).
    sampler = Sampler(SamplingParams(temperature=0, **OFF))
    assert sampler.apply_penalties(LOGITS, history=[1, 4]) is LOGITS
    assert 1 in draws(SamplingParams(temperature=0.7, seed=1, **OFF)) <= set(range(len(LOGITS)))


def test_logit_bias():
    assert draws(SamplingParams(temperature=0, logit_bias={4: 10.0}, **OFF)) == {4}


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(max_tokens=-1),
        dict(repeat_penalty=0),
        dict(presence_penalty=3),
        dict(stop=[""]),
    ],
)
def test_invalid_parameters_are_refused_by_name(bad: dict):
    with pytest.raises(InvalidRequest, match=next(iter(bad)).split("_")[0]):
        SamplingParams(**bad).validate()


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_it():
    m = StopMatcher(["</end>"])
    assert m.push("hello </") == ("hello ", False)
    assert m.push("e") == ("", False)
    assert m.push("nd> tail") == ("", True)


def test_stop_matcher_releases_text_that_turned_out_not_to_stop():
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ATE") == ("STATE", False)
    assert m.push("S") == ("", False)
    assert m.flush() == "S"


def test_stop_matcher_earliest_of_several():
    m = StopMatcher(["b", "xyz"])
    assert m.push("axyzb") == ("a", True)
