"""The sparse mixture-of-experts block of our decoder: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

A router (`gate`, a bias-free Linear d -> E) scores each token; the softmax over the E experts (in
fp32) picks the top k; their weights are renormalised to sum to one where the family does it
(Mixtral always, the others when config.json's `norm_topk_prob` says). Each expert is a SwiGLU MLP
under the family's names (Mixtral `w1` gate, `w3` up, `w2` down; the others `gate_proj`, `up_proj`,
`down_proj`), and the block's output is the weighted sum of its k experts' outputs; Qwen2-MoE adds a
dense shared expert scaled by sigmoid(`shared_expert_gate`(x)). Module names equal the checkpoint
names transformers writes (`model.layers.0.block_sparse_moe.experts.3.w1.weight`,
`model.layers.0.mlp.experts.3.gate_proj.weight`), so our state dict is the one on disk.

Routing is dropless by default: every expert runs on exactly the tokens routed to it, one matrix
product per expert (no padding to a capacity). With a `capacity_factor` (`MoeRouting`), an expert
takes at most ceil(factor x tokens x k / E) tokens in token order and the rest of its tokens get
nothing from it (their residual carries them), as GShard and Switch Transformer do.

Every forward records its routing (`RouterRecord`): the load-balancing loss transformers computes
(`load_balancing_loss`, Switch Transformer's eq. 4-6 over all layers at once), the router z-loss of
ST-MoE (`router_z_loss`), and the tokens each expert received (logged by training, reported by the
memory plan's dispatch estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), its three projections under `names`
    (gate, up, down): the family's checkpoint names."""

    def __init__(self, hidden_size: int, width: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden_size, width, bias=False))
        setattr(self, up, nn.Linear(hidden_size, width, bias=False))
        setattr(self, down, nn.Linear(width, hidden_size, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(F.silu(gate(x)) * up(x))


@dataclass
class RouterRecord:
    """One sparse layer's routing of its last forward: the router logits (N, E) (kept in the
    autograd graph: the auxiliary losses train the router through them) and the experts each
    token chose (N, k)."""

    logits: torch.Tensor
    chosen: torch.Tensor

    def tokens_per_expert(self) -> torch.Tensor:
        """(E,) how many (token, choice) pairs each expert received (dropped ones included)."""
        return torch.bincount(self.chosen.reshape(-1), minlength=self.logits.shape[-1])


@dataclass(frozen=True)
class MoeRouting:
    """How tokens reach experts. `top_k` experts per token; `renormalize`: scale the k weights to
    sum to one; `capacity_factor`: None for dropless routing, else each expert's token budget as a
    multiple of an even share (tokens x k / E); `jitter`: Mixtral's multiplicative input noise
    in training (config.json's `router_jitter_noise`)."""

    top_k: int
    renormalize: bool
    capacity_factor: float | None = None
    jitter: float = 0.0
    weights_in_fp32: bool = False  # Mixtral keeps the k weights in fp32; the others cast them to x's dtype


class SparseMoeBlock(nn.Module):
    """Router plus `num_experts` experts (plus Qwen2-MoE's shared expert). Input and output (B, T, d).
    Under expert parallelism `experts` holds this rank's share and exchanges tokens with the other
    ranks' (`stages.parallel.experts.ShardedExperts`, its `dispatch` replacing `run_experts`)."""

    def __init__(self, hidden_size: int, width: int, num_experts: int, routing: MoeRouting,
                 names: tuple[str, str, str], shared_width: int = 0):
        super().__init__()
        self.num_experts = num_experts
        self.routing = routing
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.keep_float = True  # not quantized (stages.quant.layers.quantizable), as GPTQModel and vLLM keep it
        self.experts = nn.ModuleList(Expert(hidden_size, width, names) for _ in range(num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if shared_width:
            self.shared_expert = Expert(hidden_size, shared_width, ("gate_proj", "up_proj", "down_proj"))
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
            self.shared_expert_gate.keep_float = True  # a router too (one output)
        self.record: RouterRecord | None = None  # the last forward's routing
        # sequence parallelism (set by stages.parallel.plan): x holds this rank's tokens; the block runs
        # on the whole sequence, `whole(x)` gathered and `part(y)` this rank's tokens of the output
        self.sequence = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None:
            return self.sequence.part(self._forward(self.sequence.whole(x)))
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d)
        if self.training and self.routing.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.routing.jitter, 1.0 + self.routing.jitter)
        logits = self.gate(x)  # (N, E)
        weights, chosen = route(logits, self.routing)  # (N, k) each
        self.record = RouterRecord(logits, chosen)
        keep = None
        if self.routing.capacity_factor is not None:
            keep = within_capacity(chosen, self.num_experts, self.routing.capacity_factor)
        dispatch = getattr(self.experts, "dispatch", None)  # expert parallelism (stages.parallel.experts)
        if dispatch is not None:
            y = dispatch(x, chosen, weights, keep)
        elif torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
            y = run_experts_densely(self.experts, x, chosen, weights, keep)  # a graph without data-dependent shapes
        else:
            y = run_experts(self.experts, x, chosen, weights, keep)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(shape)


def route(logits: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k), chosen experts (N, k)) of router logits (N, E): the top k of the fp32
    softmax, renormalised when the family does, in fp32 or the logits' dtype as the family keeps them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if routing.weights_in_fp32 else weights.to(logits.dtype)), chosen


def within_capacity(chosen: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """(N, k) bool: which (token, choice) pairs fit their expert's capacity, ceil(factor x N x k / E)
    pairs taken in token order (a token's first choice before its second)."""
    n, k = chosen.shape
    capacity = math.ceil(capacity_factor * n * k / num_experts)
    flat = chosen.reshape(-1)  # token-major: token 0's choices, then token 1's
    onehot = F.one_hot(flat, num_experts)  # (N*k, E)
    place = (onehot.cumsum(0) * onehot).sum(-1)  # 1-based place of each pair in its expert's queue
    return (place <= capacity).reshape(n, k)


def run_experts(experts: nn.ModuleList | list[nn.Module], x: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """(N, d): for each token the sum over its k choices of weight x expert(token); a choice outside
    capacity (`keep` False) adds nothing. One matrix product per expert on exactly its tokens
    (transformers' loop, with the tokens sorted by expert once)."""
    y = torch.zeros_like(x)
    order, counts = group_by_expert(chosen, keep, len(experts))
    tokens = order // chosen.shape[1]
    flat_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in zip(experts, counts.tolist()):
        # an expert without tokens still runs (on none): its weights then get a zero gradient every step,
        # as data parallelism and ZeRO expect of every parameter
        rows = tokens[start:start + count]
        out = expert(x[rows]) * flat_weights[start:start + count, None]
        y.index_add_(0, rows, out.to(y.dtype))
        start += count
    return y


def run_experts_densely(experts: nn.ModuleList, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                        keep: torch.Tensor | None = None) -> torch.Tensor:
    """`run_experts` as a graph an exporter can write (ONNX): every expert runs on every token and
    its output is weighted by the token's weight for it, zero unless chosen (and kept). E / k times
    the expert FLOPs; the same sums up to their order."""
    if keep is not None:
        weights = weights * keep.to(weights.dtype)
    dense = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device)
    dense = dense.scatter_add(1, chosen, weights)  # (N, E)
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        y = y + (expert(x) * dense[:, e:e + 1]).to(y.dtype)
    return y


def group_by_expert(chosen: torch.Tensor, keep: torch.Tensor | None,
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the flat (token, choice) pair indices that reach an expert (all, or those
    `keep` marks), grouped by expert and in token order within each, and how many each expert gets
    (num_experts,)."""
    flat = chosen.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped pairs sort last and are cut off
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    return order[: int(counts.sum())], counts


def _summed(value: torch.Tensor, group) -> torch.Tensor:
    """`value` summed over `group` (no gradient: counts), or itself without a group."""
    if group is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value


def load_balancing_loss(records: list[RouterRecord], num_experts: int, group=None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6) over every sparse
    layer at once: E x sum_e f_e P_e, f_e the (token, choice) pairs expert e received per token of
    all layers (the f_e sum to k) and P_e its mean router probability; k at perfect balance.
    `group`: the ranks that share each sequence (context parallelism), each holding some of its
    tokens: f_e and the token count are summed over them, and this rank's share of the loss is
    E x sum_e f_e (its tokens' probability sums / all tokens), so the shares add up to the loss of
    the whole sequence and each rank's router gets exactly its tokens' gradient."""
    counts = _summed(sum(r.tokens_per_expert().float() for r in records), group)
    prob_sums = sum(torch.softmax(r.logits.float(), dim=-1).sum(0) for r in records)
    rows = _summed(torch.tensor(float(sum(r.logits.shape[0] for r in records)), device=counts.device), group)
    return num_experts * torch.sum((counts / rows) * (prob_sums / rows))


def router_z_loss(records: list[RouterRecord], group=None) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over layers and tokens of logsumexp(router logits)^2; it
    keeps the logits small so the fp32 softmax stays well conditioned. `group`: as for
    `load_balancing_loss`, this rank's share (its tokens' terms over the tokens of the group)."""
    layers = []
    for r in records:
        rows = _summed(torch.tensor(float(r.logits.shape[0]), device=r.logits.device), group)
        layers.append(torch.logsumexp(r.logits.float(), dim=-1).pow(2).sum() / rows)
    return torch.stack(layers).mean()
