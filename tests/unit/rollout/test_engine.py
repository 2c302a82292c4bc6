"""The native generation engine (rollbook.rollout.engine): exact per-token log-probs, padding,
stop/length handling, and version pinning across weight updates."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rollout.engine import (
    GenerationEngine,
    GenerationRequest,
    NativeEngine,
    reference_logprobs,
    sampling_logprobs,
)

VOCAB = 48
PROMPTS = [[1, 5, 9], [1, 7, 3, 22, 8, 30, 4], [1], [1, 40, 2, 11, 6]]  # different lengths: padding


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(seed: int = 0) -> torch.nn.Module:
    """A tiny Llama with weights wide enough that its next-token distributions are far from uniform."""
    model = build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def _requests(max_new_tokens: int = 10, **sampling) -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt_token_ids=p, max_new_tokens=max_new_tokens, request_id=f"r{i}", **sampling)
        for i, p in enumerate(PROMPTS)
    ]


def _reference(model, result, temperature=1.0, top_p=1.0, top_k=0) -> list[float]:
    return reference_logprobs(model, result.prompt_token_ids, result.output_token_ids, temperature, top_p, top_k)


def _assert_agree(recorded: list[float], expected: list[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(recorded, expected, strict=True)]
    assert max(diffs) <= 1e-4 and sum(diffs) / len(diffs) <= 1e-5, (max(diffs), sum(diffs) / len(diffs))


def _mixed_reference(old, new, prompt, output, split, temperature):
    """Log-probs of what a keep-the-cache engine samples from when ``new`` replaces ``old`` before step
    ``split``: old weights up to token ``split - 1``; from then on ``new`` weights over the suffix,
    attending to the old weights' keys/values of the prefix. One plain forward per model."""
    if len(output) <= split:  # stopped before the update
        return reference_logprobs(old, prompt, output, temperature, 1.0, 0)
    ones = torch.ones(1, dtype=torch.float32)
    with torch.inference_mode():
        old_out = old(input_ids=torch.tensor([prompt + output[: split - 1]]), use_cache=True)
        new_logits = new(input_ids=torch.tensor([output[split - 1 : -1]]), cache=old_out.cache).logits[0]
    logits = torch.cat([old_out.logits[0, len(prompt) - 1 :], new_logits])
    logp = sampling_logprobs(logits, ones * temperature, ones, torch.zeros(1, dtype=torch.long))
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


# -- the sampling distribution ---------------------------------------------------------------------


def _hand_logprobs(probs, temperature=1.0, top_p=1.0, top_k=0):
    logits = torch.tensor([probs]).log()
    return sampling_logprobs(logits, torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([top_k]))[0].exp().tolist()


def test_sampling_distribution_by_hand():
    probs = [0.5, 0.3, 0.15, 0.05]
    # no truncation: the model's own distribution
    assert _hand_logprobs(probs) == pytest.approx(probs, abs=1e-6)
    # top-p 0.8: mass before "0.3" is 0.5 < 0.8 (kept), before "0.15" is 0.8 (dropped) -> 0.5/0.8, 0.3/0.8
    assert _hand_logprobs(probs, top_p=0.8) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)
    # top-k 3 then top-p 0.9 on the renormalized [0.5, 0.3, 0.15]/0.95: masses before are 0, .526, .842
    expected = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    assert _hand_logprobs(probs, top_p=0.9, top_k=3) == pytest.approx(expected, abs=1e-6)
    # temperature 0.5 squares the probabilities: [.25, .09, .0225, .0025] / .365
    assert _hand_logprobs(probs, temperature=0.5) == pytest.approx([p * p / 0.365 for p in probs], abs=1e-6)
    # top_p below the top token's mass keeps the top token alone
    assert _hand_logprobs(probs, top_p=0.1) == pytest.approx([1, 0, 0, 0], abs=1e-6)
    # temperature 0 records the temperature-1 distribution
    assert _hand_logprobs(probs, temperature=0.0, top_k=2) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)


# -- sampler / trainer agreement -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_logprobs_match_a_full_forward_pass(temperature, top_p):
    model = _model()
    engine = NativeEngine(model, seed=1)
    results = engine.generate(_requests(temperature=temperature, top_p=top_p, top_k=0, stop_token_ids=[3, 17]))
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]
    recorded, expected = [], []
    for result in results:
        recorded += result.output_logprobs
        expected += _reference(model, result, temperature, top_p, 0)
        assert all(lp <= 0 and math.isfinite(lp) for lp in result.output_logprobs)
        assert result.output_versions == [0] * len(result.output_token_ids)
    _assert_agree(recorded, expected)


def test_top_k_logprobs_match_a_full_forward_pass():
    model = _model()
    results = NativeEngine(model, seed=2).generate(_requests(temperature=0.7, top_p=0.9, top_k=5))
    for result in results:
        _assert_agree(result.output_logprobs, _reference(model, result, 0.7, 0.9, 5))


def test_padding_does_not_change_results():
    model = _model()
    engine = NativeEngine(model)
    batched = engine.generate(_requests(temperature=0.0))
    alone = [engine.generate([request])[0] for request in _requests(temperature=0.0)]
    for b, a in zip(batched, alone, strict=True):
        assert b.output_token_ids == a.output_token_ids
        _assert_agree(b.output_logprobs, a.output_logprobs)
        _assert_agree(b.output_logprobs, _reference(model, b))


def test_mixed_sampling_params_in_one_batch_each_use_their_own():
    model = _model()
    params = [(1.0, 1.0, 0), (0.7, 0.8, 0), (0.0, 1.0, 0), (0.5, 1.0, 4)]
    requests = [
        GenerationRequest(prompt_token_ids=p, max_new_tokens=8, temperature=t, top_p=tp, top_k=k)
        for p, (t, tp, k) in zip(PROMPTS, params)
    ]
    for result, (t, tp, k) in zip(NativeEngine(model).generate(requests), params, strict=True):
        assert (result.temperature, result.top_p, result.top_k) == (t, tp, k)
        _assert_agree(result.output_logprobs, _reference(model, result, t, tp, k))


def test_kv_cache_and_no_cache_engines_sample_the_same_tokens():
    model = _model()
    cached = NativeEngine(model, seed=3).generate(_requests(max_new_tokens=12))
    uncached = NativeEngine(model, seed=3, use_kv_cache=False).generate(_requests(max_new_tokens=12))
    for c, u in zip(cached, uncached, strict=True):
        assert c.output_token_ids == u.output_token_ids
        _assert_agree(c.output_logprobs, u.output_logprobs)


def test_decode_steps_feed_one_token_per_sequence():
    model = _model()
    widths = []
    model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True)
    NativeEngine(model).generate(_requests(max_new_tokens=5))
    assert widths == [(4, 7)] + [(4, 1)] * 4


# -- stop tokens and lengths -----------------------------------------------------------------------


def test_stop_token_ends_the_output_and_is_recorded():
    model = _model()
    free = NativeEngine(model).generate(_requests(temperature=0.0, max_new_tokens=10))
    stop = free[1].output_token_ids[4]
    stopped = NativeEngine(model).generate(_requests(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop]))
    for f, s in zip(free, stopped, strict=True):
        if stop in f.output_token_ids:
            end = f.output_token_ids.index(stop) + 1
            assert (s.output_token_ids, s.finish_reason) == (f.output_token_ids[:end], "stop")
            _assert_agree(s.output_logprobs, f.output_logprobs[:end])
        else:
            assert (s.output_token_ids, s.finish_reason) == (f.output_token_ids, "length")
        assert len(s.output_logprobs) == len(s.output_versions) == len(s.output_token_ids)


def test_each_request_gets_its_own_max_new_tokens():
    requests = [GenerationRequest(prompt_token_ids=p, max_new_tokens=n) for p, n in zip(PROMPTS, [1, 6, 3, 9])]
    results = NativeEngine(_model()).generate(requests)
    assert [len(r.output_token_ids) for r in results] == [1, 6, 3, 9]
    assert {r.finish_reason for r in results} == {"length"}


def test_batches_larger_than_max_batch_size_keep_request_order():
    requests = _requests(max_new_tokens=3) * 3
    results = NativeEngine(_model(), max_batch_size=2).generate(requests)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    assert [r.prompt_token_ids for r in results] == [list(r.prompt_token_ids) for r in requests]


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_new_tokens=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(prompt_token_ids=[]),
    ],
)
def test_invalid_requests_are_value_errors(bad):
    with pytest.raises(ValueError):
        GenerationRequest(**{"prompt_token_ids": [1, 2], "max_new_tokens": 4, **bad})


def test_out_of_vocabulary_prompt_is_a_value_error():
    with pytest.raises(ValueError, match="outside"):
        NativeEngine(_model()).generate([GenerationRequest(prompt_token_ids=[1, VOCAB], max_new_tokens=2)])


# -- versions and weight updates ---------------------------------------------------------------


def test_native_engine_is_a_generation_engine():
    assert isinstance(NativeEngine(_model()), GenerationEngine)


def test_update_mid_generation_splits_versions_and_keeps_the_old_cache():
    old, new, split = _model(0), _model(1), 3
    engine = NativeEngine(_model(0), version=4)
    engine.schedule_weight_update(new.state_dict(), version=5, at_step=split)
    results = engine.generate(_requests(max_new_tokens=8, temperature=0.7, stop_token_ids=[3]))
    assert engine.version == 5
    for result in results:
        n = len(result.output_token_ids)
        assert result.output_versions == [4] * min(n, split) + [5] * (n - split)
        prompt, output = result.prompt_token_ids, result.output_token_ids
        _assert_agree(result.output_logprobs, _mixed_reference(old, new, prompt, output, split, 0.7))
        _assert_agree(result.output_logprobs[:split], reference_logprobs(old, prompt, output, 0.7, 1.0, 0)[:split])
    # The recorded values after the split are NOT the new weights' full forward (the cache is old):
    long = max(results, key=lambda r: len(r.output_token_ids))
    full_new = _reference(new, long, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(long.output_logprobs[split:], full_new[split:])) > 1e-3


def test_update_with_cache_refresh_matches_the_new_weights_full_forward():
    old, new, split = _model(0), _model(1), 3
    engine = NativeEngine(_model(0), refresh_cache_on_update=True)
    engine.schedule_weight_update(new.state_dict(), version=1, at_step=split)
    for result in engine.generate(_requests(max_new_tokens=8, temperature=0.7)):
        prompt, output = result.prompt_token_ids, result.output_token_ids
        assert result.output_versions == [0] * split + [1] * (8 - split)
        _assert_agree(result.output_logprobs[:split], reference_logprobs(old, prompt, output, 0.7, 1.0, 0)[:split])
        _assert_agree(result.output_logprobs[split:], reference_logprobs(new, prompt, output, 0.7, 1.0, 0)[split:])


def test_update_scheduled_past_the_end_is_applied_when_generate_returns():
    engine = NativeEngine(_model(0))
    engine.schedule_weight_update(_model(1).state_dict(), version=1, at_step=50)
    results = engine.generate(_requests(max_new_tokens=4))
    assert all(r.output_versions == [0] * 4 for r in results)
    assert engine.version == 1


def test_an_immediate_update_never_lets_an_older_scheduled_one_land_after_it():
    engine, loaded = NativeEngine(_model(0)), []
    engine.schedule_weight_update(lambda model: loaded.append(1), version=1, at_step=2)
    engine.update_weights(lambda model: loaded.append(2), version=2)
    assert (loaded, engine.version) == ([1, 2], 2)
    assert all(r.output_versions == [2] * 3 for r in engine.generate(_requests(max_new_tokens=3)))


def test_update_weights_accepts_a_callable_and_requires_increasing_versions():
    engine, new = NativeEngine(_model(0), version=2), _model(1)
    engine.update_weights(lambda model: new.state_dict(), version=3)
    engine.update_weights(lambda model: None, version=4)  # loads nothing itself: just a version bump
    assert engine.version == 4
    result = engine.generate(_requests(max_new_tokens=4, temperature=0.0))[0]
    _assert_agree(result.output_logprobs, _reference(new, result))
    with pytest.raises(ValueError, match="must increase"):
        engine.update_weights(new.state_dict(), version=4)


def test_a_state_dict_that_does_not_fit_is_refused_before_touching_the_model():
    engine = NativeEngine(_model(0))
    state = _model(1).state_dict()
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        engine.update_weights(state, version=1)
    assert engine.version == 0 and engine.admitting


def _failing_load(model):
    raise OSError("weight stream closed")


def test_a_failed_update_is_raised_and_blocks_generation_until_an_update_succeeds():
    engine = NativeEngine(_model(0))
    with pytest.raises(RuntimeError, match="version 1 failed") as failure:
        engine.update_weights(_failing_load, version=1)
    assert isinstance(failure.value.__cause__, OSError) and engine.version == 0
    with pytest.raises(RuntimeError, match="weights are unknown"):
        engine.generate(_requests(max_new_tokens=2))
    new = _model(1)
    engine.update_weights(new.state_dict(), version=1)  # a retry of the same version heals it
    result = engine.generate(_requests(max_new_tokens=3))[0]
    assert result.output_versions == [1, 1, 1]
    _assert_agree(result.output_logprobs, _reference(new, result))


def test_a_failed_update_mid_generation_fails_the_batch_instead_of_mislabelling_tokens():
    engine = NativeEngine(_model(0))
    engine.schedule_weight_update(_failing_load, version=1, at_step=2)
    with pytest.raises(RuntimeError, match="weights are unknown"):
        engine.generate(_requests(max_new_tokens=5))


class _StepGate:
    """Holds the model's forward pass number ``at`` until released (a real model, a real thread)."""

    def __init__(self, model: torch.nn.Module, at: int) -> None:
        self.reached, self.release, self._calls, self._at = threading.Event(), threading.Event(), 0, at
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self._calls == self._at:
            self.reached.set()
            assert self.release.wait(timeout=30)
        self._calls += 1


def _wait_until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_update_from_another_thread_lands_between_steps_and_loses_nothing():
    model, new = _model(0), _model(1)
    engine, gate = NativeEngine(model), _StepGate(model, at=2)
    results: dict[str, list] = {}
    first = threading.Thread(target=lambda: results.setdefault("first", engine.generate(_requests(max_new_tokens=8))))
    first.start()
    assert gate.reached.wait(timeout=30)  # step 2 is running under version 0
    updater = threading.Thread(target=engine.update_weights, args=(new.state_dict(), 1))
    updater.start()
    _wait_until(lambda: not engine.admitting)  # the update is queued: admission stops
    late = threading.Thread(target=lambda: results.setdefault("late", engine.generate(_requests(max_new_tokens=4))))
    late.start()
    gate.release.set()
    for thread in (first, updater, late):
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert [r.request_id for r in results["first"]] == ["r0", "r1", "r2", "r3"]
    for result in results["first"]:  # steps 0-2 ran before the boundary, 3-7 after
        assert result.output_versions == [0] * 3 + [1] * 5
    for result in results["late"]:  # admitted only once the update was in
        assert result.output_versions == [1] * 4
        _assert_agree(result.output_logprobs, _reference(new, result))


def test_pause_holds_new_work_until_resume():
    engine = NativeEngine(_model())
    engine.pause()
    assert not engine.admitting
    results = []
    waiting = threading.Thread(target=lambda: results.extend(engine.generate(_requests(max_new_tokens=2))))
    waiting.start()
    waiting.join(timeout=0.3)
    assert waiting.is_alive() and not results
    engine.update_weights(_model(1).state_dict(), version=1)  # nothing in flight: applies at once
    engine.resume()
    waiting.join(timeout=30)
    assert len(results) == 4 and all(r.output_versions == [1, 1] for r in results)


def test_a_seeded_call_draws_the_same_samples_and_leaves_the_engine_stream_alone():
    model = _model()
    seeded = NativeEngine(model, version=0, seed=7)
    first = [r.output_token_ids for r in seeded.generate(_requests(), seed=1234)]
    again = [r.output_token_ids for r in seeded.generate(_requests(), seed=1234)]
    other = [r.output_token_ids for r in seeded.generate(_requests(), seed=99)]
    assert first == again  # common random numbers: same weights, same seed, same samples
    assert first != other
    # the engine's own stream is where it would be without the seeded calls
    plain = NativeEngine(model, version=0, seed=7)
    assert [r.output_token_ids for r in seeded.generate(_requests())] == [r.output_token_ids for r in plain.generate(_requests())]
