"""The native generation engine (rollbook.rollout.engine): exact per-token log-probs, continuous
batching (a request that joins mid-decode draws what it draws alone), stop/length handling, version
pinning across weight updates, streaming, the KV cache's memory and the engine's lifetime."""

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


def test_gumbel_max_with_hashed_noise_draws_from_the_distribution():
    from rollbook.rollout.sampling import gumbel_noise, vocab_mix

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    keys, index = torch.arange(n), torch.full((n,), 7)
    drawn = (probs.log()[None, :] + gumbel_noise(keys, index, vocab_mix(4, torch.device("cpu")))).argmax(dim=-1)
    freq = torch.bincount(drawn, minlength=4).float() / n
    # binomial standard deviation at n = 20k is at most 0.0036; 5 sigma
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.018)
    again = (probs.log()[None, :] + gumbel_noise(keys, index + 1, vocab_mix(4, torch.device("cpu")))).argmax(dim=-1)
    assert 0.3 < (again == drawn).float().mean() < 0.45  # the next index is a fresh draw: sum p^2 = 0.365


def test_the_split_sampling_paths_draw_exactly_what_gumbel_noise_draws():
    from rollbook.rollout.sampling import gumbel_max, gumbel_noise, gumbel_noise_of_rows, row_hashes, vocab_mix

    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(32, 300, generator=generator).log_softmax(dim=-1)
    keys = torch.randint(0, 2**32, (32,), generator=generator)
    index = torch.randint(0, 5000, (32,), generator=generator)
    mix = vocab_mix(300, torch.device("cpu"))
    noise = gumbel_noise(keys, index, mix)
    assert torch.equal(gumbel_noise_of_rows(row_hashes(keys, index), mix), noise)
    assert torch.equal(gumbel_max(logp, row_hashes(keys, index), mix), (logp + noise).argmax(dim=-1))
    ahead = row_hashes(keys, index[:, None] + torch.arange(5))  # [N, 5]: five output indices at once
    for step in range(5):
        assert torch.equal(ahead[:, step], row_hashes(keys, index + step))


def test_long_outputs_draw_each_token_by_the_hashed_stream_while_the_batch_changes():
    """Past the row hashes the engine computes ahead (16 steps), with rows leaving mid-way: every
    token is still the Gumbel-max draw of (its key, its index) from its recorded distribution."""
    from rollbook.rollout.sampling import gumbel_noise, request_key, vocab_mix

    model = _model()
    long = GenerationRequest(prompt_token_ids=[1, 5, 9], max_new_tokens=45)
    others = [GenerationRequest(prompt_token_ids=p, max_new_tokens=n) for p, n in zip(PROMPTS, [3, 25, 30, 33])]
    engine = NativeEngine(model)
    crowded = engine.generate([long, *others], seed=4)  # the same rows for 22 steps (3 to 25), then fewer
    alone = engine.generate([long], seed=4)[0]
    assert crowded[0].output_token_ids == alone.output_token_ids
    mix = vocab_mix(VOCAB, torch.device("cpu"))
    for i, (request, result) in enumerate(zip([long, *others, long], [*crowded, alone], strict=True)):
        ids = torch.tensor([list(request.prompt_token_ids) + result.output_token_ids[:-1]])
        with torch.inference_mode():
            logp = model(input_ids=ids).logits[0, len(request.prompt_token_ids) - 1 :].log_softmax(dim=-1)
        n = len(result.output_token_ids)
        noise = gumbel_noise(torch.full((n,), request_key(4, i % 5)), torch.arange(n), mix)
        assert (logp + noise).argmax(dim=-1).tolist() == result.output_token_ids


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


def test_requests_run_together_or_alone_give_the_same_results():
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


def test_decode_steps_feed_one_token_per_sequence():
    model = _model()
    widths = []
    model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True)
    NativeEngine(model).generate(_requests(max_new_tokens=5))
    assert widths == [(1, 16)] + [(1, 4)] * 4  # the prompts packed in one row (3 + 7 + 1 + 5), then one token each


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


# -- continuous batching ---------------------------------------------------------------------------

JOINERS = [[1, 9, 4, 30], [1, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 33, 20]]  # different lengths


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=6)],
    ids=["temperature-1", "greedy", "top-p-top-k"],
)
def test_a_request_that_joins_mid_decode_gets_what_it_gets_alone(sampling):
    model = _model()
    engine = NativeEngine(model, seed=5)
    joiners = [GenerationRequest(prompt_token_ids=p, max_new_tokens=9, **sampling) for p in JOINERS]
    alone = [engine.submit(r, seed=100 + i).result() for i, r in enumerate(joiners)]

    # two requests decode; at their 4th token the engine waits in on_token until the joiners are queued
    widths: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    reached, queued, seen = threading.Event(), threading.Event(), []

    def hold_at_fourth(token, logprob, version):
        seen.append(token)
        if len(seen) == 4:
            reached.set()
            assert queued.wait(timeout=30)

    running = [GenerationRequest(prompt_token_ids=p, max_new_tokens=16, temperature=1.0) for p in PROMPTS[:2]]
    engine.pause()  # both held, then admitted together
    background = [engine.submit(running[0], on_token=hold_at_fourth), engine.submit(running[1])]
    engine.resume()
    assert reached.wait(timeout=30)
    joined = [engine.submit(r, seed=100 + i) for i, r in enumerate(joiners)]
    queued.set()
    assert all(len(f.result(timeout=60).output_token_ids) == 16 for f in background)
    assert widths[:4] == [(1, 10), (1, 2), (1, 2), (1, 2)]  # the two prompts, then three decode steps
    assert widths[4] == (1, sum(len(p) for p in JOINERS) + 2)  # the joiners' prompts and the two decoding tokens
    for a, j in zip(alone, (f.result(timeout=60) for f in joined), strict=True):
        assert j.output_token_ids == a.output_token_ids
        torch.testing.assert_close(j.output_logprobs, a.output_logprobs, rtol=0, atol=1e-5)
        t, tp, k = j.temperature, j.top_p, j.top_k
        _assert_agree(j.output_logprobs, _reference(model, j, t, tp, k))


def test_sampled_tokens_depend_on_the_seed_and_output_index_not_on_the_batch():
    model = _model()
    request = GenerationRequest(prompt_token_ids=[1, 5, 9], max_new_tokens=12)
    engine = NativeEngine(model)
    alone = engine.generate([request], seed=3)[0]
    crowded = engine.generate([request] + _requests(max_new_tokens=12), seed=3)[0]  # request 0 of a bigger call
    assert crowded.output_token_ids == alone.output_token_ids
    others = {tuple(engine.generate([request], seed=s)[0].output_token_ids) for s in range(4, 9)}
    assert len(others) > 1


def test_more_requests_than_slots_wait_for_a_free_slot_and_match_a_roomy_engine():
    model = _model()
    requests = [GenerationRequest(prompt_token_ids=p, max_new_tokens=n) for p, n in zip(PROMPTS * 2, [2, 9, 4, 7, 3, 8, 5, 6])]
    roomy = NativeEngine(model).generate(requests, seed=11)
    tight = NativeEngine(model, max_batch_size=3).generate(requests, seed=11)
    for r, t in zip(roomy, tight, strict=True):
        assert t.output_token_ids == r.output_token_ids
        torch.testing.assert_close(t.output_logprobs, r.output_logprobs, rtol=0, atol=1e-5)


def test_on_token_streams_each_token_with_its_logprob_and_version():
    engine = NativeEngine(_model(), version=3)
    streamed: list[tuple[int, float, int]] = []
    result = engine.submit(_requests(max_new_tokens=6)[1], on_token=lambda *token: streamed.append(token)).result(timeout=30)
    assert streamed == list(zip(result.output_token_ids, result.output_logprobs, result.output_versions))
    assert [v for _, _, v in streamed] == [3] * 6


def test_a_request_cancelled_while_queued_never_runs():
    model = _model()
    engine, forwards = NativeEngine(model), []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    engine.pause()
    future = engine.submit(_requests()[0])
    assert future.cancel()
    engine.resume()
    assert len(engine.generate(_requests(max_new_tokens=2)[1:2])[0].output_token_ids) == 2
    assert len(forwards) == 2  # the other request's prefill and one decode step, nothing for the cancelled one


def test_a_callback_that_raises_fails_its_own_request_only():
    engine = NativeEngine(_model())

    def broken(*token):
        raise KeyError("consumer gone")

    failing = engine.submit(_requests()[0], on_token=broken)
    fine = engine.submit(_requests()[1])
    with pytest.raises(KeyError, match="consumer gone"):
        failing.result(timeout=30)
    assert len(fine.result(timeout=30).output_token_ids) == 10


def test_sliding_window_layers_match_a_full_forward_pass():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        use_sliding_window=True,
        sliding_window=4,  # shorter than every sequence here: layer 1 sees only the last 4 positions
        max_window_layers=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    results = NativeEngine(model, seed=4).generate(_requests(max_new_tokens=8, temperature=0.8))
    for result in results:
        _assert_agree(result.output_logprobs, _reference(model, result, 0.8))


def test_attention_score_modifiers_are_refused():
    from rollbook.rollout.kv_slab import _slab_attention

    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="softcap"):
        _slab_attention(module, q, q, q, None, rollbook_kv=object(), softcap=30.0)


# -- stops, limits, memory and lifetime ------------------------------------------------------------


def test_any_of_several_stop_ids_ends_the_output():
    model = _model()
    free = NativeEngine(model).generate(_requests(temperature=0.0, max_new_tokens=10))
    stops = [free[0].output_token_ids[2], free[3].output_token_ids[5]]
    stopped = NativeEngine(model).generate(_requests(temperature=0.0, max_new_tokens=10, stop_token_ids=stops))
    assert any(s.finish_reason == "stop" for s in stopped)
    for f, s in zip(free, stopped, strict=True):
        ends = [i + 1 for i, token in enumerate(f.output_token_ids) if token in stops]
        end = ends[0] if ends else len(f.output_token_ids)
        assert (s.output_token_ids, s.finish_reason) == (f.output_token_ids[:end], "stop" if ends else "length")


def test_a_request_longer_than_max_seq_len_is_refused_with_the_numbers():
    engine = NativeEngine(_model(), max_seq_len=16)
    with pytest.raises(ValueError, match=r"7 prompt tokens \+ max_new_tokens 10 = 17 exceeds the engine's max_seq_len 16"):
        engine.generate([GenerationRequest(prompt_token_ids=PROMPTS[1], max_new_tokens=10)])
    assert len(engine.generate([GenerationRequest(prompt_token_ids=PROMPTS[1], max_new_tokens=9)])[0].output_token_ids) == 9


def test_release_memory_frees_the_kv_cache_and_the_next_request_allocates_it_again():
    model = _model()  # 2 layers, 2 key/value heads of 16 dimensions, 512 positions, float32
    engine = NativeEngine(model, max_batch_size=4)
    assert engine.release_memory() == 0  # nothing allocated yet
    first = engine.generate(_requests(temperature=0.0))
    assert engine.release_memory() == 2 * 2 * (4 * 2 * 512 * 16) * 4  # layers x (keys, values) x slab x bytes
    assert engine.release_memory() == 0
    again = engine.generate(_requests(temperature=0.0))
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in first]


def test_release_memory_is_refused_while_a_request_is_in_flight():
    model = _model()
    engine, gate = NativeEngine(model), _StepGate(model, at=1)
    future = engine.submit(_requests(max_new_tokens=4)[0])
    assert gate.reached.wait(timeout=30)
    with pytest.raises(RuntimeError, match="1 requests are in flight"):
        engine.release_memory()
    gate.release.set()
    future.result(timeout=30)
    assert engine.release_memory() > 0


def test_close_fails_what_is_in_flight_and_refuses_new_work():
    model = _model()
    engine, gate = NativeEngine(model), _StepGate(model, at=1)
    future = engine.submit(_requests(max_new_tokens=4)[0])
    assert gate.reached.wait(timeout=30)
    closer = threading.Thread(target=engine.close)
    closer.start()
    gate.release.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        future.result(timeout=30)
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(_requests(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        engine.update_weights(_model(1).state_dict(), version=1)
    engine.close()  # idempotent


def test_an_idle_engine_holds_no_thread():
    engine = NativeEngine(_model())
    engine.generate(_requests(max_new_tokens=2))
    _wait_until(lambda: not any(t.name == "rollbook-engine" and t.is_alive() for t in threading.enumerate()))


def test_close_waits_for_a_scheduler_thread_that_is_still_on_its_way_out():
    # a thread still unwinding at interpreter exit can abort the process: close joins it
    engine = NativeEngine(_model())
    ending, next_step = [], engine._next_step

    def slow_to_leave():
        step = next_step()
        if step is None:
            ending.append(threading.current_thread())
            time.sleep(0.3)
        return step

    engine._next_step = slow_to_leave  # type: ignore[method-assign]
    engine.generate(_requests(max_new_tokens=2))
    _wait_until(lambda: bool(ending))
    engine.close()
    assert not ending[0].is_alive()


def test_top_logprobs_are_the_most_likely_tokens_of_the_sampling_distribution_and_reach_on_token():
    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student
    from rollbook.rollout.engine import GenerationRequest, NativeEngine

    engine = NativeEngine(build_student(ModelConfig()), version=0, seed=0)
    streamed = []
    greedy = GenerationRequest(prompt_token_ids=[1, 4, 5], max_new_tokens=6, temperature=0.0, top_logprobs=4)
    sampled = GenerationRequest(prompt_token_ids=[1, 4, 5], max_new_tokens=6, top_k=3, top_logprobs=5)
    plain = GenerationRequest(prompt_token_ids=[1, 4, 5], max_new_tokens=6)
    future = engine.submit(greedy, on_token=lambda *args: streamed.append(args))
    r_sampled, r_plain = engine.generate([sampled, plain], seed=3)
    r_greedy = future.result()
    engine.close()
    assert len(r_greedy.output_top_logprobs) == len(r_greedy.output_token_ids)
    for token, logprob, top in zip(r_greedy.output_token_ids, r_greedy.output_logprobs, r_greedy.output_top_logprobs):
        assert len(top) == 4 and top[0] == (token, logprob)  # greedy: the sampled token is the most likely
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert [a[3] for a in streamed] == r_greedy.output_top_logprobs and all(len(a) == 4 for a in streamed)
    for token, logprob, top in zip(r_sampled.output_token_ids, r_sampled.output_logprobs, r_sampled.output_top_logprobs):
        assert len(top) == 3  # top_k 3: the other tokens cannot be sampled, so they are left out
        assert (token, logprob) in top
    assert r_plain.output_top_logprobs is None
    with pytest.raises(ValueError, match="top_logprobs must be in"):
        GenerationRequest(prompt_token_ids=[1], max_new_tokens=1, top_logprobs=21)
