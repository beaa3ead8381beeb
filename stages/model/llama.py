"""One decoder written once, with switches: the Llama family (Llama 1/2/3, Qwen2, Qwen3, Mistral,
GLM, GLM-4: biases, GQA, RoPE scaling and partial interleaved RoPE, sliding windows, q/k norms, a
fused gate/up projection, sandwich norms), GPT-2 blocks (learned positions, LayerNorm, GELU MLP,
a fused qkv projection) and mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: a sparse
block of routed experts in place of the MLP, `stages.model.moe`).

Single-device and parallelism-free: tensor and pipeline parallelism are applied to a built model
by `stages.parallel`, not written in here. Parameter names equal Hugging Face's for the Llama
family (`model.layers.0.self_attn.q_proj.weight`, ...), so a state dict saved from this module loads
into `transformers.LlamaForCausalLM` unchanged (GPT-2's names and Conv1D layout are translated at
the boundary: `stages.model.gpt2_layout`), and the blocks live in a `ModuleDict` keyed by their
global index so a pipeline stage that holds layers 4..7 still names them `model.layers.4...`.

Shapes: B batch, T sequence, d hidden, H query heads, K kv heads, hd head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from stages.model.attention_precision import attention_in_fp32
from stages.model.config import LlamaConfig
from stages.model.loss import causal_lm_loss
from stages.model.moe import MoeRouting, SparseMoeBlock, load_balancing_loss, router_z_loss
from stages.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in fp32, cast back, times `weight`."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's pairing: dimension i turns with i + d/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's interleaved pairing: dimension 2i turns with 2i + 1."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate (B, heads, T, hd) by position; cos/sin are (T, rd) (or (B, 1, T, rd)) from
    `RotaryEmbedding`, rd <= hd: the first rd dimensions turn, the rest pass unchanged (GLM's
    partial rotation)."""
    rotate = rotate_pairs if interleaved else rotate_half
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot = x[..., :rd]
    # written into x's layout (a torch.cat would be contiguous): SDPA's CPU output follows q's layout,
    # and in x's (B, T, heads, hd) one o_proj reads without a copy
    out = torch.empty_like(x)
    out[..., :rd] = x_rot * cos + rotate(x_rot) * sin
    out[..., rd:] = x[..., rd:]
    return out


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) index of the packed example each token belongs to: a new one starts wherever the
    position ids restart at 0 (how packed rows mark their examples, as transformers'
    DataCollatorWithFlattening does)."""
    return torch.cumsum((position_ids == 0).long(), dim=-1)


def gqa_in_place(q: torch.Tensor, masked: bool) -> bool:
    """Whether SDPA takes grouped-query keys and values as they are (`enable_gqa`) for queries `q`
    (B, H, T, hd), with a mask or not, without falling back to its math kernel, which holds every
    head's (T x keys) attention weights for backward. On a CPU it always does (its flash kernel reads
    the shared heads in place). On a GPU only the flash kernel takes grouped heads: half precision,
    no mask. Where the memory-efficient kernel runs instead (fp32, or a mask: packed rows, a window,
    a prefix, context parallelism) torch 2.11 refuses them and the math kernel runs (seen in fp32;
    masked half-precision attention goes the same way by torch's kernel rules, not measured): on an
    H200 the 1b flavour's fp32 step (4 x 1024 tokens) peaked at 38.10 GiB with the heads in place,
    30.11 GiB with k and v repeated (16 layers x 32 heads x 1024^2 fp32 weights x 4 rows = 8 GiB),
    so there k and v are repeated to every query head first (bench/README.md, memory_plan.py)."""
    return q.device.type != "cuda" or (q.dtype in (torch.float16, torch.bfloat16) and not masked)


def attention_mask(seq_len: int, window: int | None, segments: torch.Tensor | None, prefix_len: int,
                   device: torch.device) -> torch.Tensor:
    """Bool mask, True where a query may attend a key: causal (within `window` tokens when given),
    inside the query's own packed example when `segments` (B, T) is given, and always to the
    `prefix_len` prefix keys placed before the real ones. (T, P+T), or (B, 1, T, P+T) with segments."""
    pos = torch.arange(seq_len, device=device)
    return places_mask(pos, pos, window, segments, segments, prefix_len)


def places_mask(query_places: torch.Tensor, key_places: torch.Tensor, window: int | None,
                query_segments: torch.Tensor | None, key_segments: torch.Tensor | None,
                prefix_len: int) -> torch.Tensor:
    """`attention_mask` for queries and keys at any places of the sequence (Tq,) and (Tk,) (context
    parallelism: a rank's queries against every rank's keys), with their packed examples (B, Tq)
    and (B, Tk) when given. (Tq, P+Tk), or (B, 1, Tq, P+Tk) with segments."""
    distance = query_places[:, None] - key_places[None, :]  # (Tq, Tk) query place minus key place
    mask = distance >= 0
    if window is not None:
        mask = mask & (distance < window)
    if query_segments is not None:
        mask = mask & (query_segments[:, :, None] == key_segments[:, None, :])  # (B, Tq, Tk)
        mask = mask[:, None]  # (B, 1, Tq, Tk): the same for every head
    if prefix_len:
        prefix = torch.ones((*mask.shape[:-1], prefix_len), dtype=torch.bool, device=mask.device)
        mask = torch.cat([prefix, mask], dim=-1)
    return mask


def norm_layer(config: LlamaConfig, dim: int) -> nn.Module:
    """The family's norm: RMSNorm, or LayerNorm with bias for GPT-2."""
    if config.gpt2_blocks:
        return nn.LayerNorm(dim, eps=config.rms_norm_eps)
    return RMSNorm(dim, config.rms_norm_eps)


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads, rotary positions and, on the layers the
    config marks sliding, a window of `sliding_window` tokens.

    Prefix tuning (`stages.adapters.prefix_kv`) gives the layer `prefix_key` and `prefix_value`
    parameters (K, P, hd), or with a projection tensors the model's `prefix_encoder` sets at each
    forward: P keys/values every query sees before the real tokens, taken as they are (already
    rotated, as a KV cache); the real tokens take positions P, P+1, ... (`run_layers`).
    """

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.sliding_window = config.layer_windows()[layer_idx]  # None: full causal attention
        self.attention_dropout = config.attention_dropout
        self.rope_interleaved = config.rope_interleaved
        self.fused_qkv = config.gpt2_blocks
        if self.fused_qkv:  # GPT-2's c_attn: [q; k; v] rows (tensor parallelism splits each third)
            self.qkv_proj = nn.Linear(d, 3 * self.num_heads * hd, bias=config.qkv_bias)
        else:
            self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.qkv_bias)
            self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.qkv_bias)
            self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.o_proj_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by every query (key) head
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.qk_norm_whole = config.qk_norm_whole
        if self.qk_norm_whole:  # OLMoE: one RMSNorm over all query (key) heads at once
            self.q_norm = RMSNorm(self.num_heads * hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * hd, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv  # OLMoE: q, k, v clamped to [-clip, clip]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k and v (B, K, T, hd) of x (B, T, d): projected, each query and key head
        normalised (Qwen3), then rotated (not with learned positions: cos is None). Head counts are
        read from the projection widths, so a tensor-parallel shard whose projections hold heads/tp
        heads runs this on its local heads; the sequence length is read from the projections too
        (under sequence parallelism x holds a rank's tokens, the projections gather them all)."""
        if self.fused_qkv:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        B, T = q.shape[:2]
        q = q.view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, K, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, hd)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cos is None:
            return q, k, v
        return apply_rope(q, cos, sin, self.rope_interleaved), apply_rope(k, cos, sin, self.rope_interleaved), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: torch.Tensor | None = None, context=None) -> torch.Tensor:
        """`context` (context parallelism's `ContextAttention`): x holds this rank's tokens of a
        sequence split over ranks; `attend` runs through the context (`ContextAttention.core`), which
        gathers the keys and values of all of them."""
        q, k, v = self.project(x, cos, sin)
        y = self.attend(q, k, v, segments) if context is None else context.core(self, q, k, v)
        return self.o_proj(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None = None,
               context=None) -> torch.Tensor:
        """Attention's core: (B, T, H*hd) of q (B, H, T, hd), k and v (B, K, T, hd), causal (within
        the layer's window), inside each packed example (`segments`), after the prefix keys; with
        `context`, the keys and values of every rank's tokens, masked by place in the whole sequence."""
        B, T = q.shape[0], q.shape[2]  # the whole sequence, also when x holds a rank's tokens
        if context is not None:
            k, v = context.keys_values(k, v)  # (B, K, cp x T, hd)
        prefix_key = getattr(self, "prefix_key", None)
        prefix_len = 0 if prefix_key is None else prefix_key.shape[1]
        if prefix_len:  # (K, P, hd) -> (B, K, P, hd) before the real keys and values
            k = torch.cat([prefix_key.to(k.dtype).expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([self.prefix_value.to(v.dtype).expand(B, -1, -1, -1), v], dim=2)
        # each KV head serves H / K query heads: SDPA's enable_gqa reads the shared heads in place
        # (repeating k and v first cost 18% of attention's forward + backward: bf16, one CPU thread)
        gqa = q.shape[1] != k.shape[1]
        dtype = q.dtype
        if attention_in_fp32(q, k.shape[2]):  # faster there than bf16's kernel (stages.model.attention_precision)
            q, k, v = q.float(), k.float(), v.float()
        dropout = self.attention_dropout if self.training else 0.0
        window = self.sliding_window if self.sliding_window is not None and T > self.sliding_window else None
        masked = context is not None or window is not None or segments is not None or bool(prefix_len)
        if gqa and not gqa_in_place(q, masked):  # a GPU's kernel for these inputs needs every head's k and v
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, keys, hd), as enable_gqa reads them
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            gqa = False
        if context is not None:
            mask = context.mask(self.sliding_window, prefix_len)  # (B, 1, T, P + cp x T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
        elif window is None and segments is None and not prefix_len:
            # plain causal attention: SDPA's causal fast path, no mask tensor
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
        else:
            mask = attention_mask(T, window, segments, prefix_len, q.device)  # (T, P+T) or (B, 1, T, P+T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
        return y.to(dtype).transpose(1, 2).reshape(B, T, -1)  # (B, T, H*hd)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GLM computes gate and up in one `gate_up_proj`
    whose output is [gate | up] (under tensor parallelism each rank holds [gate_r | up_r]).
    GPT-2: down(act(up(x))), no gate (act: GELU, tanh approximation unless hidden_act says)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.fused = config.fused_gate_up
        self.gated = not config.gpt2_blocks
        self.hidden_act = config.hidden_act
        if self.fused:
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=bias)
        elif self.gated:
            self.gate_proj = nn.Linear(d, f, bias=bias)
            self.up_proj = nn.Linear(d, f, bias=bias)
        else:
            self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(activation(self.up_proj(x), self.hidden_act))
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' ACT2FN[name] for GPT-2's activations (stages.model.config.GELU_ACTIVATIONS)."""
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"hidden_act={name!r} has no GPT-2 MLP here")


def sparse_moe_block(config: LlamaConfig) -> SparseMoeBlock:
    """The family's sparse MoE block of a layer (stages.model.moe)."""
    family = config.family
    routing = MoeRouting(top_k=config.num_experts_per_tok,
                         renormalize=family.renormalize_topk == "always" or config.norm_topk_prob,
                         capacity_factor=config.moe_capacity_factor, jitter=config.router_jitter_noise,
                         weights_in_fp32=config.model_type == "mixtral")
    return SparseMoeBlock(config.hidden_size, config.expert_width, config.num_experts, routing,
                          family.expert_names, shared_width=config.shared_expert_intermediate_size)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); GLM-4 also normalises each
    sub-block's output before its residual add (`post_self_attn_layernorm`, `post_mlp_layernorm`)."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = norm_layer(config, d)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = norm_layer(config, d)
        # the feed-forward sub-block: `mlp`, or the family's sparse block (Mixtral: `block_sparse_moe`)
        self.mlp_name = "mlp"
        if config.sparse_layers()[layer_idx]:
            self.mlp_name = config.family.moe_block
            setattr(self, self.mlp_name, sparse_moe_block(config))
        else:
            self.mlp = MLP(config)
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if config.sandwich_norms:
            self.post_self_attn_layernorm = norm_layer(config, d)
            self.post_mlp_layernorm = norm_layer(config, d)
        self.resid_pdrop = config.resid_pdrop  # GPT-2: dropout on each sub-block's output, in training

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: torch.Tensor | None = None, context=None) -> torch.Tensor:
        x = self.add_attention(x, self.self_attn(self.input_layernorm(x), cos, sin, segments, context))
        return self.add_mlp(x)

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention sub-block whose output is `attended`."""
        if self.post_self_attn_layernorm is not None:
            attended = self.post_self_attn_layernorm(attended)
        if self.resid_pdrop and self.training:
            attended = F.dropout(attended, self.resid_pdrop)
        return x + attended

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP sub-block."""
        h = getattr(self, self.mlp_name)(self.post_attention_layernorm(x))
        if self.post_mlp_layernorm is not None:
            h = self.post_mlp_layernorm(h)
        if self.resid_pdrop and self.training:
            h = F.dropout(h, self.resid_pdrop)
        return x + h


class LlamaModel(nn.Module):
    """Embedding (GPT-2: plus learned positions), the decoder layers (name-stable `ModuleDict`), final norm."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.gpt2_blocks:
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embd_pdrop = config.embd_pdrop
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_hidden_layers)})
        self.norm = norm_layer(config, config.hidden_size)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        """(B, T, d) input of the first layer: the token embeddings, plus, with learned positions
        (GPT-2), the embedding of each token's position (`position_ids` (B, T) of packed rows, else
        0..T-1; after `offset` prefix slots), with GPT-2's embedding dropout in training. A
        pipeline stage's model part calls the same method."""
        x = self.embed_tokens(input_ids)  # (B, T, d)
        table = getattr(self, "embed_positions", None)
        if table is None:
            return x
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = x + table(position_ids + offset)
        return F.dropout(x, self.embd_pdrop) if self.embd_pdrop and self.training else x


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. `forward(input_ids, labels, position_ids)` returns logits and, with labels,
    the mean next-token cross-entropy over labels != IGNORE_INDEX (labels are shifted inside, as in
    HF). `position_ids` (B, T) marks packed rows: positions restart at 0 for every example, and
    attention stays inside each example."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # also called by every pipeline stage; None with learned positions (GPT-2)
        self.rotary_emb = None if config.gpt2_blocks else RotaryEmbedding(config)
        self.gradient_checkpointing = False  # activation recompute, one block at a time
        # Replaced by tensor parallelism with the vocab-parallel loss when logits stay split.
        self.loss_function = causal_lm_loss
        # Set by tensor parallelism's sequence_parallel switch (stages.parallel.sequence.SequenceSplit):
        # the decoder layers' residual stream then holds each rank's share of the tokens (run_layers).
        self.sequence_parallel = None
        # Set by context parallelism (stages.parallel.context.ContextSplit): forward takes this rank's
        # tokens of sequences split over ranks (ContextSplit.split_batch), with their position ids.
        self.context_parallel = None

    def init_order(self) -> Iterator[tuple[nn.Parameter, str]]:
        """(parameter, "normal" | "zeros" | "ones") in the order `init_weights` fills them: matrices
        drawn from normal(0, initializer_range), biases zero, norms one. A tied lm_head comes twice
        (embedding, then head: the second draw is the one that stays). `stages.training.materialize`
        replays this order to give a rank only its slice of the same weights."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                yield module.weight, "normal"
                if getattr(module, "bias", None) is not None:
                    yield module.bias, "zeros"
            elif isinstance(module, RMSNorm):
                yield module.weight, "ones"
            elif isinstance(module, nn.LayerNorm):
                yield module.weight, "ones"
                yield module.bias, "zeros"

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, initializer_range) for matrices, zeros for biases, ones for norms (`init_order`)."""
        for param, kind in self.init_order():
            if kind == "normal":
                param.normal_(0.0, self.config.initializer_range, generator=generator)
            else:
                param.fill_(0.0 if kind == "zeros" else 1.0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_at: torch.Tensor | None = None):
        """logits (B, T, V) [and the loss, with labels]; with `logits_at` (B, T) bool, the logits of
        those positions only, (N, V) in row-major order (the norm and lm_head skip the others)."""
        if logits_at is not None and labels is not None:
            raise ValueError("logits_at with labels: the loss needs every position's logits; score the kept "
                             "logits with stages.model.loss.token_loss instead")
        if self.context_parallel is not None:
            if labels is not None:
                raise ValueError("a context-parallel model takes this rank's tokens from ContextSplit.split_batch "
                                 "and no labels (their targets are split with them)")
            if position_ids is None:  # unpacked rows: the tokens' places in them
                position_ids = self.context_parallel.local_positions(*input_ids.shape, input_ids.device)
        encoder = getattr(self, "prefix_encoder", None)
        if encoder is not None:  # prefix tuning through a projection: this step's prefix from its MLP
            encoder.place([layer.self_attn for layer in self.model.layers.values()], encoder())
        layers = self.model.layers.values()
        x = self.model.embed(input_ids, position_ids, prefix_length(list(layers)))  # (B, T, d)
        x = run_layers(layers, x, self.rotary_emb, recompute=self.gradient_checkpointing and self.training,
                       position_ids=position_ids, sequence_parallel=self.sequence_parallel,
                       context_parallel=self.context_parallel)
        if logits_at is not None:
            x = x[logits_at]  # (N, d)
        logits = self.lm_head(self.model.norm(x))  # (B, T, V) or (N, V)
        if labels is None:
            return logits
        loss = self.loss_function(logits, labels)
        if self.config.moe:
            loss = loss + self.router_loss()
        return logits, loss

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        """This model's (or pipeline stage's) sparse MoE blocks, in layer order."""
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def router_loss(self, group=None) -> torch.Tensor:
        """The routers' training losses of the last forward: router_aux_loss_coef x the load-balancing
        loss (transformers' formula, so `forward(ids, labels)`'s loss equals MixtralForCausalLM's with
        output_router_logits=True) plus router_z_loss_coef x the router z-loss; zero without records.
        The records are consumed (a later call without a forward in between returns zero). `group`:
        the context-parallel group, whose ranks hold parts of each sequence: this rank's share of
        the sequences' losses (stages.model.moe.load_balancing_loss)."""
        records = []
        for block in self.sparse_blocks():
            if block.record is not None:
                records.append(block.record)
                block.record = None
        if not records:
            return torch.zeros((), device=self.lm_head.weight.device)
        c = self.config
        loss = c.router_aux_loss_coef * load_balancing_loss(records, c.num_experts, group)
        if c.router_z_loss_coef:
            loss = loss + c.router_z_loss_coef * router_z_loss(records, group)
        return loss


def run_layers(layers: Iterable[DecoderLayer], x: torch.Tensor, rotary_emb: RotaryEmbedding | None,
               recompute: bool = False, position_ids: torch.Tensor | None = None,
               sequence_parallel=None, context_parallel=None) -> torch.Tensor:
    """Hidden states (B, T, d) through `layers` in order, with the RoPE tables of T positions (of
    `position_ids` (B, T) when given: packed rows, each example from position 0 and attending only
    to itself). With a prefix (prefix tuning) the real tokens start at position P, after the P
    prefix slots, as transformers numbers them behind peft's prefix cache. The one code path of
    the whole model and of each pipeline stage; `recompute` checkpoints one block at a time
    (activations are recomputed in backward). `sequence_parallel` (a
    `stages.parallel.sequence.SequenceSplit`, from tensor parallelism) pads the sequence to a multiple
    of the tensor-parallel degree, runs the layers on this rank's tokens and gathers them back.
    `context_parallel` (a `stages.parallel.context.ContextSplit`): x holds this rank's tokens of
    sequences split over ranks, `position_ids` their positions; attention reads the keys of all."""
    layers = list(layers)
    length = x.shape[1]
    if sequence_parallel is not None:
        x, position_ids = sequence_parallel.pad(x, position_ids)
    offset = prefix_length(layers)
    context = segments = None
    if context_parallel is not None:  # packed examples are found in the whole sequence
        context = context_parallel.attention(position_ids, recompute=recompute)
    elif position_ids is not None:
        segments = segment_ids(position_ids)  # (B, T)
    cos = sin = None  # learned positions (GPT-2): added to the embeddings, nothing to rotate
    if rotary_emb is not None:
        whole = x.shape[1] * (1 if context_parallel is None else context_parallel.world)  # every rank's tokens
        cos, sin = rotary_emb(whole + offset, x.device, x.dtype)  # (P+T, rd) each
        if position_ids is not None:  # (B, 1, T, rd)
            cos, sin = cos[position_ids + offset].unsqueeze(1), sin[position_ids + offset].unsqueeze(1)
        else:
            cos, sin = cos[offset:], sin[offset:]  # (T, rd)
    if sequence_parallel is not None:
        x = sequence_parallel.enter(x)  # (B, T/tp, d)
    for layer in layers:
        x = (checkpoint(layer, x, cos, sin, segments, context, use_reentrant=False) if recompute
             else layer(x, cos, sin, segments, context))
    return x if sequence_parallel is None else sequence_parallel.leave(x, length)


def prefix_length(layers: list[DecoderLayer]) -> int:
    """P of a prefix-tuned model's layers (every layer has the same), else 0."""
    key = getattr(layers[0].self_attn, "prefix_key", None) if layers else None
    return 0 if key is None else key.shape[1]


def build_model(config: LlamaConfig, seed: int | None = None, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build the model; with a seed, initialise deterministically from it. On device "meta"
    nothing is allocated (for planning large flavours)."""
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if str(device) != "meta" and seed is not None:
        model.init_weights(torch.Generator(device=device).manual_seed(seed))
    return model
