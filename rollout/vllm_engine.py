"""A vLLM engine behind ``GenerationEngine`` (GPU clusters; optional extra ``rollbook[vllm]``).

vLLM is imported only when a ``VllmEngine`` is built, so nothing else in rollbook needs it to
install, run or test. Its tests are marked ``gpu`` and skip on machines without CUDA or vllm.

Evidence it records, as the native engine does:
- ``output_logprobs``: the sampled token's log-probability as vLLM reports it with
  ``logprobs=0`` and ``logprobs_mode="processed_logprobs"`` (after temperature and top-k/top-p,
  i.e. the distribution actually sampled from). Older vLLM versions without ``logprobs_mode`` report
  raw log-probs; the store's evidence rules still apply (sentinels such as -9999.0 are rejected).
- ``output_versions``: vLLM finishes a request under the weights it started with in this adapter
  (``update_weights`` waits for in-flight ``generate`` calls, then loads), so every token of a
  result carries the version resident when the call was admitted.

Weights: the model comes from a local Hugging Face directory (``model_path``, loaded by vLLM);
``update_weights`` takes a state dict of Hugging Face names (what the trainer publishes, what a weight
channel's snapshot holds) and hands it to the model's own ``load_weights`` through ``LLM.apply_model``
(vLLM's engine core runs in this process: ``rollbook.environment.prepare_vllm``), or, on a vLLM without
``apply_model``, through the V0 engine's driver worker. A callable (the native engine's other form) is
refused: vLLM's modules do not take a ``load_state_dict`` of Hugging Face names.

Memory: vLLM takes ``gpu_memory_utilization`` of its GPU for the model and a KV cache it keeps. Built
with ``sleep_mode=True`` (vLLM's ``enable_sleep_mode``), ``release_memory()`` puts vLLM to sleep at
level 1 between rounds (``LLM.sleep(level=1)``: the weights are copied to host memory, the KV cache is
discarded), so a trainer on the same GPU gets that memory back (the colocated placement with
``trainer.offload_optimizer``); the next ``generate`` or ``update_weights`` wakes it first
(``LLM.wake_up()``: the weights come back, the KV cache is allocated again). Without sleep mode
``release_memory()`` frees nothing and returns 0.

Stops: only the request's ``stop_token_ids`` (``rollbook.language_models.stop_token_ids``: the
tokenizer's eos, the model's generation-config eos ids, configured ids); the ``stop`` predicate is
ignored and the worker cuts stop strings from the text before scoring.

Not exercised on this project's CPU machines; the ``gpu``-marked tests run it where vllm exists, and
tests/unit/rollout/test_engines.py holds the adapter to a stand-in ``vllm`` module.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from rollbook.rollout.engine import GenerationRequest, GenerationResult, Weights

log = logging.getLogger("rollbook.rollout")


class VllmEngine:
    """``GenerationEngine`` over ``vllm.LLM(model_path, **llm_kwargs)`` (rollout/engines.py
    ``build_engine`` passes dtype, seed, gpu_memory_utilization, max_model_len and skip_tokenizer_init).
    ``sleep_mode``: built with vLLM's ``enable_sleep_mode``, so that ``release_memory`` frees its GPU
    memory between rounds."""

    def __init__(self, model_path: str, *, version: int = 0, sleep_mode: bool = False, **llm_kwargs: Any):
        from rollbook.environment import prepare_vllm

        prepare_vllm()
        try:
            from vllm import LLM
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError("VllmEngine needs vllm: pip install 'rollbook[vllm]' on a CUDA machine") from exc
        if sleep_mode:
            llm_kwargs = {**llm_kwargs, "enable_sleep_mode": True}
        try:  # the log-probs of the distribution sampled from (after temperature, top-k, top-p)
            self._llm = LLM(model=model_path, **{"logprobs_mode": "processed_logprobs", **llm_kwargs})
        except TypeError as exc:
            if "logprobs_mode" not in str(exc) or "logprobs_mode" in llm_kwargs:
                raise
            log.warning("this vLLM has no logprobs_mode: it records raw log-probs (before temperature and top-k/top-p)")
            self._llm = LLM(model=model_path, **llm_kwargs)
        self._version = version
        self._sleep_mode = sleep_mode
        self._admit = threading.Condition()  # guards the fields below
        self._paused = False
        self._in_flight = 0
        self._asleep = False

    @property
    def version(self) -> int:
        return self._version

    def pause(self) -> None:
        with self._admit:
            self._paused = True

    def resume(self) -> None:
        with self._admit:
            self._paused = False
            self._admit.notify_all()

    def generate(self, requests: list[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        from vllm import SamplingParams, TokensPrompt

        with self._admit:
            self._admit.wait_for(lambda: not self._paused)
            self._wake()
            self._in_flight += 1
            version = self._version
        try:
            params = [
                SamplingParams(
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k if r.top_k > 0 else -1,
                    max_tokens=r.max_new_tokens,
                    stop_token_ids=list(r.stop_token_ids),
                    logprobs=0,
                    detokenize=False,  # ids in, ids out: the worker decodes with its own tokenizer
                    seed=None if seed is None else seed + i,
                )
                for i, r in enumerate(requests)
            ]
            outputs = self._llm.generate(
                [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests], params, use_tqdm=False
            )
            return [_result(r, o.outputs[0], version) for r, o in zip(requests, outputs)]
        finally:
            with self._admit:
                self._in_flight -= 1
                self._admit.notify_all()

    def update_weights(self, weights: Weights, version: int) -> None:
        if version <= self._version:
            raise ValueError(f"version must increase: {version} <= {self._version}")
        if callable(weights):
            raise TypeError("VllmEngine takes a state dict (name -> tensor), not a callable")
        self.pause()
        try:
            with self._admit:
                self._admit.wait_for(lambda: self._in_flight == 0)
                self._wake()  # the weights are back on the GPU before new ones are loaded into them
                self._in_flight += 1  # the load counts as in flight: release_memory waits for it
            try:
                load = functools.partial(_load_weights, dict(weights))
                if hasattr(self._llm, "apply_model"):
                    self._llm.apply_model(load)
                else:  # a vLLM from before apply_model (V0 engine)
                    load(self._llm.llm_engine.model_executor.driver_worker.model_runner.model)
                self._version = version
            finally:
                with self._admit:
                    self._in_flight -= 1
                    self._admit.notify_all()
        finally:
            self.resume()

    def release_memory(self) -> int:
        """Between rounds: put vLLM to sleep at level 1 (``LLM.sleep(level=1)``: weights to host memory,
        KV cache discarded) so that another user of the GPU (a colocated trainer) gets its memory; the
        next ``generate`` or ``update_weights`` wakes it. Returns the bytes freed: how much the GPU's
        free memory grew across the sleep (``torch.cuda.mem_get_info``), 0 when that is not knowable
        (no CUDA) and 0 when nothing was freed (already asleep, or built without ``sleep_mode``: vLLM
        keeps its memory). Only while no ``generate`` or ``update_weights`` is in flight: a ``RuntimeError``
        otherwise."""
        with self._admit:
            if self._in_flight:
                raise RuntimeError(
                    f"release_memory: {self._in_flight} calls (generate, update_weights) are in flight; "
                    "call it between generations"
                )
            if not self._sleep_mode or self._asleep:
                return 0
            before = _free_device_bytes()
            self._llm.sleep(level=1)
            self._asleep = True
            after = _free_device_bytes()
        return max(0, after - before) if before is not None and after is not None else 0

    def _wake(self) -> None:
        """Wake vLLM if ``release_memory`` put it to sleep (the caller holds ``_admit``)."""
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False


def _free_device_bytes() -> int | None:
    """Free memory of the current CUDA device (all processes' use counted), None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - a figure for the metrics, never a failure
        return None


def _load_weights(weights: Mapping[str, Any], model) -> None:
    """In each vLLM worker: the model's own loader, which maps Hugging Face names onto vLLM's fused modules."""
    model.load_weights(weights.items())


def _result(request: GenerationRequest, completion, version: int) -> GenerationResult:
    tokens = list(completion.token_ids)
    logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
    return GenerationResult(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=tokens,
        output_logprobs=logprobs,
        output_versions=[version] * len(tokens),
        finish_reason="stop" if completion.finish_reason == "stop" else "length",
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
    )
