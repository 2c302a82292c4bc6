"""Sequence packing for the trainer: many prompt+output sequences in one row, no padding.

    batches = pack_sequences(prompts, outputs, max_tokens=4096, behavior_logprobs=..., advantages=...)
    for packed in batches:
        logp = packed_logprobs(model, packed, packed.temperature)   # [T_out], with grad

Each micro-batch is ONE row ``[1, T]``: its sequences (prompt tokens, then output tokens) laid end
to end, ``position_ids`` restarting at 0 for each. No token sees another sequence, and no mask is
built: during the packed forward the model's attention is ``PACKED_ATTENTION``, registered with
transformers, which runs causal scaled-dot-product attention on each sequence (those of one length
together, as one batch). Everything the losses need is per OUTPUT token, flat ``[T_out]``, in the
order of ``output_token_ids``: the packed form of the store's per-token columns.

Temperature convention
----------------------
The rollout engine records the log-probability of each token under the distribution it sampled
from (``rollout/engine.py``, "What output_logprobs holds"). The trainer matches it by dividing the
logits by the SAME temperature the engine used (``temperature`` per token, e.g.
``packed.temperature``), so at equal weights the recomputed log-probs equal the behavior log-probs
(``tests/integration/test_logprob_consistency.py`` holds both sides to 1e-4). A temperature of 0
(greedy) is treated as 1, as the engine records greedy tokens with temperature-1 log-probs.

Top-p / top-k truncation is NOT applied in training. The trainer's policy is the full softmax, a
smooth function of the weights; the truncated one is not (its support changes with the weights).
The consequence: with ``top_p < 1`` or ``top_k > 0`` the behavior log-probs are of the TRUNCATED,
renormalized distribution, which puts more mass on each kept token than the full one, so
``log pi_behav >= log pi_full`` token by token even at equal weights. The importance weight
``pi_prox / pi_behav`` of decoupled PPO then sits below 1 by the mass the truncation removed
(``log w = log(kept mass)`` at that step), rather than measuring staleness alone. It stays a valid
ratio (the sampler only ever draws kept tokens), but train with ``top_p = 1`` and ``top_k`` off when
the ratio should be exactly 1 for fresh tokens.

Memory: attention scores exist per sequence (``sum L_i**2``, inside SDPA), never ``T**2``. The
logits exist ``chunk_tokens`` output positions at a time (``chunk_tokens * V`` floats, not ``T_out *
V``: 16k tokens of a 152k vocabulary would be 10 GB in float32): the decoder runs once, then the LM
head per chunk under activation checkpointing, so autograd keeps each chunk's hidden rows and the
backward recomputes its logits (the LM head's forward runs twice per chunk when training).
``bench/packed_memory.py`` measures the peak against a dense mask with whole-batch logits.

Tests: ``python -m pytest tests/unit/trainer/test_packing.py -q``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from rollbook.attention import causal_per_sequence, refuse_score_modifiers


@dataclass
class PackedMicroBatch:
    """One micro-batch: N sequences packed in a single row of T tokens, T_out of them outputs.

    Sequence i is ``input_ids[0, cu_seqlens[i]:cu_seqlens[i+1]]``: its prompt, then its output.
    Per-output-token fields are ``[T_out]`` and ordered sequence by sequence; the optional ones are
    None when ``pack_sequences`` was not given them.
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long; 0 at each sequence's first token
    cu_seqlens: torch.Tensor  # [N + 1] int32; cu_seqlens[0] = 0, cu_seqlens[N] = T
    output_index: torch.Tensor  # [T_out] long; position in the row whose logits PREDICT the token (its position - 1)
    output_token_ids: torch.Tensor  # [T_out] long; input_ids[0, output_index + 1]
    seq_index: torch.Tensor  # [T_out] long; sequence (0..N-1, in this batch) of each output token
    sequence_ids: torch.Tensor  # [N] long; index of each sequence in pack_sequences' input lists
    behavior_logprobs: torch.Tensor | None = None  # [T_out] float32; the engine's output_logprobs
    versions: torch.Tensor | None = None  # [T_out] long; the engine's output_versions
    advantages: torch.Tensor | None = None  # [T_out] float32; each sequence's advantage, repeated
    temperature: torch.Tensor | None = None  # [T_out] float32; each sequence's sampling temperature

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_output_tokens(self) -> int:
        return self.output_token_ids.numel()

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[T_out]`` all True: packing holds no padding, every output token counts."""
        return torch.ones_like(self.output_token_ids, dtype=torch.bool)

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        return dataclasses.replace(self, **{k: v.to(device) for k, v in _tensor_fields(self).items()})

    def select(self, sequences: Sequence[int]) -> PackedMicroBatch:
        """A packed batch of only these sequences (indices in this batch), in the order given."""
        starts, ends = self.cu_seqlens[:-1].tolist(), self.cu_seqlens[1:].tolist()
        counts = torch.bincount(self.seq_index.cpu(), minlength=self.num_sequences)
        out_starts, counts = _cumsum0(counts)[:-1].tolist(), counts.tolist()  # type: ignore[assignment]  # now a list of ints
        rows, outs, shifts, new_start = [], [], [], 0
        for i in sequences:
            rows.append(torch.arange(starts[i], ends[i]))
            outs.append(torch.arange(out_starts[i], out_starts[i] + counts[i]))
            shifts.append(torch.full((counts[i],), new_start - starts[i]))  # type: ignore[arg-type]  # counts is a list here
            new_start += ends[i] - starts[i]
        device = self.input_ids.device
        row, out = torch.cat(rows).to(device), torch.cat(outs).to(device)
        per_token = {f: getattr(self, f)[out] for f in _OPTIONAL_PER_TOKEN if getattr(self, f) is not None}
        return PackedMicroBatch(
            input_ids=self.input_ids[:, row],
            position_ids=self.position_ids[:, row],
            cu_seqlens=_cumsum0(torch.tensor([ends[i] - starts[i] for i in sequences])).to(device),
            output_index=self.output_index[out] + torch.cat(shifts).to(device),
            output_token_ids=self.output_token_ids[out],
            seq_index=torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([counts[i] for i in sequences])).to(
                device
            ),
            sequence_ids=self.sequence_ids[torch.tensor(list(sequences), dtype=torch.long, device=device)],
            **per_token,
        )


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    *,
    max_tokens: int | None = None,
    behavior_logprobs: Sequence[Sequence[float]] | None = None,
    versions: Sequence[Sequence[int]] | None = None,
    advantages: Sequence[float] | None = None,
    temperatures: Sequence[float] | None = None,
) -> list[PackedMicroBatch]:
    """Pack sequences into micro-batches of at most ``max_tokens`` tokens each (None: one batch).

    A sequence is never split. Sequences go to micro-batches first-fit by decreasing length (few,
    evenly filled micro-batches) and keep their input order inside each; ``sequence_ids`` maps back.

    Args:
        prompts: N prompts, each non-empty (its last token's logits predict the first output token).
        outputs: N outputs (sampled tokens); ``len(prompt) + len(output)`` must fit ``max_tokens``.
        max_tokens: bound on T of each micro-batch; None packs everything in one.
        behavior_logprobs: optional, N lists with ``len(outputs[i])`` log-probs each.
        versions: optional, N lists with ``len(outputs[i])`` policy versions each.
        advantages: optional, one float per sequence, repeated over its output tokens.
        temperatures: optional, the sampling temperature of each sequence, repeated likewise.
    """
    _check_inputs(prompts, outputs, behavior_logprobs, versions, advantages, temperatures)
    lengths = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    groups = _first_fit_decreasing(lengths, max_tokens)
    return [_pack_group(g, prompts, outputs, behavior_logprobs, versions, advantages, temperatures) for g in groups]


DEFAULT_CHUNK_TOKENS = 1024  # TrainerConfig.logprob_chunk_tokens's default


class Distributions(Protocol):
    """A teacher's whole next-token distributions over a micro-batch's output positions, computed on
    demand, a few rows at a time (teachers.py ``score_full``)."""

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[len(index), V]`` float32, no grad, at these output positions (``[T_out]`` order)."""
        ...


def packed_logprobs(
    model: torch.nn.Module,
    packed: PackedMicroBatch,
    temperature: float | torch.Tensor = 1.0,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each output token, ``[T_out]`` float32, with grad
    when grad is enabled; on the model's device.

    One forward pass over the packed row (document-masked attention, the module docstring), then
    the LM head ``chunk_tokens`` output positions at a time (see "Memory").

    Args:
        model: a ``transformers`` causal LM whose logits are its output embedding of its decoder's
            last hidden state (Llama, Qwen2, Mistral, ... ; ``final_logit_softcapping`` applied).
        packed: the micro-batch.
        temperature: a float, or ``[T_out]`` per token (``packed.temperature``); >= 0, 0 counts as 1.
        chunk_tokens: output positions whose logits are held at once.
    """
    return _chunked(model, packed, temperature, None, chunk_tokens)[0]


def packed_logprobs_and_kl(
    model: torch.nn.Module,
    packed: PackedMicroBatch,
    temperature: float | torch.Tensor,
    teacher: Distributions,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the full-vocabulary distillation: ``(log-probs, reverse KL, teacher log-probs)``, each
    ``[T_out]`` float32. The first two carry grad: the student's log-prob of each sampled token and
    ``KL(pi_student || pi_teacher)`` over the whole vocabulary at each output position
    (``losses.reverse_kl``); the third is the teacher's log-prob of the sampled token. Student and
    teacher distributions exist ``chunk_tokens`` rows at a time, never for the whole micro-batch."""
    logp, kl, teacher_logp = _chunked(model, packed, temperature, teacher, chunk_tokens)
    assert kl is not None and teacher_logp is not None
    return logp, kl, teacher_logp


def packed_hidden(model: torch.nn.Module, packed: PackedMicroBatch) -> torch.Tensor:
    """The decoder's last hidden state at each position whose logits predict an output token,
    ``[T_out, H]``, with grad when grad is enabled. One forward of ``model`` itself (so hooks a
    wrapper such as FSDP puts on it run) with document-masked attention; the LM head runs on no
    position (``logits_to_keep`` an empty index) where the model takes ``logits_to_keep``."""
    device = next(model.parameters()).device
    packed = packed.to(device)
    captured: list[torch.Tensor] = []

    def keep(_module, _inputs, output) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = model.get_decoder().register_forward_hook(keep)  # type: ignore[operator]  # a transformers PreTrainedModel
    kwargs: dict = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = packed.output_index[:0]
    try:
        with _packed_attention_on(model):
            model(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                use_cache=False,
                rollbook_segments=_Segments.of(packed.cu_seqlens),
                **kwargs,
            )
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"{type(model).__name__}: its decoder ran {len(captured)} times in one forward; expected once")
    return captured[0][0, packed.output_index]


def head_log_softmax(model: torch.nn.Module, hidden: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)``, ``[N, V]`` float32, of ``hidden`` ``[N, H]`` (rows of
    ``packed_hidden``) through ``model``'s LM head; the logits may be bfloat16 (autocast), the
    softmax is float32."""
    logits = model.get_output_embeddings()(hidden).float()  # type: ignore[operator]  # a transformers PreTrainedModel
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return (logits / _temperatures(temperature, logits)).log_softmax(dim=-1)


# --- document-masked attention --------------------------------------------------------------------

PACKED_ATTENTION = "rollbook_packed"
"""The attention implementation a packed forward runs under (``_packed_attention_on``): registered
with transformers' ``AttentionInterface`` and, as a mask function that builds no mask, its
``AttentionMaskInterface``."""


@dataclass
class _Segments:
    """Where the sequences of a packed row are, grouped by length: each group attends as one batch
    ``[n, heads, L, dim]`` of causal SDPA calls (a lone sequence is a slice of the row, no copy)."""

    groups: list[slice | torch.Tensor]  # a slice of the row, or [n, L] token positions
    order: torch.Tensor | None  # [T]: where each row position lands in the groups' concatenation; None: in order

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor) -> _Segments:
        bounds = cu_seqlens.tolist()
        by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:]):
            by_length.setdefault(end - start, []).append(start)
        groups: list[slice | torch.Tensor] = []
        device = cu_seqlens.device
        for length, starts in by_length.items():
            if len(starts) == 1:
                groups.append(slice(starts[0], starts[0] + length))
            else:
                groups.append(torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device))
        if len(groups) == 1 and isinstance(groups[0], slice):
            return cls(groups, None)
        flat = torch.cat(
            [torch.arange(g.start, g.stop, device=device) if isinstance(g, slice) else g.reshape(-1) for g in groups]
        )
        order = torch.empty_like(flat)
        order[flat] = torch.arange(flat.numel(), device=device)
        return cls(groups, order)


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Causal attention within each sequence of a packed row: ``query`` ``[1, heads, T, dim]``,
    ``key``/``value`` ``[1, kv_heads, T, dim]``; returns ``([1, T, heads, dim], None)`` as
    transformers' attention functions do. Scores exist per sequence (``sum L_i**2``), never ``T**2``.

    A layer with a ``sliding_window`` (Mistral, Qwen2's sliding layers) sees the keys less than that
    many positions back, as transformers' own mask has it: a band mask ``[L, L]`` for a group longer
    than the window. Score modifiers this function does not apply are refused, not dropped."""
    segments = kwargs.get("rollbook_segments")
    if segments is None:
        raise RuntimeError("packed attention runs only inside trainer/packing.py's forward (no segments given)")
    refuse_score_modifiers(module, kwargs, "packed training")
    window = kwargs.get("sliding_window")
    q, k, v = query[0], key[0], value[0]
    if k.shape[0] != q.shape[0]:  # grouped-query attention: each key/value head serves consecutive query heads
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    out = causal_per_sequence(q, k, v, segments.groups, scaling, window, dropout=dropout)
    if segments.order is not None:
        out = out[segments.order]
    return out[None], None


def _no_mask(*args, **kwargs) -> None:
    """The packed forward's mask function: the segments say everything, no mask is built."""
    return None


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


@contextlib.contextmanager
def _packed_attention_on(model: torch.nn.Module):
    """Run ``model`` with the packed attention for the duration (its config says which attention its
    layers call, so the rollout engine's copy, exports and other forwards are untouched)."""
    config: Any = model.config  # a transformers PreTrainedModel's PretrainedConfig
    before = config._attn_implementation
    if before not in ("eager", "sdpa", PACKED_ATTENTION):
        raise ValueError(
            f"packed training runs attention itself (causal SDPA per sequence) in place of {before!r}; load the "
            "model with attn_implementation='sdpa' or 'eager'"
        )
    if model.training and torch.is_grad_enabled() and _checkpoints_activations(model):
        # its backward would recompute the layers after the attention went back to the original one
        raise ValueError(
            f"{type(model).__name__} has gradient checkpointing on, which packed training does not combine with "
            "(the backward recomputes attention outside the packed forward); turn it off for training"
        )
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def _checkpoints_activations(model: torch.nn.Module) -> bool:
    """Whether transformers' activation (gradient) checkpointing is on for ``model``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the newer name first: the older warns
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _temperatures(temperature: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The divisor of ``like``'s rows (``[N, V]``): per row ``[N, 1]``, or a scalar; 0 counts as 1."""
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=like.device)
    if bool((temp < 0).any()):
        raise ValueError("temperature must be >= 0 (0 = greedy, scored at temperature 1)")
    temp = torch.where(temp > 0, temp, 1.0)
    return temp[:, None] if temp.ndim else temp


def _chunked(model, packed: PackedMicroBatch, temperature, teacher: Distributions | None, chunk_tokens: int):
    """``packed_logprobs`` and ``packed_logprobs_and_kl``: hidden states once, then the head per chunk
    under activation checkpointing when grad is on (autograd keeps each chunk's hidden rows, and the
    backward recomputes its logits), so at most ``chunk_tokens * V`` logits exist at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    hidden = packed_hidden(model, packed)
    device = hidden.device
    tokens = packed.output_token_ids.to(device)
    n = tokens.numel()
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    temp = temp.expand(n) if temp.ndim == 0 else temp
    positions = torch.arange(n, device=device)
    outs: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, n, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (model, hidden[part], temp[part], tokens[part], positions[part], teacher)
        if torch.is_grad_enabled() and hidden.requires_grad and n > chunk_tokens:
            outs.append(checkpoint(_chunk_terms, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(_chunk_terms(*args))
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if teacher is not None else None), (empty if teacher is not None else None)
    logp = torch.cat([o[0] for o in outs])
    if teacher is None:
        return logp, None, None
    return logp, torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs])


def _chunk_terms(model, hidden, temp, tokens, positions, teacher):
    from rollbook.trainer.losses import reverse_kl

    log_probs = head_log_softmax(model, hidden, temp)  # [C, V]
    logp = log_probs.gather(-1, tokens[:, None])[:, 0]
    if teacher is None:
        return (logp,)
    teacher_rows = teacher.rows(positions)
    return logp, reverse_kl(log_probs, teacher_rows), teacher_rows.gather(-1, tokens[:, None])[:, 0]


# --- private helpers ---------------------------------------------------------------------------

_OPTIONAL_PER_TOKEN = ("behavior_logprobs", "versions", "advantages", "temperature")


def _tensor_fields(packed: PackedMicroBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed) if getattr(packed, f.name) is not None}


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def _first_fit_decreasing(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    if max_tokens is None:
        return [list(range(len(lengths)))] if lengths else []
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens, more than max_tokens={max_tokens}; "
            "sequences are never split: raise max_tokens"
        )
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep input order
        slot = next((g for g, r in enumerate(room) if r >= lengths[i]), None)
        if slot is None:
            groups.append([])
            room.append(max_tokens)
            slot = len(groups) - 1
        groups[slot].append(i)
        room[slot] -= lengths[i]
    return [sorted(g) for g in groups]


def _pack_group(group, prompts, outputs, behavior_logprobs, versions, advantages, temperatures) -> PackedMicroBatch:
    ids, positions, output_index, seq_index = [], [], [], []  # type: ignore[var-annotated]  # lists of ints
    start = 0
    for local, i in enumerate(group):
        seq = list(prompts[i]) + list(outputs[i])
        ids += seq
        positions += range(len(seq))
        output_index += range(start + len(prompts[i]) - 1, start + len(seq) - 1)
        seq_index += [local] * len(outputs[i])
        start += len(seq)
    per_token: dict[str, torch.Tensor] = {}
    if behavior_logprobs is not None:
        per_token["behavior_logprobs"] = torch.tensor([x for i in group for x in behavior_logprobs[i]], dtype=torch.float32)
    if versions is not None:
        per_token["versions"] = torch.tensor([x for i in group for x in versions[i]], dtype=torch.long)
    for name, per_seq in (("advantages", advantages), ("temperature", temperatures)):
        if per_seq is not None:
            per_token[name] = torch.tensor([float(per_seq[i]) for i in group for _ in outputs[i]], dtype=torch.float32)
    input_ids = torch.tensor([ids], dtype=torch.long)
    output_index_t = torch.tensor(output_index, dtype=torch.long)
    return PackedMicroBatch(
        input_ids=input_ids,
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=_cumsum0(torch.tensor([len(prompts[i]) + len(outputs[i]) for i in group])),
        output_index=output_index_t,
        output_token_ids=input_ids[0, output_index_t + 1],
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        sequence_ids=torch.tensor(group, dtype=torch.long),
        **per_token,
    )


def _check_inputs(prompts, outputs, behavior_logprobs, versions, advantages, temperatures) -> None:
    n = len(prompts)
    for name, values in (
        ("outputs", outputs),
        ("behavior_logprobs", behavior_logprobs),
        ("versions", versions),
        ("advantages", advantages),
        ("temperatures", temperatures),
    ):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts; need one per sequence")
    for i in range(n):
        if not prompts[i]:
            raise ValueError(f"prompt {i} is empty: the first output token needs a token to predict it from")
        for name, per_token in (("behavior_logprobs", behavior_logprobs), ("versions", versions)):
            if per_token is not None and len(per_token[i]) != len(outputs[i]):
                raise ValueError(
                    f"{name}[{i}] has {len(per_token[i])} values for {len(outputs[i])} output tokens; need one per output token"
                )


_register_packed_attention()
