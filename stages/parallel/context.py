"""Context parallelism: every sequence split over the ranks of a context group, attention over all
of it (`context_parallel_degree`).

Each rank holds T/cp tokens of every row from the embeddings to the loss: the residual stream,
norms, MLPs, logits and loss terms of its own tokens. Attention is the one place where a token
needs the others: each layer all-gathers the keys and values of the group (the way Llama 3 trained
its long-context stage; backward reduce-scatters their gradients, each rank's queries having read
every rank's keys) and attends its own queries to them, causal by the tokens' places in the whole
sequence. The core (gather, mask, SDPA) is recomputed in backward, Megatron's selective recompute:
a layer keeps only its rank's q, k and v, not the gathered keys and values nor the mask, so every
activation a layer saves is divided by cp; backward gathers the keys again and runs the core's
forward once more. Under full recompute (`recompute: true`) the layer is rebuilt whole instead.
This mode holds the group's keys and values during one layer's core, which the memory plan counts.

Ring (`context_parallel_mode: ring`, `stages.parallel.ring_attention`): the keys and values pass
around the group one block at a time, point to point, each rank merging its queries' attention to
each block with an online softmax; a rank holds its own block and one neighbour's, and backward
passes them around again with their gradients. Any head count; no prefix tuning, no attention
dropout.

Ulysses (`context_parallel_mode: ulysses`, DeepSpeed-Ulysses): instead of gathering keys, an
all-to-all trades the split of the sequence for a split of the heads, so each rank attends the whole
row with cp-th of the heads (causal fast path, packed examples by mask, windows), and a second
all-to-all trades back. Per layer it moves q, k, v and the output once (4 / cp of a rank's share of
each), against the all-gather's cp - 1 shares of k and v twice (forward and the recompute); it needs
cp to divide the query and key-value heads of a tensor-parallel rank, and nothing is recomputed: the
saved q, k, v and output are T x heads / cp, the bytes of the rank's own. Prefix tuning is refused
under it (a prefix is per head).

Balance (zigzag): causal attention makes a late token's work larger than an early one's, so the
sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp - 1 - r: every rank has the
same number of query-key pairs (Megatron-LM's and torchtitan's load-balanced order).

The batch is split on the data side (`ContextSplit.split_batch`, before the model): the targets
are shifted over the whole sequence first (position t learns token t + 1, which may live on
another rank), the rows padded at their end to a multiple of 2 x cp (x tp with sequence
parallelism), then each rank keeps its chunks of the ids, targets and position ids. Positions
are the tokens' places in their row (or their packed example), so RoPE, learned positions, sliding
windows and packed rows (attention inside each example: `ContextAttention.mask`) are those of the
unsplit run. Pads come after every real token and are never learned nor seen by one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from stages.model.attention_shapes import ulysses_head_conflict
from stages.model.labels import IGNORE_INDEX
from stages.model.llama import places_mask, segment_ids
from stages.model.loss import next_tokens
from stages.parallel.mappings import all_to_all, gather_from_context_parallel_region
from stages.parallel.ring_attention import ring_attention
from stages.parallel.sequence import continued_positions

HEAD_SEQUENCE_DIM = 2  # of the (B, heads, T, hd) keys and values
CONTEXT_PARALLEL_MODES = ("all_gather", "ulysses", "ring")


def zigzag_order(length: int, world: int, rank: int) -> torch.Tensor:
    """The places (in the whole sequence of `length`) of rank `rank`'s tokens: chunks `rank` and
    2 x world - 1 - rank of 2 x world equal chunks. (length / world,) int64."""
    if length % (2 * world):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {world} equal chunks")
    chunk = length // (2 * world)
    first, second = rank * chunk, (2 * world - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class ContextAttention:
    """One forward's view of the split sequence for every attention layer: where this rank's
    queries and the gathered keys sit in the whole sequence, and the packed example of each."""

    def __init__(self, group, query_places: torch.Tensor, key_places: torch.Tensor,
                 query_segments: torch.Tensor, key_segments: torch.Tensor, recompute_core: bool = True,
                 mode: str = "all_gather", row_segments: torch.Tensor | None = None):
        self.group, self.recompute_core, self.mode = group, recompute_core, mode
        self.query_places, self.key_places = query_places, key_places  # (Tl,), (T,) int64, gathered order
        self.query_segments, self.key_segments = query_segments, key_segments  # (B, Tl), (B, T)
        self.row_segments = row_segments  # (B, T) in place order, or None: one example per row

    def core(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention `layer`'s core on this rank's q, k and v (B, heads, T/cp, hd) -> (B, T/cp,
        heads x hd). All-gather: `layer.attend(q, k, v, segments, context)` gathers the keys and
        values through `keys_values`, recomputed in backward unless the whole layer is
        (`recompute_core`); Ulysses: `ulysses`; ring: `stages.parallel.ring_attention`."""
        if self.mode == "ulysses":
            return self.ulysses(layer.attend, q, k, v)
        if self.mode == "ring":
            return ring_attention(q, k, v, self, layer.sliding_window)
        if not self.recompute_core or not torch.is_grad_enabled():
            return layer.attend(q, k, v, context=self)
        return checkpoint(layer.attend, q, k, v, None, self, use_reentrant=False)

    def ulysses(self, attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The whole row for cp-th of the heads: all-to-all q, k and v from the sequence split to a
        head split (head group r to rank r), put the tokens in place order, attend as the unsplit
        model does, and all-to-all the output back to this rank's tokens with every head."""
        in_place_order = torch.argsort(self.key_places)  # gathered index of each place

        def whole_row(t: torch.Tensor) -> torch.Tensor:  # (B, h, T/cp, hd) -> (B, h/cp, T, hd)
            return all_to_all(t, 1, HEAD_SEQUENCE_DIM, self.group).index_select(HEAD_SEQUENCE_DIM, in_place_order)

        y = attend(whole_row(q), whole_row(k), whole_row(v), self.row_segments)  # (B, T, h/cp x hd)
        B, T = y.shape[:2]
        y = y.reshape(B, T, -1, q.shape[-1]).index_select(1, self.key_places)  # gathered order: rank r's tokens r-th
        y = all_to_all(y, 1, 2, self.group)  # (B, T/cp, h, hd): this rank's tokens, every head
        return y.reshape(B, y.shape[1], -1)

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's keys and values (B, K, T, hd) from this rank's (B, K, T/cp, hd), rank-major."""
        return (gather_from_context_parallel_region(k, HEAD_SEQUENCE_DIM, self.group),
                gather_from_context_parallel_region(v, HEAD_SEQUENCE_DIM, self.group))

    def block_mask(self, source: int, window: int | None) -> torch.Tensor:
        """(B, 1, Tl, Tl) bool: where this rank's queries may see the keys of rank `source`'s tokens
        (ring attention's block), by place in the whole sequence and packed example, as `mask`."""
        local = self.query_places.shape[0]
        keys = slice(source * local, (source + 1) * local)  # rank-major: rank r's tokens r-th
        return places_mask(self.query_places, self.key_places[keys], window, self.query_segments,
                           self.key_segments[:, keys], 0)

    def mask(self, window: int | None, prefix_len: int) -> torch.Tensor:
        """(B, 1, Tl, P+T) bool, True where a query may attend a key: causal by place in the whole
        sequence (within `window` places when given), inside the query's packed example, and always
        to the `prefix_len` prefix keys before the real ones."""
        return places_mask(self.query_places, self.key_places, window, self.query_segments, self.key_segments,
                           prefix_len)


class ContextSplit:
    """The context-parallel group's split of every sequence; set as `model.context_parallel` by
    `apply_context_parallel`. `pad_multiple` is 2 x cp, times tp under sequence parallelism (whose
    split of a rank's tokens must then need no padding of its own)."""

    def __init__(self, group, pad_multiple: int | None = None, mode: str = "all_gather"):
        if mode not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"context_parallel_mode={mode!r} is unknown; choose one of {CONTEXT_PARALLEL_MODES}")
        self.group, self.mode = group, mode
        self.world = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.pad_multiple = pad_multiple or 2 * self.world

    def split_batch(self, ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, labels, position ids or None for unpacked rows), each (B, T) of the whole rows
        every rank of the group holds -> this rank's (ids, targets, position ids), each (B, T'/cp):
        targets are the labels shifted over the whole row (`next_tokens`), T' is T padded to
        `pad_multiple` (pad ids 0, targets IGNORE_INDEX, positions continuing the last example)."""
        targets = next_tokens(labels)
        length = ids.shape[1]
        extra = -length % self.pad_multiple
        if position_ids is None:
            position_ids = torch.arange(length + extra, device=ids.device).expand(ids.shape[0], -1)
        elif extra:
            position_ids = continued_positions(position_ids, extra)
        if extra:
            ids = F.pad(ids, (0, extra))
            targets = F.pad(targets, (0, extra), value=IGNORE_INDEX)
        order = zigzag_order(length + extra, self.world, self.rank).to(ids.device)
        return ids[:, order], targets[:, order], position_ids[:, order]

    def local_positions(self, batch: int, local: int, device: torch.device) -> torch.Tensor:
        """(batch, local) positions of this rank's tokens of unpacked rows: their places in the row."""
        return zigzag_order(local * self.world, self.world, self.rank).to(device).expand(batch, -1)

    def attention(self, position_ids: torch.Tensor, recompute: bool = False) -> ContextAttention:
        """The layers' view of this forward from this rank's position ids (B, T/cp): the group's
        position ids are gathered once (small integers, no gradient) to find every token's packed
        example in the whole row. `recompute`: the layers are rebuilt whole in backward (their
        attention core then is not recomputed on its own)."""
        local = position_ids.shape[1]
        length = local * self.world
        query_places = zigzag_order(length, self.world, self.rank).to(position_ids.device)
        key_places = torch.cat([zigzag_order(length, self.world, r) for r in range(self.world)]).to(position_ids.device)
        gathered = gather_from_context_parallel_region(position_ids, 1, self.group)  # (B, T) rank-major
        whole = torch.empty_like(gathered)
        whole[:, key_places] = gathered  # in place order
        segments = segment_ids(whole)
        # Ulysses attends whole rows: their causal fast path unless a row holds several examples
        packed = self.mode == "ulysses" and bool((segments[:, -1] > 1).any())
        return ContextAttention(self.group, query_places, key_places, segments[:, query_places],
                                segments[:, key_places], recompute_core=not recompute, mode=self.mode,
                                row_segments=segments if packed else None)

    def __repr__(self) -> str:
        return f"ContextSplit(cp={self.world}, rank={self.rank}, mode={self.mode})"


def apply_context_parallel(model, group, sequence_parallel_degree: int = 1, mode: str = "all_gather") -> None:
    """Make `model` (our LlamaForCausalLM, already tensor-parallel if it is) run on this rank's
    tokens of every sequence: `model.context_parallel`; its forward then takes the output of
    `split_batch` (ids and position ids) and returns the logits of this rank's tokens. Ulysses needs
    cp to divide each tensor-parallel rank's query and key-value heads, and no prefix."""
    cp = dist.get_world_size(group=group)
    if cp == 1:
        return
    layers = model.model.layers.values()
    if mode == "ring":
        if any(getattr(layer.self_attn, "prefix_key", None) is not None for layer in layers) \
                or getattr(model, "prefix_encoder", None) is not None:
            raise ValueError("context_parallel_mode=ring with prefix tuning: ring attention passes only the tokens' "
                             "keys and values around; use context_parallel_mode: all_gather")
        if getattr(model.config, "attention_dropout", 0.0):
            raise ValueError(f"context_parallel_mode=ring with attention_dropout={model.config.attention_dropout}: "
                             "ring attention has no dropout; set it to 0 or use context_parallel_mode: all_gather")
    if mode == "ulysses":
        config = model.config
        conflict = ulysses_head_conflict(cp, getattr(model, "tensor_parallel_degree", 1), config.num_attention_heads,
                                         config.num_key_value_heads)
        if conflict:
            raise ValueError(conflict)
        if any(getattr(layer.self_attn, "prefix_key", None) is not None for layer in layers) \
                or getattr(model, "prefix_encoder", None) is not None:
            raise ValueError("context_parallel_mode=ulysses with prefix tuning: a prefix is per head, which Ulysses "
                             "moves between ranks; use context_parallel_mode: all_gather")
    model.context_parallel = ContextSplit(group, 2 * cp * sequence_parallel_degree, mode)


@contextlib.contextmanager
def whole_sequences(model) -> Iterator[None]:
    """Within it, a context-parallel `model` runs whole sequences on every rank (generation: each
    rank holds the same weights and the same prompts, so each computes the same tokens)."""
    split = getattr(model, "context_parallel", None)
    if split is None:
        yield
        return
    model.context_parallel = None
    try:
        yield
    finally:
        model.context_parallel = split
