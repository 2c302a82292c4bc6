"""The native engine's KV cache: one slab per layer, allocated once, and the attention that uses it.

    slab = KVSlab.allocate(model, num_slots=64, max_len=2048)
    logits = forward(model, slab, prefill=[(2, [1, 5, 7])], decode=[(0, 17, 9), (1, 4, 12)])   # [3, V]

Each layer holds keys and values ``[slots, kv_heads, max_len, head_dim]`` in the model's dtype and
on its device; a slot is one sequence, position ``p`` of a slot holds its token ``p``. One engine
step is ONE forward pass of one packed row ``[1, T]``: the prompts being prefilled, end to end, then
one token per decoding slot. The model runs with ``use_cache=False`` and explicit ``position_ids``
(the model applies RoPE itself) while its attention is ``SLAB_ATTENTION``, a function registered
with transformers' ``AttentionInterface`` (and, as a mask function that builds no mask, with its
``AttentionMaskInterface``), as trainer/packing.py does for packed training. It is also handed a
placeholder 4D ``attention_mask``, which transformers' mask preparation passes through as already
built, so no step pays for building one (transformers would otherwise scan the positions for
packed sequences, which on CUDA waits for the device); the attention ignores it. The forward's
``rollbook_kv`` keyword reaches that function, which writes every token's keys and values at its
slot and position, then attends:

- prefilled tokens: causal SDPA within their sequence (sequences of one length as one batch), never
  across;
- decoded tokens: each over its slot's prefix, keys past its position masked, read up to the longest
  prefix (not ``max_len``): a view of the slab when the slots are consecutive (the engine keeps them
  so: ``KVSlab.move``), a gather otherwise.

A layer with a ``sliding_window`` sees the keys less than that many positions back, as transformers'
own mask has it. Score modifiers this attention does not apply (softcap, attention sinks) are
refused, not dropped. Tests: ``python -m pytest tests/unit/rollout/test_engine.py -q``.
"""

from __future__ import annotations

import array
import contextlib
import inspect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollbook.attention import causal_per_sequence, refuse_score_modifiers

SLAB_ATTENTION = "rollbook_kv_slab"
"""The attention implementation ``forward`` runs the model under."""


@dataclass
class KVSlab:
    """Keys and values of every layer, ``[slots, kv_heads, max_len, head_dim]`` each."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, model: torch.nn.Module, *, num_slots: int, max_len: int) -> KVSlab:
        """Zeroed (masked positions are multiplied by 0, and garbage could be NaN), in the dtype and
        on the device of ``model``'s parameters."""
        config: Any = model.config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        param = next(model.parameters())
        shape = (num_slots, kv_heads, max_len, head_dim)
        layers = range(config.num_hidden_layers)
        return cls(
            keys=[torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in layers],
            values=[torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in layers],
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def move(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` to slot ``target``, every layer."""
        for cache in self.keys + self.values:
            cache[target, :, :length] = cache[source, :, :length]

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[n * kv_heads]``: where the keys of token ``(slots[i], positions[i])`` sit in a layer's
        ``[slots * kv_heads * max_len, head_dim]`` view, head by head."""
        _, kv_heads, max_len, _ = self.keys[0].shape
        heads = torch.arange(kv_heads, device=slots.device)
        return ((slots[:, None] * kv_heads + heads[None, :]) * max_len + positions[:, None]).reshape(-1)

    def write(self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[n, kv_heads, head_dim]`` at ``rows`` (``rows()``), whole rows
        at a time (cheaper than indexing by slot and position)."""
        for cache, new in ((self.keys[layer], keys), (self.values[layer], values)):
            new = new.reshape(-1, new.shape[-1])
            cache.view(-1, cache.shape[-1]).index_copy_(0, rows, new if new.dtype == cache.dtype else new.to(cache.dtype))


def forward(
    model: torch.nn.Module,
    slab: KVSlab,
    prefill: Sequence[tuple[int, Sequence[int]]] = (),
    decode: Sequence[tuple[int, int, int]] = (),
) -> torch.Tensor:
    """One forward pass of one packed row: every token of each ``prefill`` sequence ``(slot,
    token_ids)`` at positions 0..L-1, then one token per ``decode`` entry ``(slot, token_id,
    position)``; each token's keys and values are written at its slot and position. Returns the
    logits ``[len(prefill) + len(decode), V]``: of each prefilled sequence's last token, then of each
    decoded token, in the order given."""
    device = slab.keys[0].device
    lengths = [len(ids) for _, ids in prefill]
    num_prefill = sum(lengths)
    num_tokens = num_prefill + len(decode)
    decode_slots = [slot for slot, _, _ in decode]
    decode_positions = [p for _, _, p in decode]
    values = [t for _, ids in prefill for t in ids]
    values += [t for _, t, _ in decode]
    values += [p for n in lengths for p in range(n)]
    values += decode_positions
    values += [slot for (slot, _), n in zip(prefill, lengths) for _ in range(n)]
    values += decode_slots
    # the rows whose logits are kept: each prefilled sequence's last token, then every decoded token
    # (all of them when nothing is prefilled)
    keep = [end - 1 for end in itertools.accumulate(lengths)] + list(range(num_prefill, num_tokens)) if prefill else []
    packed = to_device(values + keep, device)
    ids, positions, slots, keep_t = packed.split([num_tokens, num_tokens, num_tokens, len(keep)])
    step = _Packed(slab, slab.rows(slots, positions), num_prefill, _groups(lengths, device) if prefill else [])
    if decode:
        first = decode_slots[0]
        # slots first..first+N-1 in order: the keys are a view of the slab, no gather
        block = first if decode_slots == list(range(first, first + len(decode))) else None
        step.decode = _Decode(slots[num_prefill:], positions[num_prefill:], max(decode_positions) + 1, block)
    return _forward(model, ids[None], positions[None], step, keep_t if prefill else None)[0]


def to_device(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Numbers as one tensor on ``device``: one copy, asynchronous from pinned memory on CUDA (no wait
    for the GPU's queued work). Built through an ``array`` for the usual dtypes (several times faster
    than ``torch.tensor`` on a list; it is on every step's path)."""
    typecode = _TYPECODES.get(dtype)
    if typecode is None or not values:
        host = torch.tensor(values, dtype=dtype)
    else:
        host = torch.frombuffer(array.array(typecode, values), dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


# --- the forward and its attention ----------------------------------------------------------------


@dataclass
class _Packed:
    """What the attention of one packed forward needs: where the tokens' keys go, and who attends to
    what (the first ``num_prefill`` tokens: causally within their sequence; the rest: one decoded
    token per slot, over that slot's cached prefix)."""

    slab: KVSlab
    rows: torch.Tensor  # [T * kv_heads]: where the row's keys go (KVSlab.rows)
    num_prefill: int
    groups: list[slice | torch.Tensor]  # prefilled sequences of one length: a slice of the row, or [n, L] indices
    decode: _Decode | None = None
    order: torch.Tensor | None = None  # [num_prefill]: where each row position lands in the groups' concatenation

    def __post_init__(self) -> None:
        if len(self.groups) <= 1 and all(isinstance(g, slice) for g in self.groups):
            return
        device = self.rows.device
        flat = torch.cat(
            [torch.arange(g.start, g.stop, device=device) if isinstance(g, slice) else g.reshape(-1) for g in self.groups]
        )
        self.order = torch.empty_like(flat)
        self.order[flat] = torch.arange(flat.numel(), device=device)

    def attend(self, layer: int, query, key, value, scale, window: int | None) -> torch.Tensor:
        """``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, kv_heads, T, D]`` -> ``[1, T, H, D]``."""
        q, k, v = query[0], key[0], value[0]  # [H, T, D], [kv, T, D]
        self.slab.write(layer, self.rows, k.transpose(0, 1), v.transpose(0, 1))
        split = self.num_prefill
        pieces = []
        if split:
            pieces.append(self._prefill(q[:, :split], k[:, :split], v[:, :split], scale, window))
        if self.decode is not None:
            pieces.append(self.decode.attend(self.slab, layer, (q[:, split:] if split else q).transpose(0, 1), scale, window))
        return (torch.cat(pieces) if len(pieces) > 1 else pieces[0])[None]

    def _prefill(self, q, k, v, scale, window: int | None) -> torch.Tensor:
        """Causal SDPA within each sequence (those of one length as one batch) -> ``[T, H, D]``."""
        out = causal_per_sequence(q, k, v, self.groups, scale, window, enable_gqa=k.shape[0] != q.shape[0])
        return out[self.order] if self.order is not None else out


@dataclass
class _Decode:
    slots: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: where each slot's new token went
    kv_len: int  # keys read per slot: the longest prefix
    block: int | None  # the first slot when the slots are consecutive and in order
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # per sliding window, built once per step

    def attend(self, slab: KVSlab, layer: int, query: torch.Tensor, scale, window: int | None) -> torch.Tensor:
        """``query`` ``[N, H, D]`` (its keys already written) -> ``[N, H, D]``. Written out as two
        batched matmuls over the ``N * kv_heads`` (slot, key head) pairs, the scale and the mask
        folded into the first (``baddbmm``), the softmax in float32: for one query per slot it beats
        SDPA's kernels with a mask on the CPU, and each row's result depends neither on the other
        rows nor on the masked tail of ``kv_len`` (which adds exact zeros)."""
        ks, vs = (self._prefixes(t[layer]) for t in (slab.keys, slab.values))  # [N, kv, L, D]
        n, heads, dim = query.shape
        pairs = n * ks.shape[1]
        q = query.reshape(pairs, heads // ks.shape[1], dim)  # query head h reads key head h // group
        keys = ks.reshape(pairs, self.kv_len, dim).transpose(1, 2)  # views: the slots' prefixes are slab rows
        mask = self._mask(window, ks.shape[1], q.dtype)
        scores = torch.baddbmm(mask, q, keys, alpha=dim**-0.5 if scale is None else scale)
        probs = scores.softmax(dim=-1, dtype=torch.float32)  # [N * kv, group, L]
        if probs.dtype != vs.dtype:
            probs = probs.to(vs.dtype)
        return torch.bmm(probs, vs.reshape(pairs, self.kv_len, dim)).view(n, heads, dim)

    def _prefixes(self, cache: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            return cache[self.block : self.block + self.slots.numel(), :, : self.kv_len]
        return cache[:, :, : self.kv_len].index_select(0, self.slots)

    def _mask(self, window: int | None, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """``[N * kv_heads, 1, kv_len]`` in ``dtype``: 0 where the slot's query sees the key, -inf
        elsewhere (both exact in any float dtype)."""
        if window not in self._masks:
            key_pos = torch.arange(self.kv_len, device=self.positions.device)[None, :]
            hidden = key_pos > self.positions[:, None]
            if window is not None:
                hidden |= key_pos <= self.positions[:, None] - window
            mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
            self._masks[window] = mask[:, None, None, :].expand(-1, kv_heads, 1, -1).reshape(-1, 1, self.kv_len)
        return self._masks[window]


def _slab_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, kv_heads, T, D]``; returns ``([B, T, H, D], None)``."""
    step = kwargs.get("rollbook_kv")
    if step is None:
        raise RuntimeError("KV-slab attention runs only inside the rollout engine's forward (no rollbook_kv given)")
    refuse_score_modifiers(module, kwargs, "the native engine's attention")
    return step.attend(module.layer_idx, query, key, value, scaling, kwargs.get("sliding_window")), None


def _no_mask(*args, **kwargs) -> None:
    """The engine's mask function: the step says who sees what, no mask is built."""
    return None


def _forward(model, ids: torch.Tensor, positions: torch.Tensor, step: _Packed, keep: torch.Tensor | None) -> torch.Tensor:
    """The model's logits ``[1, len(keep), V]`` at the row positions ``keep`` (None: at every
    position), the slab attention on."""
    keeps = keep is not None and _keeps_logits(type(model))
    kwargs = {"logits_to_keep": keep} if keeps else {}
    mask = _PLACEHOLDER_MASKS.get(ids.device)
    if mask is None:
        mask = _PLACEHOLDER_MASKS[ids.device] = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=ids.device)
    with _slab_attention_on(model):
        logits = model(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False, rollbook_kv=step, **kwargs
        ).logits
    return logits if keeps or keep is None else logits[:, keep]


_PLACEHOLDER_MASKS: dict[torch.device, torch.Tensor] = {}  # per device: the attention_mask the model is handed


@contextlib.contextmanager
def _slab_attention_on(model: torch.nn.Module) -> Iterator[None]:
    """The model's layers call the slab attention for the duration (its config says which one), so
    other forwards of the same model (a reference pass between generations) are untouched."""
    config: Any = model.config
    before = config._attn_implementation
    config._attn_implementation = SLAB_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


_KEEPS_LOGITS: dict[type, bool] = {}


def _keeps_logits(model_type: type[torch.nn.Module]) -> bool:
    """Whether the model computes logits only where asked (``logits_to_keep``, an int or an index,
    transformers 4.50+; the older ``num_logits_to_keep`` takes a count, of no use for a packed row)."""
    if model_type not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[model_type] = "logits_to_keep" in inspect.signature(model_type.forward).parameters
    return _KEEPS_LOGITS[model_type]


def _groups(lengths: list[int], device: torch.device) -> list[slice | torch.Tensor]:
    """The packed row's sequences grouped by length: a lone one is a slice of the row, a group of n
    is its ``[n, L]`` token indices (each group attends as one batch)."""
    by_length: dict[int, list[int]] = {}
    start = 0
    for n in lengths:
        by_length.setdefault(n, []).append(start)
        start += n
    groups: list[slice | torch.Tensor] = []
    for length, starts in by_length.items():
        if len(starts) == 1:
            groups.append(slice(starts[0], starts[0] + length))
        else:
            groups.append(to_device(starts, device)[:, None] + torch.arange(length, device=device))
    return groups


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SLAB_ATTENTION, _slab_attention)
    AttentionMaskInterface.register(SLAB_ATTENTION, _no_mask)


_register()
