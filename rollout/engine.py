"""Generation engines: the ``GenerationEngine`` protocol and the native PyTorch engine.

The native engine samples from any ``transformers`` causal LM on CPU or CUDA, batched, with a KV
cache, and records for every output token the evidence the store needs: the token, its
log-probability and the policy version that produced it.

    engine = NativeEngine(model, version=0, seed=0)
    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1, 5, 7], max_new_tokens=16)])
    engine.update_weights(new_state_dict, version=1)   # safe from another thread, mid-generation

Benchmark against a loop without KV cache: ``python bench/generate.py --json``.

What ``output_logprobs`` holds
------------------------------
The log-probability of the token under the distribution it was ACTUALLY sampled from
(``sampling_logprobs``): logits divided by the temperature, then top-k (keep the k largest; ties are
broken by sort order, so exactly k survive), then top-p on that top-k distribution (keep the
shortest prefix of the descending order whose mass reaches p; the top token always survives), then
renormalized. ``top_k`` of 0 or -1 and ``top_p`` of 1.0 disable truncation. Temperature 0 is
greedy decoding: the token is the argmax, and the recorded log-probability is the one of the
temperature-1 distribution with the same truncation (the model's own probability of that token,
which is what a trainer compares against; the literal sampling distribution, a point mass, would
record 0.0 for every token). ``reference_logprobs`` computes the same quantities with one plain
forward pass over the whole sequence; the tests hold the engine to it.

Versions, weight updates, pause and resume
------------------------------------------
The engine decodes step by step; step ``k`` of a batch is the forward pass whose logits yield output
token ``k`` (step 0 is the prefill). Weight updates take effect only between steps, so every token's
recorded version is the version of the weights that computed its logits. ``update_weights`` (from
any thread) stops admission of new ``generate`` calls, waits for the next step boundary of the
in-flight batches (or applies at once when nothing is in flight), then admission resumes. In-flight
sequences are neither dropped nor restarted: they continue under the new weights, so one sequence
may carry several versions, non-decreasing, split exactly at the first token whose logits came from
the new weights. ``schedule_weight_update(..., at_step=k)`` is the deterministic hook for tests.

By default the KV cache computed under the old weights is KEPT across an update. A token sampled
after the update then has the log-probability of the NEW weights applied to its newest position,
attending to keys/values of earlier positions that the OLD weights computed (and that later steps'
new weights appended). This is exactly the distribution sampled from, so it is what is recorded; it
is not the new policy's full-forward probability. ``refresh_cache_on_update=True`` instead
recomputes the cache of all in-flight sequences under the new weights (one prefill), after which the
recorded log-probabilities equal the new weights' full forward pass.
"""

from __future__ import annotations

import inspect
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

# A full state dict, or a callable run between decode steps that receives the model and either loads
# the weights into it itself (returning None) or returns a state dict to load.
Weights = Mapping[str, "torch.Tensor"] | Callable[["torch.nn.Module"], "Mapping[str, torch.Tensor] | None"]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete. ``top_k`` 0 or -1 and ``top_p`` 1.0 mean no truncation."""

    prompt_token_ids: Sequence[int]  # non-empty
    max_new_tokens: int  # >= 1
    temperature: float = 1.0  # >= 0; 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # >= -1
    stop_token_ids: Sequence[int] = ()  # a sampled stop token ends the output and is part of it
    # Called with the output ids so far after every token; True ends the output there (stop strings:
    # rollbook.tokenizers.StopStrings; the token that completed the string is part of the output).
    # The native engine honours it; engines that cannot (vLLM here) ignore it and the worker cuts the
    # text at the stop string before scoring.
    stop: Callable[[Sequence[int]], bool] | None = field(default=None, compare=False)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"request {self.request_id}: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"request {self.request_id}: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"request {self.request_id}: top_k must be >= -1 (0 or -1 disable it), got {self.top_k}")


@dataclass
class GenerationResult:
    """A completion with its evidence. ``output_logprobs`` and ``output_versions`` have
    ``len(output_token_ids)`` (>= 1); versions are non-decreasing."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: Literal["stop", "length"]
    temperature: float
    top_p: float
    top_k: int


@runtime_checkable
class GenerationEngine(Protocol):
    """What a rollout worker needs from an inference backend (native PyTorch, vLLM, ...)."""

    @property
    def version(self) -> int:
        """The policy version of the resident weights."""
        ...

    def generate(self, requests: list[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """Complete every request; results in request order. Blocks while admission is paused.
        ``seed``: sample this call from its own generator seeded so (the same requests on the same
        weights draw the same samples: evaluation with common random numbers), leaving the engine's
        own sampling stream untouched."""
        ...

    def update_weights(self, weights: Weights, version: int) -> None:
        """Install policy ``version`` (> the current one) at the next decode-step boundary; returns once
        installed. In-flight sequences continue under it."""
        ...

    def pause(self) -> None:
        """Stop admitting new ``generate`` calls; in-flight ones run to completion."""
        ...

    def resume(self) -> None:
        """Admit new ``generate`` calls again."""
        ...


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[N, V]`` of the distribution sampled from (see the module docstring).

    ``logits`` is ``[N, V]``; ``temperature``, ``top_p`` and ``top_k`` are ``[N]`` (one per row) or
    ``[1]`` (one for all rows).
    Truncated entries are ``-inf``.
    """
    import torch

    num_vocab = logits.shape[-1]
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0).float()[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(num_vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, num_vocab).clamp(max=num_vocab)
    drop_sorted = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything, even where float cumsum rounds the earlier mass up to 1.0
    drop_sorted = drop_sorted | (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf")).log_softmax(dim=-1)


def reference_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    temperature: float,
    top_p: float,
    top_k: int,
) -> list[float]:
    """The recorded log-probabilities recomputed with one plain forward pass over prompt + output.

    What a trainer computes; ``NativeEngine`` must agree with it (same weights, one version).
    """
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)[:-1]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :]
    n = len(output_ids)
    logp = sampling_logprobs(
        logits,
        torch.full((n,), float(temperature), device=device),
        torch.full((n,), float(top_p), device=device),
        torch.full((n,), int(top_k), device=device),
    )
    return logp.gather(-1, torch.tensor(list(output_ids), device=device)[:, None])[:, 0].tolist()


@dataclass
class _Update:
    weights: Weights
    version: int
    at_step: int | None = None  # None: at the next step boundary of any batch
    done: bool = False
    error: BaseException | None = None


class NativeEngine:
    """Batched sampling from a ``transformers`` causal LM with a KV cache; see the module docstring.

    Prompts of a batch are left-padded, with an attention mask and position ids that make padding
    invisible. Finished sequences leave the batch (and its cache) at once. ``use_kv_cache=False``
    recomputes the whole sequence at every step (the benchmark's naive baseline).
    The engine owns ``model`` (it is put in eval mode).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        version: int = 0,
        seed: int = 0,
        max_batch_size: int = 64,
        pad_token_id: int = 0,
        use_kv_cache: bool = True,
        refresh_cache_on_update: bool = False,
    ) -> None:
        import torch

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._model = model.eval()
        self._device = next(model.parameters()).device
        self._num_vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]  # transformers types the method as a Tensor
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._max_batch_size = max_batch_size
        self._pad_token_id = pad_token_id
        self._use_kv_cache = use_kv_cache
        self._refresh_cache_on_update = refresh_cache_on_update
        self._version = version
        # transformers renamed `past_key_values` to `cache` (5.x) and `num_logits_to_keep` to
        # `logits_to_keep` (4.50); only the last position's logits are ever needed.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._last_logits_kwarg = {name: 1 for name in ("logits_to_keep", "num_logits_to_keep") if name in params}
        # Lock order: _cond, then _model_lock. _model_lock pairs each forward with the version of the
        # weights it ran under; _cond guards admission and the update queues.
        self._model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._paused = False
        self._num_in_flight = 0
        self._pending: list[_Update] = []
        self._scheduled: list[_Update] = []
        self._failure: BaseException | None = None  # the last update raised: weights unknown until one succeeds

    @property
    def version(self) -> int:
        return self._version

    @property
    def admitting(self) -> bool:
        """False while paused or while a weight update waits for a step boundary."""
        with self._cond:
            return not self._paused and not self._pending

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update_weights(self, weights: Weights, version: int) -> None:
        """See ``GenerationEngine``. A state dict must match the model's keys and shapes exactly. A
        callable that raises may have half-loaded the model: the error is raised here, and every decode
        step or ``generate`` call raises too until a later update (e.g. a retry of the same version)
        succeeds. The version stays the last one installed successfully."""
        with self._cond:
            update = self._enqueue(weights, version, at_step=None)
            if self._num_in_flight == 0:
                self._apply_due(step=None)
            self._cond.wait_for(lambda: update.done)
        if update.error is not None:
            raise RuntimeError(f"weight update to version {version} failed") from update.error

    def schedule_weight_update(self, weights: Weights, version: int, *, at_step: int) -> None:
        """Test hook: install ``version`` just before decode step ``at_step`` (0 = prefill) of the next
        batch that reaches it, so its output tokens ``>= at_step`` carry ``version``. Applied when the
        ``generate`` call ends if no batch reaches that step. Returns immediately."""
        if at_step < 0:
            raise ValueError(f"at_step must be >= 0, got {at_step}")
        with self._cond:
            self._enqueue(weights, version, at_step=at_step)

    def generate(self, requests: list[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        import torch

        generator = self._generator if seed is None else torch.Generator(device=self._device).manual_seed(seed)
        for request in requests:
            if max(request.prompt_token_ids) >= self._num_vocab or min(request.prompt_token_ids) < 0:
                raise ValueError(f"request {request.request_id}: a prompt token id is outside [0, {self._num_vocab})")
        with self._cond:
            self._cond.wait_for(lambda: not self._paused and not self._pending)
            self._raise_if_failed()
            self._num_in_flight += 1
        try:
            results: list[GenerationResult] = []
            for start in range(0, len(requests), self._max_batch_size):
                results += self._generate_batch(requests[start : start + self._max_batch_size], generator)
            return results
        finally:
            with self._cond:
                self._num_in_flight -= 1
                if self._num_in_flight == 0:  # nobody left to reach a step boundary
                    self._apply_due(step=None, everything=True)

    # -- private -------------------------------------------------------------------------------

    def _enqueue(self, weights: Weights, version: int, *, at_step: int | None) -> _Update:
        if not callable(weights):
            self._check_state_dict(weights)
        newest = max([self._version] + [u.version for u in self._pending + self._scheduled])
        if version <= newest:
            raise ValueError(f"weight version must increase: got {version}, newest known is {newest}")
        update = _Update(weights, version, at_step)
        (self._pending if at_step is None else self._scheduled).append(update)
        return update

    def _apply_due(self, step: int | None, everything: bool = False) -> bool:
        """Install queued updates due at this step boundary (caller holds ``_cond``); True if any."""
        due = list(self._pending)
        due += [u for u in self._scheduled if everything or (step is not None and u.at_step <= step)]
        if not due:
            return False
        # versions only grow: a scheduled update older than one due now goes in first, in order
        newest = max(u.version for u in due)
        due += [u for u in self._scheduled if u not in due and u.version < newest]
        self._pending = []
        self._scheduled = [u for u in self._scheduled if u not in due]
        with self._model_lock:
            for update in sorted(due, key=lambda u: u.version):
                try:
                    self._load(update.weights)
                    self._version, self._failure = update.version, None
                except Exception as exc:  # handed to the updater, and blocks generation until fixed
                    self._failure = update.error = exc
                update.done = True
        self._cond.notify_all()
        return True

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                "a weight update failed; the engine's weights are unknown until an update succeeds"
            ) from self._failure

    def _check_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        expected = {name: tuple(t.shape) for name, t in self._model.state_dict().items()}
        got = {name: tuple(t.shape) for name, t in state.items()}
        if got != expected:
            missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
            reshaped = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
            raise ValueError(
                f"state dict does not fit the model: missing {missing}, unexpected {unexpected}, wrong shape {reshaped}"
            )

    def _load(self, weights: Weights) -> None:
        import torch

        with torch.no_grad():
            state = weights(self._model) if callable(weights) else weights
            if state is not None:
                self._model.load_state_dict(state, strict=True)

    def _generate_batch(self, requests: list[GenerationRequest], generator: "torch.Generator") -> list[GenerationResult]:
        import torch

        batch = _DecodeState(requests, self._pad_token_id, self._device)
        cache = None
        step = 0
        while batch.num_live:
            with self._cond:
                updated = self._apply_due(step)
                self._raise_if_failed()
            full_pass = cache is None or not self._use_kv_cache or (updated and self._refresh_cache_on_update)
            with self._model_lock, torch.inference_mode():
                version = self._version
                logits, cache = self._forward(batch, None if full_pass else cache)
            with torch.inference_mode():
                logp = sampling_logprobs(logits, batch.temperature, batch.top_p, batch.top_k)
                tokens = torch.where(
                    batch.temperature > 0,
                    torch.multinomial(logp.exp(), 1, generator=generator)[:, 0],
                    logp.argmax(dim=-1),
                )
                token_logp = logp.gather(-1, tokens[:, None])[:, 0]
            keep = batch.append(tokens, token_logp, version)
            if cache is not None and not bool(keep.all()):
                cache.batch_select_indices(keep.nonzero()[:, 0])
            step += 1
        return batch.results()

    def _forward(self, batch: _DecodeState, cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits ``[live, V]`` for the next token; a full pass when ``cache`` is None."""
        from transformers import DynamicCache

        positions = batch.attention_mask.cumsum(dim=-1) - 1
        if cache is None:
            ids, positions = batch.token_ids, positions.clamp(min=0)
            cache = DynamicCache() if self._use_kv_cache else None
        else:
            ids, positions = batch.token_ids[:, -1:], positions[:, -1:]
        kwargs = {self._cache_kwarg: cache, **self._last_logits_kwarg}
        out = self._model(
            input_ids=ids,
            attention_mask=batch.attention_mask,
            position_ids=positions,
            use_cache=self._use_kv_cache,
            **kwargs,
        )
        return out.logits[:, -1, :], cache  # the cache object is filled in place


class _DecodeState:
    """The live rows of one left-padded batch and the evidence gathered so far."""

    def __init__(self, requests: list[GenerationRequest], pad_token_id: int, device: torch.device) -> None:
        import torch

        self._requests = requests
        width = max(len(r.prompt_token_ids) for r in requests)
        self.token_ids = torch.full((len(requests), width), pad_token_id, dtype=torch.long, device=device)
        self.attention_mask = torch.zeros((len(requests), width), dtype=torch.long, device=device)
        for row, request in enumerate(requests):
            n = len(request.prompt_token_ids)
            self.token_ids[row, width - n :] = torch.tensor(list(request.prompt_token_ids), device=device)
            self.attention_mask[row, width - n :] = 1
        self.temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=device)
        self.top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=device)
        self._rows = list(range(len(requests)))  # live row -> request index
        self._tokens: list[list[int]] = [[] for _ in requests]
        self._logprobs: list[list[float]] = [[] for _ in requests]
        self._versions: list[list[int]] = [[] for _ in requests]
        self._finish: list[str] = ["length"] * len(requests)

    @property
    def num_live(self) -> int:
        return len(self._rows)

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor, version: int) -> torch.Tensor:
        """Record one sampled token per live row; drop finished rows. Returns the keep mask ``[live]``."""
        import torch

        keep = []
        for row, token, logprob in zip(self._rows, tokens.tolist(), logprobs.tolist()):
            request = self._requests[row]
            self._tokens[row].append(token)
            self._logprobs[row].append(logprob)
            self._versions[row].append(version)
            stopped = token in request.stop_token_ids or (request.stop is not None and bool(request.stop(self._tokens[row])))
            if stopped:
                self._finish[row] = "stop"
            keep.append(not stopped and len(self._tokens[row]) < request.max_new_tokens)
        keep_mask = torch.tensor(keep, device=tokens.device)
        ones = torch.ones_like(self.attention_mask[:, :1])
        self.token_ids = torch.cat([self.token_ids, tokens[:, None]], dim=-1)[keep_mask]
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)[keep_mask]
        self.temperature, self.top_p = self.temperature[keep_mask], self.top_p[keep_mask]
        self.top_k = self.top_k[keep_mask]
        self._rows = [row for row, k in zip(self._rows, keep) if k]
        return keep_mask

    def results(self) -> list[GenerationResult]:
        return [
            GenerationResult(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                output_token_ids=self._tokens[i],
                output_logprobs=self._logprobs[i],
                output_versions=self._versions[i],
                finish_reason=self._finish[i],  # type: ignore[arg-type]
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
            )
            for i, r in enumerate(self._requests)
        ]
