"""Sequence packing for the trainer: many prompt+output sequences in one row, no padding.

    batches = pack_sequences(prompts, outputs, max_tokens=4096, behavior_logprobs=..., advantages=...)
    for packed in batches:
        logp = packed_logprobs(model, packed, packed.temperature)   # [T_out], with grad

Each micro-batch is ONE row ``[1, T]``: its sequences (prompt tokens, then output tokens) laid end
to end, ``position_ids`` restarting at 0 for each, and a block-diagonal causal attention mask so no
token sees another sequence. Everything the losses need is per OUTPUT token, flat ``[T_out]``, in
the order of ``output_token_ids``: the packed form of the store's per-token columns.

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

Memory: the mask is a dense ``[1, 1, T, T]`` float tensor (``4 * T**2`` bytes in fp32: 64 MiB at
T = 4096); bound ``T`` with ``max_tokens``.

Tests: ``python -m pytest tests/unit/trainer/test_packing.py -q``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MASK_ATTENTION = ("eager", "sdpa")
"""transformers attention implementations that take a custom 4D additive mask as-is."""


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


def packed_logprobs(model: torch.nn.Module, packed: PackedMicroBatch, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` of each output token, ``[T_out]`` float32, with grad.

    One forward pass over the packed row with a block-diagonal causal mask (see the module
    docstring for the temperature convention). The result is on the model's device.

    Args:
        model: a ``transformers`` causal LM whose attention implementation is eager or sdpa.
        packed: the micro-batch.
        temperature: a float, or ``[T_out]`` per token (``packed.temperature``); >= 0, 0 counts as 1.
    """
    return gather_tokens(packed_log_softmax(model, packed, temperature), packed)


def packed_log_softmax(model: torch.nn.Module, packed: PackedMicroBatch, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The whole distribution at each output position: ``[T_out, V]`` float32 log-probs, with grad
    (``packed_logprobs`` is its entry at each sampled token). The full-vocabulary distillation
    (``losses.full_kl_distill_loss``) reads it; it holds ``T_out * V`` floats."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in MASK_ATTENTION:
        raise ValueError(
            f"packed_logprobs needs an attention implementation that takes a 4D mask {MASK_ATTENTION}, "
            f"got {impl!r}; load the model with attn_implementation='sdpa'"
        )
    device = next(model.parameters()).device
    packed = packed.to(device)
    mask = block_causal_mask(packed.cu_seqlens, dtype=model.get_input_embeddings().weight.dtype)  # type: ignore[operator]  # transformers types the method as a Tensor
    logits = _output_logits(model, packed, mask).float()  # [T_out, V]
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    if bool((temp < 0).any()):
        raise ValueError("temperature must be >= 0 (0 = greedy, scored at temperature 1)")
    temp = torch.where(temp > 0, temp, 1.0)
    return (logits / (temp[:, None] if temp.ndim else temp)).log_softmax(dim=-1)


def gather_tokens(log_probs: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """``[T_out, V]`` -> ``[T_out]``: each position's entry at its sampled output token."""
    return log_probs.gather(-1, packed.output_token_ids.to(log_probs.device)[:, None])[:, 0]


def block_causal_mask(cu_seqlens: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask ``[1, 1, T, T]``: 0 where query i may attend key j (same sequence, j <= i),
    ``finfo(dtype).min`` elsewhere (finite, so even a fully masked row could not turn into nan)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    pos = torch.arange(seq.numel(), device=cu_seqlens.device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


# --- private helpers ---------------------------------------------------------------------------

_OPTIONAL_PER_TOKEN = ("behavior_logprobs", "versions", "advantages", "temperature")


def _tensor_fields(packed: PackedMicroBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed) if getattr(packed, f.name) is not None}


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def _output_logits(model: torch.nn.Module, packed: PackedMicroBatch, mask: torch.Tensor) -> torch.Tensor:
    """Logits ``[T_out, V]`` at ``output_index``; the LM head only runs there when the model can."""
    kwargs = {}
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    if keep_logits:  # transformers >= 4.50; a 1-D tensor keeps those positions
        kwargs["logits_to_keep"] = packed.output_index
    out = model(
        input_ids=packed.input_ids,
        attention_mask=mask,
        position_ids=packed.position_ids,
        use_cache=False,
        **kwargs,
    )
    return out.logits[0] if keep_logits else out.logits[0, packed.output_index]


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
