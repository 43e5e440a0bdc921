"""Sampler and StopMatcher on literal logits: each knob does what it says; the batched
sampler draws from exactly the distribution the parameters define, reproducibly per seed
whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest

from dynalm.errors import InvalidRequest, NonFiniteLogits
from dynalm.runtime.engine.sampling import (
    Sampler,
    SamplingParams,
    StopMatcher,
    device_greedy,
    sample_rows,
)

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, -1.0, 2.9], np.float32)
OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
FREE = dict(top_k=0, top_p=1.0, min_p=0.0)  # no truncation; penalties as given


def draws(params: SamplingParams, n: int = 400, history: tuple[int, ...] = ()) -> set[int]:
    sampler = Sampler(params)
    return {sampler.sample(LOGITS, history) for _ in range(n)}


def test_greedy_is_argmax():
    assert draws(SamplingParams(temperature=0, **OFF)) == {1}


def test_argmax_only_is_greedy_with_nothing_changing_the_logits():
    """What the device may pick (``Executor.run(greedy=True)``): greedy, no penalty, no
    bias; a token the device marks -1 (a NaN or infinite max) is refused as on the host."""
    assert Sampler(SamplingParams(temperature=0, **OFF)).argmax_only
    assert not Sampler(SamplingParams(temperature=0.7, **OFF)).argmax_only
    for changed in ({"repeat_penalty": 1.1}, {"presence_penalty": 0.5},
                    {"frequency_penalty": 0.5}, {"logit_bias": {3: 2.0}}):  # fmt: skip
        params = SamplingParams(temperature=0, **{**OFF, **changed})
        assert not Sampler(params).argmax_only, changed
    assert device_greedy(np.array([4, 0])).tolist() == [4, 0]
    with pytest.raises(NonFiniteLogits, match="not finite"):
        device_greedy(np.array([4, -1]))


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


def penalized(params: SamplingParams, history: list[int]) -> np.ndarray:
    row = LOGITS.copy()
    Sampler(params).penalize(row, history)
    return row


def test_repeat_penalty_divides_positive_logits_of_recent_tokens():
    params = SamplingParams(temperature=0, **{**OFF, "repeat_penalty": 2.0})
    out = penalized(params, [1, 4])
    assert out[1] == pytest.approx(1.5) and out[4] == pytest.approx(-2.0)
    assert Sampler(params).sample(LOGITS, history=[1]) == 5


def test_presence_and_frequency_penalties():
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, **OFF)
    out = penalized(params, [2, 2, 3])
    assert out[2] == pytest.approx(2.0 - 0.5 - 0.5)
    assert out[3] == pytest.approx(0.5 - 0.5 - 0.25)
    assert out[1] == pytest.approx(3.0)


def test_presence_and_frequency_penalties_skip_the_prompt_but_repeat_penalty_does_not():
    params = SamplingParams(temperature=0, presence_penalty=1, frequency_penalty=1, **OFF)
    row = LOGITS.copy()
    Sampler(params).penalize(row, [2, 2, 3], n_prompt=2)  # only token 3 was generated
    assert row[2] == LOGITS[2] and row[3] == pytest.approx(LOGITS[3] - 2)
    row = LOGITS.copy()
    Sampler(SamplingParams(temperature=0, **{**OFF, "repeat_penalty": 2.0})).penalize(
        row, [1, 4], n_prompt=2
    )
    assert row[1] == pytest.approx(LOGITS[1] / 2)


def test_penalties_touch_only_the_history_and_sample_leaves_its_input():
    out = penalized(SamplingParams(repeat_penalty=1.3, presence_penalty=1, **FREE), [1, 4])
    untouched = np.ones(LOGITS.size, bool)
    untouched[[1, 4]] = False
    assert np.array_equal(out[untouched], LOGITS[untouched])
    row = LOGITS.copy()
    Sampler(SamplingParams(repeat_penalty=2.0, logit_bias={0: 5.0}, **FREE)).sample(row, [1])
    assert np.array_equal(row, LOGITS)


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
        dict(temperature=float("inf")),
        dict(top_p=float("nan")),
        dict(repeat_penalty=float("inf")),
        dict(seed=-1),
        dict(seed=2**64),
        dict(logit_bias={3: float("inf")}),
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


# ---------------------------------------------------------------- the batched sampler

V = 1000  # not a multiple of the draw's 256-token blocks: the last block is ragged


def reference_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """What the parameters define, computed the plain way: a full stable sort in float64,
    top-k, softmax at the temperature, the top-p prefix, min-p relative to the best."""
    z = logits.astype(np.float64)
    order = np.argsort(-z, kind="stable")
    if 0 < params.top_k < z.size:
        order = order[: params.top_k]
    p = np.exp((z[order] - z[order[0]]) / params.temperature)
    p /= p.sum()
    keep = p.size
    if params.top_p < 1:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), params.top_p)) + 1)
    if params.min_p > 0:
        keep = min(keep, max(1, int(np.count_nonzero(p >= params.min_p * p[0]))))
    out = np.zeros(z.size)
    out[order[:keep]] = p[:keep] / p[:keep].sum()
    return out


def chi_square_bound(df: int) -> float:
    """The chi-square statistic a correct sampler exceeds with probability 1e-4
    (Wilson-Hilferty), so the test fails on a wrong distribution, not on bad luck."""
    z = 3.719  # the normal quantile of 1 - 1e-4
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def sampled_counts(logits: np.ndarray, params: SamplingParams, n: int) -> np.ndarray:
    """``n`` draws through `sample_rows`, 200 rows a call (one sampler, so one stream)."""
    sampler = Sampler(params)
    rows = np.repeat(logits[None], 200, axis=0)
    counts = np.zeros(logits.size)
    for _ in range(n // 200):
        np.add.at(counts, sample_rows([sampler] * 200, rows), 1)
    return counts


PEAKED = np.random.default_rng(1).standard_normal(V).astype(np.float32) * 3
FLAT = np.random.default_rng(2).standard_normal(V).astype(np.float32) * 0.3


@pytest.mark.slow  # many draws
@pytest.mark.parametrize(
    ("logits", "params"),
    [
        (PEAKED, SamplingParams(temperature=1.0, **OFF)),  # the OpenAI defaults: no cut
        (PEAKED, SamplingParams(temperature=0.7, **{**OFF, "top_k": 40})),
        (PEAKED, SamplingParams(temperature=1.0, **{**OFF, "top_p": 0.9})),
        # a nucleus of ~850 tokens: the partial selection widens from 64 candidates
        (FLAT, SamplingParams(temperature=1.0, **{**OFF, "top_p": 0.9})),
        (PEAKED, SamplingParams(temperature=1.3, **{**OFF, "min_p": 0.05})),
        (PEAKED, SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)),
    ],
    ids=["softmax", "top_k", "top_p", "top_p_wide", "min_p", "all_cuts"],
)
def test_draws_follow_the_defined_distribution(logits: np.ndarray, params: SamplingParams):
    n = 40_000
    expected = reference_distribution(logits, params) * n
    counts = sampled_counts(logits, params, n)
    assert counts[expected == 0].sum() == 0, "drew a token the parameters exclude"
    big = expected >= 5  # chi-square needs expected counts >= 5: pool the rest
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    assert statistic < chi_square_bound(len(wanted) - 1), statistic


def test_a_seeded_sequence_draws_the_same_whatever_its_batch():
    """Each draw takes one number from the sequence's own stream: a seeded request gets
    the same tokens alone and batched with greedy, truncated and unseeded ones."""
    rows = np.random.default_rng(3).standard_normal((6, V)).astype(np.float32) * 2

    def seeded() -> list[Sampler]:
        return [
            Sampler(SamplingParams(temperature=1.0, seed=11, **OFF)),
            Sampler(SamplingParams(temperature=0.8, top_k=0, top_p=0.9, seed=12)),
        ]

    alone = [[int(sample_rows([s], rows[i : i + 1])[0]) for i in range(6)] for s in seeded()]
    others = [
        Sampler(SamplingParams(temperature=0, **OFF)),
        Sampler(SamplingParams(temperature=1.0, **OFF)),
        Sampler(SamplingParams(temperature=0.5, top_k=5, top_p=1.0, repeat_penalty=1.0)),
    ]
    first, second = seeded()
    batched: list[list[int]] = [[], []]
    for i in range(6):
        batch = [others[0], first, others[1], second, others[2]]
        tokens = sample_rows(batch, np.repeat(rows[i : i + 1], len(batch), axis=0))
        batched[0].append(int(tokens[1]))
        batched[1].append(int(tokens[3]))
    assert batched == alone


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0), dict(top_k=3)])
def test_nan_logits_are_a_clear_error(params: dict):
    row = LOGITS.copy()
    row[2] = np.nan
    with pytest.raises(NonFiniteLogits, match="not finite"):
        Sampler(SamplingParams(**{**OFF, "temperature": 1.0, **params})).sample(row)


def test_a_vanishing_temperature_samples_greedily():
    # 5e-324 is 0 in float32: dividing by it would turn the logits into inf and NaN
    for temperature in (5e-324, 1e-6):
        assert draws(SamplingParams(temperature=temperature, **OFF), n=20) == {1}
