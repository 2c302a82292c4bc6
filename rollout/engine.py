"""Generation engines: the ``GenerationEngine`` protocol and the native PyTorch engine.

The native engine samples from any ``transformers`` causal LM on CPU or CUDA with continuous
batching and a KV cache allocated once, and records for every output token the evidence the store
needs: the token, its log-probability and the policy version that produced it.

    engine = NativeEngine(model, version=0, seed=0, max_batch_size=64)
    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1, 5, 7], max_new_tokens=16)])
    future = engine.submit(request, on_token=lambda token, logprob, version: ...)   # streaming
    engine.update_weights(new_state_dict, version=1)   # safe from another thread, mid-generation
    engine.release_memory()                            # frees the KV cache between rollout and training
    engine.close()

Benchmark against Hugging Face ``generate``: ``python bench/generate.py --json``.

How it runs
-----------
One scheduler thread owns the model. It starts when work arrives, exits when there is none (an
engine nobody closes holds no thread while idle) and is stopped for good by ``close()``. Every
caller's requests go into one queue; the scheduler keeps ONE running batch of at most
``max_batch_size`` sequences (the slots) and, at each step boundary:

1. installs the weight updates that are due (below);
2. admits queued requests into free slots (at most ``MAX_PREFILL_TOKENS`` prompt tokens per step, at
   least one request);
3. runs ONE forward pass over one packed row: the admitted requests' prompts end to end (their
   prefill), then the newest token of every other live sequence (its decode step);
4. samples one token per sequence, with one host synchronization for the whole step, and records it;
   a sequence that stops (a stop token, its ``stop`` callable, ``max_new_tokens``) leaves its slot
   at once (the sequences above it move down, so the live slots stay consecutive), and its future
   is resolved.

The KV cache (rollout/kv_slab.py) is one slab per layer, keys and values
``[max_batch_size, kv_heads, max_seq_len, head_dim]`` in the model's dtype and device, allocated on
first use; the model's attention reads and writes it through an attention function registered with
transformers. A request whose ``len(prompt_token_ids) + max_new_tokens`` exceeds ``max_seq_len`` is
refused with a ``ValueError``. ``release_memory()`` frees the slab when nothing is in flight (it is
allocated again on the next request).

``generate`` submits all its requests at once and waits for them (results in request order);
``submit`` returns a ``concurrent.futures.Future`` per request, and its ``on_token`` callback is
called from the scheduler thread with each sampled token: it must be quick, since the whole batch
waits for it (hand the token to a queue), and must not wait for the engine itself. A future cancelled before its request is admitted drops
the request. A request's failure (its ``stop`` or ``on_token`` raised, a forward pass failed) fails
its future; ``generate`` then raises it.

Sampling streams
----------------
Each request has its own random stream (rollout/sampling.py): token ``i`` is the Gumbel-max draw
from the distribution below with noise hashed from (the request's key, ``i``, the vocabulary index).
So a request draws the same tokens whatever else shares the batch, and when it joins. With
``generate(requests, seed=s)`` request ``i``'s key is derived from ``(s, i)`` (common random numbers:
the same call on the same weights draws the same samples, and the engine's own stream is left
untouched); without a seed each request draws its key from the engine's stream (seeded by ``seed``).

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
Output token ``i`` of a request comes from the forward pass of its step ``i`` (step 0 is its
prefill). Weight updates take effect only between steps, so every token's recorded version is the
version of the weights that computed its logits. ``update_weights`` (from any thread) stops
admission of new requests, waits for the next step boundary (or applies at once when nothing is in
flight), then admission resumes. In-flight sequences are neither dropped nor restarted: they
continue under the new weights, so one sequence may carry several versions, non-decreasing, split
exactly at the first token whose logits came from the new weights. ``pause()`` holds requests
submitted after it (they wait, unadmitted) until ``resume()``; those submitted before it run to
completion. ``schedule_weight_update(..., at_step=k)`` is the deterministic hook for tests: the
update is installed just before the first step that computes some in-flight request's output token
``k`` or later, so the tokens ``>= k`` of requests that run in step (those of one ``generate`` call
that fits the slots) carry the new version; it is installed when the engine runs out of work if no
request gets that far.

By default the KV cache computed under the old weights is KEPT across an update. A token sampled
after the update then has the log-probability of the NEW weights applied to its newest position,
attending to keys/values of earlier positions that the OLD weights computed (and that later steps'
new weights appended). This is exactly the distribution sampled from, so it is what is recorded; it
is not the new policy's full-forward probability. ``refresh_cache_on_update=True`` instead
recomputes the cache of all in-flight sequences under the new weights (one prefill of each whole
sequence), after which the recorded log-probabilities equal the new weights' full forward pass.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rollbook.rollout.sampling import gumbel_max, request_key, row_hashes, vocab_mix

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rollbook.rollout.kv_slab import KVSlab

# A full state dict, or a callable run between decode steps that receives the model and either loads
# the weights into it itself (returning None) or returns a state dict to load.
Weights = Mapping[str, "torch.Tensor"] | Callable[["torch.nn.Module"], "Mapping[str, torch.Tensor] | None"]

# on_token(token_id, logprob, version), called from the engine's scheduler thread as each token is sampled;
# for a request with top_logprobs > 0, on_token(token_id, logprob, version, top) with top its TopLogprobs
TokenCallback = Callable[..., None]
# the most likely tokens at one position as (token_id, logprob) pairs, most likely first, of the same
# distribution the sampled token's recorded log-prob is taken from (tokens it cannot sample left out)
TopLogprobs = list[tuple[int, float]]
MAX_TOP_LOGPROBS = 20

DEFAULT_MAX_SEQ_LEN = 4096  # max_seq_len when not given: the model's max_position_embeddings, at most this
MAX_PREFILL_TOKENS = 8192  # prompt tokens admitted per step (a longer prompt is admitted alone)


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
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS: also record that many most likely tokens per position

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
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"request {self.request_id}: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )


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
    output_top_logprobs: list[TopLogprobs] | None = None  # per output token, with a request's top_logprobs > 0


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
    at_step: int | None = None  # None: at the next step boundary
    done: bool = False
    error: BaseException | None = None


class NativeEngine:
    """Continuous-batching sampler over a ``transformers`` causal LM; see the module docstring.

    ``max_batch_size`` sequences decode together (the KV cache's slots); ``max_seq_len`` bounds
    prompt plus output tokens of one request (default: the model's ``max_position_embeddings``, at
    most ``DEFAULT_MAX_SEQ_LEN``; a longer one than the model's positions is a ``ValueError``). Together
    they size the KV cache: callers that know their workload pass both (rollout/engines.py
    ``native_engine``: the longest prompt plus ``max_new_tokens``). ``pad_token_id`` is accepted for
    older callers and unused: nothing is padded. The engine owns ``model`` (it is put in eval mode;
    run nothing else on it while a generation is in flight).
    """

    max_top_logprobs = MAX_TOP_LOGPROBS  # what GenerationRequest.top_logprobs may ask (the proxy reads it)
    # called by the scheduler thread after each step and as it ends (an engine process sends what the
    # step's callbacks produced from there: rollout/engine_process.py); set it before submitting
    on_step_end: Callable[[], None] | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        version: int = 0,
        seed: int = 0,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        pad_token_id: int = 0,
        refresh_cache_on_update: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        config: Any = model.config
        positions = getattr(config, "max_position_embeddings", None)
        if max_seq_len is not None and isinstance(positions, int) and max_seq_len > positions:
            raise ValueError(
                f"max_seq_len {max_seq_len} is longer than the model's max_position_embeddings {positions}: "
                "the model has no positions past them"
            )
        max_seq_len = max_seq_len or min(positions or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2 (one prompt token and one output token), got {max_seq_len}")
        self._model = model.eval()
        self._device = next(model.parameters()).device
        self._num_vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]  # transformers types the method as a Tensor
        self._rng = random.Random(seed)  # the engine's own stream: one sampling key per unseeded request
        self._max_batch_size = max_batch_size
        self._max_seq_len = max_seq_len
        self._refresh_cache_on_update = refresh_cache_on_update
        self._version = version
        # _cond guards everything below; the scheduler thread runs the model outside it
        self._cond = threading.Condition()
        self._paused = False
        self._closed = False
        self._pending: list[_Update] = []
        self._scheduled: list[_Update] = []
        self._failure: BaseException | None = None  # the last update raised: weights unknown until one succeeds
        self._held: list[_Sequence] = []  # submitted while not admitting (paused, or an update waits)
        self._queue: deque[_Sequence] = deque()  # admitted, waiting for a slot
        self._live: dict[int, _Sequence] = {}  # slot -> sequence; always slots 0..len-1 (_compact)
        self._thread: threading.Thread | None = None
        self._ended: threading.Thread | None = None  # the last scheduler thread, on its way out: close joins it
        # only the scheduler thread touches these while something is in flight
        self._slab: KVSlab | None = None
        self._vocab_mix: torch.Tensor | None = None
        self._sampling: _SamplingParams | None = None  # those of the last step's rows

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_parameters(self) -> int:
        """The served model's parameter count (``rollbook proxy`` sizes its PyTorch threads by it)."""
        return sum(p.numel() for p in self._model.parameters())

    @property
    def admitting(self) -> bool:
        """False while paused or while a weight update waits for a step boundary."""
        with self._cond:
            return self._admitting()

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._admit_held()

    def update_weights(self, weights: Weights, version: int) -> None:
        """See ``GenerationEngine``. A state dict must match the model's keys and shapes exactly. A
        callable that raises may have half-loaded the model: the error is raised here, every request
        in flight fails, and every new one is refused until a later update (e.g. a retry of the same
        version) succeeds. The version stays the last one installed successfully."""
        with self._cond:
            self._refuse_if_closed()
            update = self._enqueue(weights, version, at_step=None)
            if self._thread is None:  # nothing in flight: now, in this thread
                self._apply_due(reached=None)
                self._admit_held()
            self._cond.notify_all()
            self._cond.wait_for(lambda: update.done)
        if update.error is not None:
            raise RuntimeError(f"weight update to version {version} failed") from update.error

    def schedule_weight_update(self, weights: Weights, version: int, *, at_step: int) -> None:
        """Test hook: install ``version`` just before the first step that computes some in-flight
        request's output token ``at_step`` (0 = its prefill) or later; installed when the engine runs
        out of work if no request gets that far. Returns immediately."""
        if at_step < 0:
            raise ValueError(f"at_step must be >= 0, got {at_step}")
        with self._cond:
            self._refuse_if_closed()
            self._enqueue(weights, version, at_step=at_step)

    def submit(
        self, request: GenerationRequest, *, seed: int | None = None, index: int = 0, on_token: TokenCallback | None = None
    ) -> Future[GenerationResult]:
        """Queue one request; its future resolves to its result. ``seed``: its sampling key is
        derived from ``(seed, index)`` (``submit(r, seed=s, index=i)`` draws what request ``i`` of
        ``generate(requests, seed=s)`` does), else from the engine's stream. ``on_token(token_id,
        logprob, version)`` (and the position's ``TopLogprobs`` with ``request.top_logprobs``) is
        called from the scheduler thread as each token is sampled; keep it quick. Returns at once,
        paused or not."""
        keys = None if seed is None else [request_key(seed, index)]
        return self._submit([request], keys, [on_token])[0]

    def generate(self, requests: list[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """See ``GenerationEngine``: the requests are submitted together and decode in the running
        batch beside every other caller's; results in request order. ``seed``: request ``i``'s
        sampling key is derived from ``(seed, i)``. Raises the first failed request's error."""
        keys = None if seed is None else [request_key(seed, i) for i in range(len(requests))]
        futures = self._submit(requests, keys, [None] * len(requests))
        wait_for_futures(futures)
        return [f.result() for f in futures]

    def release_memory(self) -> int:
        """Free the KV cache (allocated again by the next request); returns the bytes freed. Only
        while nothing is in flight: a ``RuntimeError`` otherwise. On CUDA the memory goes back to
        torch's caching allocator, where the same process (a colocated trainer) reuses it."""
        with self._cond:
            if self._live or self._queue:
                raise RuntimeError(
                    f"release_memory: {len(self._live) + len(self._queue)} requests are in flight; call it between generations"
                )
            freed = self._slab.nbytes if self._slab is not None else 0
            self._slab = None
        return freed

    def close(self) -> None:
        """Stop the scheduler thread at the next step boundary, fail what is still queued or in flight
        with a ``RuntimeError`` and free the KV cache; later calls are refused. Idempotent."""
        with self._cond:
            self._closed = True
            threads = [t for t in (self._thread, self._ended) if t is not None]
            self._cond.notify_all()
        # a thread still unwinding when the interpreter exits can abort the process from C++
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()
        with self._cond:
            self._fail_all(RuntimeError("the engine was closed"))
            self._slab = None

    def __enter__(self) -> NativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- admission and updates (callers hold _cond) ---------------------------------------------------

    def _admitting(self) -> bool:
        return not self._paused and not self._pending

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def _submit(
        self, requests: list[GenerationRequest], keys: list[int] | None, callbacks: list[TokenCallback | None]
    ) -> list[Future[GenerationResult]]:
        for request in requests:
            self._check(request)
        with self._cond:
            self._refuse_if_closed()
            self._raise_if_failed()
            sequences = [
                _Sequence(r, self._rng.getrandbits(32) if keys is None else keys[i], callbacks[i]) for i, r in enumerate(requests)
            ]
            self._held += sequences
            self._admit_held()
        return [s.future for s in sequences]

    def _check(self, request: GenerationRequest) -> None:
        if max(request.prompt_token_ids) >= self._num_vocab or min(request.prompt_token_ids) < 0:
            raise ValueError(f"request {request.request_id}: a prompt token id is outside [0, {self._num_vocab})")
        length = len(request.prompt_token_ids) + request.max_new_tokens
        if length > self._max_seq_len:
            raise ValueError(
                f"request {request.request_id}: {len(request.prompt_token_ids)} prompt tokens + max_new_tokens "
                f"{request.max_new_tokens} = {length} exceeds the engine's max_seq_len {self._max_seq_len}; "
                "shorten the request or build the engine with a larger max_seq_len"
            )

    def _admit_held(self) -> None:
        """Move held requests to the queue when admitting, and make sure the scheduler runs."""
        if self._admitting() and self._held:
            self._queue.extend(self._held)
            self._held = []
        if self._queue and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollbook-engine", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _enqueue(self, weights: Weights, version: int, *, at_step: int | None) -> _Update:
        if not callable(weights):
            self._check_state_dict(weights)
        newest = max([self._version] + [u.version for u in self._pending + self._scheduled])
        if version <= newest:
            raise ValueError(f"weight version must increase: got {version}, newest known is {newest}")
        update = _Update(weights, version, at_step)
        (self._pending if at_step is None else self._scheduled).append(update)
        return update

    def _apply_due(self, reached: int | None, everything: bool = False) -> bool:
        """Install the updates due at this step boundary, where ``reached`` is the highest output
        index the coming step computes (None: no step follows); True if any."""
        due = list(self._pending)
        due += [u for u in self._scheduled if everything or (reached is not None and u.at_step <= reached)]  # type: ignore[operator]  # scheduled ones have an at_step
        if not due:
            return False
        # versions only grow: a scheduled update older than one due now goes in first, in order
        newest = max(u.version for u in due)
        due += [u for u in self._scheduled if u not in due and u.version < newest]
        self._pending = []
        self._scheduled = [u for u in self._scheduled if u not in due]
        for update in sorted(due, key=lambda u: u.version):
            try:
                self._load(update.weights)
                self._version, self._failure = update.version, None
            except Exception as exc:  # handed to the updater, and fails generation until fixed
                self._failure = update.error = exc
            update.done = True
        if self._failure is not None:
            self._fail_all(self._failed_weights_error())
        self._cond.notify_all()
        return True

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failed_weights_error()

    def _failed_weights_error(self) -> RuntimeError:
        error = RuntimeError("a weight update failed; the engine's weights are unknown until an update succeeds")
        error.__cause__ = self._failure
        return error

    def _fail_all(self, error: BaseException) -> None:
        for sequence in [*self._held, *self._queue, *self._live.values()]:
            _settle(sequence.future, error=error)
        self._held, self._queue, self._live = [], deque(), {}

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

    # -- the scheduler thread -------------------------------------------------------------------------

    def _run(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while (step := self._next_step()) is not None:
                    self._run_step(step)
                    if self.on_step_end is not None:
                        self.on_step_end()
        finally:
            if self.on_step_end is not None:  # what the last boundary settled (a close, a failed update)
                self.on_step_end()

    def _next_step(self) -> _Step | None:
        """At a step boundary: install due updates, admit into free slots, and say what runs next
        (None: nothing; the thread then ends)."""
        with self._cond:
            updated = self._apply_due(reached=None)
            if self._closed:
                self._fail_all(RuntimeError("the engine was closed"))
            self._admit_held()
            new = self._admit_queued()
            # the highest output index the coming step computes (only scheduled updates ask)
            reached = max([s.num_tokens for s in self._live.values()], default=None) if self._scheduled else None
            updated = self._apply_due(reached) or updated
            if not self._live:  # nothing admitted, or an update failed and failed everything
                self._thread, self._ended = None, threading.current_thread()
                self._sampling = None
                self._cond.notify_all()
                return None
            refresh = updated and self._refresh_cache_on_update
            prefill = [s for s in self._live.values() if refresh or s in new]
            decode = [s for s in self._live.values() if not (refresh or s in new)]
            return _Step(prefill, sorted(decode, key=lambda s: s.slot), self._version)

    def _admit_queued(self) -> set[_Sequence]:
        new: set[_Sequence] = set()
        prompt_tokens = 0
        while self._queue and len(self._live) < self._max_batch_size:
            sequence = self._queue[0]
            n = len(sequence.request.prompt_token_ids)
            if new and prompt_tokens + n > MAX_PREFILL_TOKENS:
                break
            self._queue.popleft()
            if not sequence.future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            sequence.slot = len(self._live)
            self._live[sequence.slot] = sequence
            new.add(sequence)
            prompt_tokens += n
        return new

    def _run_step(self, step: _Step) -> None:
        rows = step.prefill + step.decode
        try:
            tokens, logprobs, tops = self._forward_and_sample(step)
        except Exception as exc:  # a failed forward fails the sequences it carried, not the engine
            self._finish([(s, exc) for s in rows])
            return
        done: list[tuple[_Sequence, BaseException | None]] = []
        for i, (sequence, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
            try:
                if sequence.record(int(token), logprob, step.version, None if tops is None else tops[i]):
                    done.append((sequence, None))
            except Exception as exc:  # its stop or on_token callable raised
                done.append((sequence, exc))
        self._finish(done)

    def _forward_and_sample(self, step: _Step) -> tuple[list[float], list[float], list[TopLogprobs | None] | None]:
        import torch

        from rollbook.rollout.kv_slab import KVSlab, forward

        if self._slab is None:
            try:
                self._slab = KVSlab.allocate(self._model, num_slots=self._max_batch_size, max_len=self._max_seq_len)
            except RuntimeError as exc:  # out of memory, on any device
                raise RuntimeError(
                    f"the KV cache ({self._max_batch_size} slots x {self._max_seq_len} positions) does not fit on "
                    f"{self._device}; build the engine with a smaller max_batch_size or max_seq_len"
                ) from exc
        logits = forward(
            self._model,
            self._slab,
            prefill=[(s.slot, s.fed_token_ids) for s in step.prefill],
            decode=[(s.slot, s.tokens[-1], s.num_fed) for s in step.decode],
        )
        rows = step.prefill + step.decode
        chosen, logprob, logp = self._sample(logits, rows)
        tops = _top_logprobs(logp, rows) if any(s.request.top_logprobs for s in rows) else None
        if chosen.device.type == "cpu":  # nothing to wait for: read both as they are
            return chosen.tolist(), logprob.tolist(), tops
        host = torch.stack([chosen.double(), logprob.double()]).tolist()  # the step's one host synchronization
        return host[0], host[1], tops

    def _sample(self, logits: torch.Tensor, rows: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[N]``, their recorded log-probabilities ``[N]`` and the distributions ``[N, V]``
        they were sampled from (see the module docstring)."""
        import torch

        device = logits.device
        params = self._sampling
        if params is None or params.rows != rows:  # the same rows as the last step: their tensors are reused
            params = self._sampling = _SamplingParams.of(rows, device)
        if params.top_p is not None:
            logp = sampling_logprobs(logits, params.temperature, params.top_p, params.top_k)  # type: ignore[arg-type]  # set with top_p
        elif params.divisor is None:  # every temperature 0 or 1: the same values as sampling_logprobs, fewer passes
            logp = logits.log_softmax(dim=-1, dtype=torch.float32)
        else:
            logp = (logits.float() / params.divisor[:, None]).log_softmax(dim=-1)
        if params.keys is None:  # all greedy
            chosen = logp.argmax(dim=-1)
        else:
            if self._vocab_mix is None or self._vocab_mix.numel() != logp.shape[-1]:
                self._vocab_mix = vocab_mix(logp.shape[-1], device)
            chosen = gumbel_max(logp, params.next_row_hashes(), self._vocab_mix)
            if params.greedy is not None:
                chosen = torch.where(params.greedy, logp.argmax(dim=-1), chosen)
        return chosen, logp.gather(-1, chosen[:, None])[:, 0], logp

    def _finish(self, done: list[tuple[_Sequence, BaseException | None]]) -> None:
        """Free the slots of finished sequences, then resolve their futures (after any update that
        the end of the work installs, so a caller sees the engine as it left it)."""
        with self._cond:
            for sequence, _ in done:
                self._live.pop(sequence.slot, None)
            self._compact()
            if not self._live and not self._queue:  # out of work: what no request reached goes in now
                self._apply_due(reached=None, everything=True)
        for sequence, error in done:
            _settle(sequence.future, error=error, result=sequence.result() if error is None else None)

    def _compact(self) -> None:
        """Move the live sequences above the freed slots down into them (their cached prefix with
        them), so the live slots stay 0..n-1 and decoding reads the slab as one view, never a gather."""
        n = len(self._live)
        holes = [slot for slot in range(n) if slot not in self._live]
        movers = sorted(slot for slot in self._live if slot >= n)
        for hole, slot in zip(holes, movers, strict=True):
            sequence = self._live.pop(slot)
            if self._slab is not None:
                self._slab.move(slot, hole, sequence.num_fed)
            sequence.slot = hole
            self._live[hole] = sequence


@dataclass(eq=False)
class _Sequence:
    """One request in the engine: its sampling key, slot and the evidence gathered so far."""

    request: GenerationRequest
    key: int  # 32-bit sampling key (rollout/sampling.py)
    on_token: TokenCallback | None
    future: Future[GenerationResult] = field(default_factory=Future)
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] = "length"

    def __post_init__(self) -> None:
        self._stop_ids = frozenset(self.request.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        """Output tokens sampled so far: the output index of the next one."""
        return len(self.tokens)

    @property
    def num_fed(self) -> int:
        """Tokens whose keys and values are in the cache during decoding (all but the newest)."""
        return len(self.request.prompt_token_ids) + len(self.tokens) - 1

    @property
    def fed_token_ids(self) -> list[int]:
        """What a prefill feeds: the prompt and every output token so far."""
        return list(self.request.prompt_token_ids) + self.tokens

    def record(self, token: int, logprob: float, version: int, top: TopLogprobs | None = None) -> bool:
        """Append one sampled token; True when the sequence is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.tops.append(top)
        if self.on_token is not None:
            if top is None:
                self.on_token(token, logprob, version)
            else:
                self.on_token(token, logprob, version, top)
        request = self.request
        if token in self._stop_ids or (request.stop is not None and bool(request.stop(self.tokens))):
            self.finish_reason = "stop"
            return True
        return len(self.tokens) >= request.max_new_tokens

    def result(self) -> GenerationResult:
        r = self.request
        return GenerationResult(
            request_id=r.request_id,
            prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=self.tokens,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            finish_reason=self.finish_reason,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            output_top_logprobs=self.tops if r.top_logprobs else None,
        )


def _top_logprobs(logp: torch.Tensor, rows: list[_Sequence]) -> list[TopLogprobs | None]:
    """Per row, its request's ``top_logprobs`` most likely (token, logprob) of ``logp`` (one top-k for
    the step, one host copy); tokens the row cannot sample (log-prob -inf) are left out."""
    k = max(s.request.top_logprobs for s in rows)
    values, ids = logp.topk(k, dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    out: list[TopLogprobs | None] = []
    for s, vs, ts in zip(rows, values_l, ids_l):
        n = s.request.top_logprobs
        out.append([(t, v) for t, v in zip(ts[:n], vs[:n]) if v != float("-inf")] if n else None)
    return out


_HASHES_AHEAD = 16  # sampling row hashes computed per row at once (_SamplingParams.next_row_hashes)


@dataclass(eq=False)
class _SamplingParams:
    """The sampling parameters of a list of rows as tensors, built when the rows change (a decode
    step usually samples the rows of the step before)."""

    rows: list[_Sequence]
    temperature: torch.Tensor  # [N] float32, as the requests give it
    divisor: torch.Tensor | None  # [N]: what the logits are divided by (1 for greedy); None: no division
    top_p: torch.Tensor | None  # [N] float32, with top_k [N] int64; None: no row truncates
    top_k: torch.Tensor | None
    keys: torch.Tensor | None  # [N] int64 sampling keys; None: every row is greedy
    greedy: torch.Tensor | None  # [N] bool, where greedy and sampled rows mix
    # row_hashes (rollout/sampling.py) of the next output indices, [N, W], computed W steps at a time
    ahead: torch.Tensor | None = None
    ahead_from: int = 0  # the rows' output tokens in all when ``ahead`` was computed
    ahead_used: int = 0  # its columns used since

    def next_row_hashes(self) -> torch.Tensor:
        """``[N]``: the row hashes of each row's next output index. Every row of a step gains one
        token per step, so column ``i`` of ``ahead`` serves the ``i``-th step after it was computed
        (checked against the rows' token counts; computed again when they disagree)."""
        used = self.ahead_used
        counts = [len(s.tokens) for s in self.rows]
        done = sum(counts)
        if self.ahead is None or used == self.ahead.shape[1] or done != self.ahead_from + used * len(counts):
            import torch

            from rollbook.rollout.kv_slab import to_device

            first = to_device(counts, self.keys.device)  # type: ignore[union-attr]  # only called with keys
            steps = torch.arange(_HASHES_AHEAD, device=first.device)
            self.ahead, self.ahead_from, used = row_hashes(self.keys, first[:, None] + steps), done, 0  # type: ignore[arg-type]
        self.ahead_used = used + 1
        return self.ahead[:, used]

    @classmethod
    def of(cls, rows: list[_Sequence], device: torch.device) -> _SamplingParams:
        import torch

        from rollbook.rollout.kv_slab import to_device

        requests = [s.request for s in rows]
        temperatures = [r.temperature for r in requests]
        temperature = to_device(temperatures, device, torch.float32)
        top_p = top_k = divisor = None
        if any(r.top_p < 1 or r.top_k > 0 for r in requests):
            top_p = to_device([r.top_p for r in requests], device, torch.float32)
            top_k = to_device([r.top_k for r in requests], device)
        elif not all(t in (0.0, 1.0) for t in temperatures):
            divisor = torch.where(temperature > 0, temperature, 1.0)
        sampled = [t > 0 for t in temperatures]
        keys = to_device([s.key for s in rows], device) if any(sampled) else None
        greedy = temperature == 0 if any(sampled) and not all(sampled) else None
        return cls(list(rows), temperature, divisor, top_p, top_k, keys, greedy)


@dataclass
class _Step:
    prefill: list[_Sequence]  # newly admitted (or, after a refreshing update, every live sequence)
    decode: list[_Sequence]  # one token each, by slot
    version: int  # of the weights this step runs under


def _settle(future: Future, *, error: BaseException | None = None, result: Any = None) -> None:
    """Resolve ``future`` unless it was cancelled (possible while its request was still queued)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
