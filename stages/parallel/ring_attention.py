"""Ring attention: context parallelism's attention core with one block of keys and values in hand
at a time (`context_parallel_mode: ring`; Liu et al., "Ring Attention with Blockwise Transformers").

Each rank of the context group holds the queries, keys and values of its own tokens (B, heads,
T/cp, hd, in zigzag order: `stages.parallel.context`). Forward runs cp steps: at step s a rank
attends its queries to the block of keys and values that started on rank (r - s) mod cp, masked by
the places of both in the whole sequence (causal, the layer's window, the packed example), while
it passes that block on to rank r + 1 and takes the next one from rank r - 1 (point-to-point,
started before the step's compute and waited for after it). Each block's partial result is merged
into the running one by its log-sum-exp (the online softmax flash attention merges its tiles with),
so a rank holds its own block and one neighbour's, never the group's keys and values, and saves for
backward only its q, k, v, the output (the tensor o_proj saves as its input) and the log-sum-exp.

Backward recomputes each block's softmax from the saved log-sum-exp (flash attention's backward):
the keys and values travel the ring again, each block carrying the gradient of its keys and values,
which every rank it visits adds its queries' share to; after the last step one more pass brings each
block's gradient home to the rank that owns those tokens.

The scores, softmax and their gradients are computed in fp32 whatever the inputs' dtype (the output
and gradients are cast back), QUERY_TILE query rows at a time, so a step holds (B, H, QUERY_TILE,
T/cp) scores, not the block's square. Grouped KV heads are read in place: the query heads are viewed as
(K, H / K) groups against their K key-value heads. A block no query of this rank may see (a causal
block of later places only) is passed on without compute.

Shapes: q (B, H, Tl, hd), k and v (B, K, Tl, hd), Tl = T / cp tokens a rank; G = H / K.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from stages.model.attention_shapes import RING_QUERY_TILE

QUERY_TILE = RING_QUERY_TILE  # query rows scored at once (why: stages.model.attention_shapes)


def _start_pass(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], list]:
    """Send `tensors` to the next rank of the group's ring and receive the previous rank's (same
    shapes and dtypes): (the receive buffers, the requests to wait for)."""
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    to = dist.get_global_rank(group, (rank + 1) % world)
    source = dist.get_global_rank(group, (rank - 1) % world)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous
    ops = [dist.P2POp(dist.isend, t.contiguous(), to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, buffer, source, group) for buffer in received]
    return received, dist.batch_isend_irecv(ops)


def _finish(requests: list) -> None:
    for request in requests:
        request.wait()


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, K, G, tq, Tk) fp32 scores of queries q (B, K, G, tq, hd) on keys k (B, K, Tk, hd), -inf
    where `mask` ((tq, Tk) or (B, 1, tq, Tk), True where a query may see a key) forbids."""
    scores = torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if mask.dim() == 4:
        mask = mask.unsqueeze(2)  # (B, 1, 1, tq, Tk)
    return scores.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp with 0 where it is -inf (rows that saw no key yet), so exp(s - lse) stays 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _tiles(rows: int):
    return (slice(start, min(start + QUERY_TILE, rows)) for start in range(0, rows, QUERY_TILE))


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries q (B, K, G, Tl, hd) fp32 on one block of keys and values (B, K, Tk, hd):
    (softmax-weighted values (B, K, G, Tl, hd), log-sum-exp (B, K, G, Tl), -inf where a row saw no key)."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for rows in _tiles(q.shape[3]):
        tile_mask = mask[..., rows, :]
        if not bool(tile_mask.any()):
            continue
        scores = _scores(q[..., rows, :], k, tile_mask, scale)
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        out[..., rows, :] = torch.matmul(torch.exp(scores - _finite(lse[..., rows])[..., None]),
                                         v.float().unsqueeze(2))
    return out, lse


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    lse: torch.Tensor, d_out: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor) -> None:
    """One block's share of the gradient, from the whole attention's log-sum-exp `lse` and `delta`
    (rowsum(dO * O)): added to dq (B, K, G, Tl, hd) and to the block's dk, dv (B, K, Tk, hd), fp32."""
    for rows in _tiles(q.shape[3]):
        tile_mask = mask[..., rows, :]
        if not bool(tile_mask.any()):
            continue
        p = torch.exp(_scores(q[..., rows, :], k, tile_mask, scale) - lse[..., rows, None])  # (B, K, G, tq, Tk)
        d_rows = d_out[..., rows, :]
        dv += torch.matmul(p.transpose(-1, -2), d_rows).sum(2)
        ds = p * (torch.matmul(d_rows, v.float().unsqueeze(2).transpose(-1, -2)) - delta[..., rows, None]) * scale
        dq[..., rows, :] += torch.matmul(ds, k.float().unsqueeze(2))
        dk += torch.matmul(ds.transpose(-1, -2), q[..., rows, :]).sum(2)


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, context, window):
        group = context.group
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
        B, H, Tl, hd = q.shape
        K = k.shape[1]
        scale = 1.0 / math.sqrt(hd)
        q5 = q.float().view(B, K, H // K, Tl, hd)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block = [k, v]
        for step in range(world):
            if step < world - 1:
                received, requests = _start_pass(block, group)
            mask = context.block_mask((rank - step) % world, window)
            if bool(mask.any()):
                block_out, block_lse = _block_forward(q5, block[0], block[1], mask, scale)
                merged = _finite(torch.logaddexp(lse, block_lse))
                out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
                lse = torch.logaddexp(lse, block_lse)
            if step < world - 1:
                _finish(requests)
                block = received
        # (B, Tl, H x hd) in q's dtype, as the dense core returns it: saved as it is, so o_proj's saved
        # input and this are one tensor (flash attention's backward too reads O in the inputs' dtype)
        y = out.permute(0, 3, 1, 2, 4).reshape(B, Tl, H * hd).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.context, ctx.window, ctx.scale = context, window, scale
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, v, y, lse = ctx.saved_tensors
        context, window, scale = ctx.context, ctx.window, ctx.scale
        group = context.group
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
        B, H, Tl, hd = q.shape
        K = k.shape[1]
        q5 = q.float().view(B, K, H // K, Tl, hd)

        def heads_first(t: torch.Tensor) -> torch.Tensor:  # (B, Tl, H x hd) -> (B, K, G, Tl, hd) fp32
            return t.float().reshape(B, Tl, K, H // K, hd).permute(0, 2, 3, 1, 4)

        d_out, out = heads_first(grad), heads_first(y)
        delta = (d_out * out).sum(-1)  # (B, K, G, Tl): rowsum(dO * O) of flash attention's backward
        lse = _finite(lse)
        dq = torch.zeros_like(q5)
        block = [k, v]
        d_block = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                   torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(world):
            if step < world - 1:
                received, requests = _start_pass(block, group)
            mask = context.block_mask((rank - step) % world, window)
            if bool(mask.any()):
                _block_backward(q5, block[0], block[1], mask, scale, lse, d_out, delta, dq, *d_block)
            # the block's gradient goes on with it; after the last step this pass brings it home
            d_received, d_requests = _start_pass(d_block, group)
            _finish(d_requests)
            d_block = d_received
            if step < world - 1:
                _finish(requests)
                block = received
        return (dq.view(B, H, Tl, hd).to(q.dtype), d_block[0].to(k.dtype), d_block[1].to(v.dtype), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context, window: int | None) -> torch.Tensor:
    """Attention of this rank's queries q (B, H, Tl, hd) over every rank's keys and values, passed
    around the context group's ring (k, v: this rank's (B, K, Tl, hd)): (B, Tl, H x hd) as the
    dense core returns it. `context` is the forward's `ContextAttention` (its group and
    `block_mask`), `window` the layer's sliding window or None."""
    return _RingAttention.apply(q, k, v, context, window)
