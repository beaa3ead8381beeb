"""Pipeline parallelism for the project's Llama, executed by `torch.distributed.pipelining`.

Three pieces, applied to a model that was built (from the seed) as a whole, so a pipelined run
starts from exactly the single-process weights:

- `split_layers` — a pure function from (layers, pp, vpp) to the layer indices of each model
  chunk, in pipeline order. Chunk c runs on pipeline rank c % pp (the interleaved/"looped" layout
  of Megatron and of `torch.distributed.pipelining`, where `stage_index_to_group_rank(i) = i % pp`).
- `build_stage_module` — one chunk as an `nn.Module` whose parameters keep the names of the
  single-device model (`model.embed_tokens.weight` on the first chunk, `model.layers.<i>.*` with
  the global layer index, `model.norm.weight` and `lm_head.weight` on the last), so checkpoints
  and optimizer state do not depend on the layout.
- `PipelineRunner` — the `PipelineStage`s of this rank plus a `Schedule1F1B` (vpp == 1) or a
  `ScheduleInterleaved1F1B` (vpp > 1); `train_step(input_ids, labels)` runs forward and backward
  over the micro-batches and leaves the gradients in `.grad` (the optimizer step is the caller's).

Loss scaling. The schedules call `loss_fn` once per micro-batch, backpropagate each micro-batch
loss separately (so gradients accumulate as a sum over micro-batches), and, with
`scale_grads=True`, divide the gradients by `n_microbatches` at the end. That reproduces the
full-batch mean only when every micro-batch holds the same number of counted label tokens. The
runner instead uses `scale_grads=False` and a loss that divides each micro-batch's summed token
cross-entropy by the number of counted tokens of the *whole* batch (known before the step), so
the sum of micro-batch losses, and of their gradients, equals the single-process
`causal_lm_loss` over the full batch whatever the IGNORE_INDEX pattern (up to float summation order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from stages.model.llama import LlamaForCausalLM, LlamaModel, prefix_length, run_layers
from stages.model.loss import causal_lm_loss, counted_tokens


def split_layers(num_layers: int, pipeline_parallel_degree: int, virtual_pp_degree: int = 1,
                 *, embedding_weight: float = 0.0, head_weight: float = 0.0) -> list[list[int]]:
    """Contiguous, balanced layer indices of each of the pp * vpp model chunks, in pipeline order.

    Every chunk gets at least one layer. Layers are handed out one at a time to the chunk with the
    lowest load, where a chunk's load is its layer count plus `embedding_weight` (first chunk) or
    `head_weight` (last chunk), both in units of one decoder layer; ties go to the earlier chunk.
    With the default weights of 0 the chunks get floor(L/n) or ceil(L/n) layers and the remainder
    goes to the first chunks: 10 layers on 4 chunks -> 3, 3, 2, 2. With `head_weight=1` the last
    chunk (norm, lm_head, loss) gets one layer fewer where the numbers allow it.

    Chunk c runs on pipeline rank c % pipeline_parallel_degree, so rank r holds chunks r, r + pp,
    r + 2 pp, ... Raises ValueError, with the numbers, when the split is impossible.
    """
    pp, vpp = pipeline_parallel_degree, virtual_pp_degree
    if pp < 1 or vpp < 1:
        raise ValueError(f"pipeline_parallel_degree={pp} and virtual_pp_degree={vpp} must both be >= 1")
    if embedding_weight < 0 or head_weight < 0:
        raise ValueError(f"embedding_weight={embedding_weight} and head_weight={head_weight} must be >= 0")
    chunks = pp * vpp
    if num_layers < chunks:
        raise ValueError(
            f"cannot split num_layers={num_layers} into pipeline_parallel_degree={pp} x "
            f"virtual_pp_degree={vpp} = {chunks} chunks of at least one layer each; "
            f"lower the degrees or use a model with >= {chunks} layers"
        )
    extra = [0.0] * chunks
    extra[0] += embedding_weight
    extra[-1] += head_weight
    counts = [1] * chunks
    for _ in range(num_layers - chunks):
        c = min(range(chunks), key=lambda i: (counts[i] + extra[i], i))
        counts[c] += 1
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


class _ModelPart(nn.Module):
    """Stands in for `LlamaModel` inside a stage: the same attribute names, only this chunk's parts
    (the first chunk: the embeddings, learned positions included, and `LlamaModel.embed`)."""

    embed = LlamaModel.embed

    def __init__(self, model: LlamaModel, layers: nn.ModuleDict, is_first: bool, is_last: bool):
        super().__init__()
        if is_first:
            self.embed_tokens = model.embed_tokens
            if hasattr(model, "embed_positions"):
                self.embed_positions = model.embed_positions
            self.embd_pdrop = model.embd_pdrop
        self.layers = layers
        if is_last:
            self.norm = model.norm


class PipelineStageModule(nn.Module):
    """One model chunk. First chunk: input_ids (B, T) -> hidden (B, T, d); middle chunks: hidden ->
    hidden; last chunk: hidden -> logits (B, T, V). A chunk that is both maps ids to logits.

    Parameter names equal the single-device model's (`model.layers.<global index>...`). RoPE
    cos/sin are recomputed here from the sequence length of the incoming tensor, never sent, by
    the model's own `RotaryEmbedding` and `run_layers`: every rope type (dynamic NTK, YaRN's
    attention factor) and each layer's sliding window behave exactly as in the whole model.
    """

    def __init__(self, model: LlamaForCausalLM, layer_ids: Sequence[int], is_first: bool, is_last: bool):
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        self.layer_ids = [int(i) for i in layer_ids]
        layers = nn.ModuleDict({str(i): model.model.layers[str(i)] for i in self.layer_ids})
        self.model = _ModelPart(model.model, layers, is_first, is_last)
        if is_last:
            self.lm_head = model.lm_head
        self.rotary_emb = model.rotary_emb  # the same object: one RoPE for the model and its stages
        self.gradient_checkpointing = model.gradient_checkpointing
        self.sequence_parallel = model.sequence_parallel  # each stage's layers on this rank's tokens
        self.context_parallel = model.context_parallel  # every stage on this rank's tokens of each row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = None  # under context parallelism this rank's tokens' places in their (unpacked) rows
        if self.context_parallel is not None:
            positions = self.context_parallel.local_positions(x.shape[0], x.shape[1], x.device)
        if self.is_first:
            x = self.model.embed(x, positions, prefix_length(list(self.model.layers.values())))  # (B, T) -> (B, T, d)
        x = run_layers(self.model.layers.values(), x, self.rotary_emb,
                       recompute=self.gradient_checkpointing and self.training, position_ids=positions,
                       sequence_parallel=self.sequence_parallel, context_parallel=self.context_parallel)
        if self.is_last:
            x = self.lm_head(self.model.norm(x))  # (B, T, V)
        return x


def build_stage_module(model: LlamaForCausalLM, layer_ids: Sequence[int], is_first: bool,
                       is_last: bool) -> PipelineStageModule:
    """The chunk of `model` holding `layer_ids` (plus the embedding if first, norm and lm_head if
    last), sharing the parameter tensors of `model` (no copy: drop `model` afterwards to free the
    other chunks). Its named_parameters() are a subset of `model.named_parameters()`, same names."""
    missing = [i for i in layer_ids if str(i) not in model.model.layers]
    if missing:
        raise ValueError(f"layer_ids {missing} are not in the model, which has "
                         f"{len(model.model.layers)} layers")
    return PipelineStageModule(model, layer_ids, is_first, is_last)


def token_sum_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch divided by `normalizer` (the number of
    counted label tokens of the whole batch): summed over micro-batches it equals `causal_lm_loss`."""
    return causal_lm_loss(logits, labels, reduction="sum", normalizer=normalizer)


class PipelineRunner:
    """This rank's pipeline stages of `model` and the schedule that drives them.

    model: the full model, built from the seed identically on every rank; this rank keeps only its
        chunks (`self.modules`), whose parameters are shared with `model`.
    pp_group: the pipeline process group (None: the default group); its size must equal
        `pipeline_parallel_degree`. Chunk c of `split_layers(...)` runs on pp-group rank c % pp.
    n_microbatches: the batch (dim 0) is cut into this many equal micro-batches; 1F1B needs
        n_microbatches >= pp, interleaved 1F1B needs n_microbatches % max(1, n_microbatches // pp) == 0.
    loss_fn: None (default) for the exact full-batch causal LM token mean (see the module
        docstring); or a callable(logits, labels) -> per-micro-batch *mean* loss, in which case the
        schedule's scale_grads divides the gradients by n_microbatches and the reported loss is
        the mean of the micro-batch losses.
    """

    def __init__(self, model: LlamaForCausalLM, pipeline_parallel_degree: int, virtual_pp_degree: int = 1,
                 n_microbatches: int = 1, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 pp_group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 embedding_weight: float = 0.0, head_weight: float = 0.0):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        pp, vpp = pipeline_parallel_degree, virtual_pp_degree
        group_size = dist.get_world_size(pp_group)
        if group_size != pp:
            raise ValueError(f"the pipeline process group has {group_size} ranks but "
                             f"pipeline_parallel_degree={pp}")
        if model.config.tie_word_embeddings and pp * vpp > 1:
            raise ValueError("tie_word_embeddings=True with pipeline_parallel_degree x virtual_pp_degree = "
                             f"{pp * vpp} chunks: the shared embedding/lm_head would live on two stages "
                             "and need a gradient all-reduce between them, which is not implemented")
        if pp == 1 and vpp > 1:
            raise ValueError(f"virtual_pp_degree={vpp} needs pipeline_parallel_degree > 1")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches={n_microbatches} must be >= 1")
        self.pp, self.vpp, self.n_microbatches = pp, vpp, n_microbatches
        self.group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.device = torch.device(device)
        self.split = split_layers(model.config.num_hidden_layers, pp, vpp,
                                  embedding_weight=embedding_weight, head_weight=head_weight)
        num_chunks = pp * vpp
        self.stage_ids = [self.pp_rank + k * pp for k in range(vpp)]
        self.modules = [build_stage_module(model, self.split[c], is_first=c == 0, is_last=c == num_chunks - 1)
                        for c in self.stage_ids]
        for m in self.modules:
            if not any(p.is_meta for p in m.parameters()):  # a lazy model is filled (and placed) later
                m.to(self.device)
        self.stages = [PipelineStage(m, c, num_chunks, self.device, group=pp_group)
                       for m, c in zip(self.modules, self.stage_ids)]
        self.is_last = any(m.is_last for m in self.modules)
        self.is_first = any(m.is_first for m in self.modules)
        self.context_parallel = model.context_parallel  # the batch is split before the schedule (training step)

        self._user_loss = loss_fn
        self._normalizer = 1.0
        self._step_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # train_step(loss=)
        if loss_fn is None:
            schedule_loss, scale_grads = self._micro_batch_loss, False
        else:
            schedule_loss, scale_grads = loss_fn, True
        if vpp == 1:
            self.schedule = Schedule1F1B(self.stages[0], n_microbatches, loss_fn=schedule_loss,
                                         scale_grads=scale_grads)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches, loss_fn=schedule_loss,
                                                    scale_grads=scale_grads)

    @property
    def last_rank(self) -> int:
        """The pipeline-group rank holding the last chunk (the logits and the loss)."""
        return (self.pp * self.vpp - 1) % self.pp

    def _micro_batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The default schedule's loss of one micro-batch: this step's `loss`, else its share of the token mean."""
        if self._step_loss is not None:
            return self._step_loss(output, target)
        return token_sum_loss(output, target, self._normalizer)

    def named_parameters(self):
        """(name, parameter) of this rank's chunks, with the single-device model's names."""
        for m in self.modules:
            yield from m.named_parameters()

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def train(self, mode: bool = True) -> "PipelineRunner":
        for m in self.modules:
            m.train(mode)
        return self

    def zero_grad(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=True)

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, normalizer: float | None = None,
                   loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one batch (B, T) over the micro-batches; returns the batch loss
        (detached, a 0-d tensor) on every rank of the pipeline group. Gradients *accumulate* into
        the local parameters' .grad: call zero_grad() (or the optimizer's) before each step.
        Every rank passes the same batch; only the first chunk reads input_ids and only the last
        reads labels. `normalizer` replaces the default divisor of the summed loss (this batch's
        learned-token count). `loss` (runners built without `loss_fn` only) replaces the token mean
        for this step: callable(logits of a micro-batch, its rows of `labels`) -> that micro-batch's
        share of the batch loss (the shares add up to the loss returned); `labels` is then any
        tensor with the batch's rows in dim 0, e.g. labels and per-row values side by side."""
        B = input_ids.shape[0]
        if B % self.n_microbatches:
            raise ValueError(f"batch size {B} is not divisible by n_microbatches={self.n_microbatches}")
        if loss is not None and self._user_loss is not None:
            raise ValueError("train_step(loss=...) needs a runner built without loss_fn (the schedule sums shares)")
        if loss is None and self._user_loss is None:  # the token mean: its divisor
            if normalizer is not None:
                self._normalizer = float(normalizer)  # e.g. the global batch's count under data parallel
            else:
                # all labels ignored: the single-process loss is nan (0/0); keep the gradients finite at 0
                self._normalizer = float(max(int(counted_tokens(labels)), 1))
        losses: list[torch.Tensor] = []
        args = (input_ids.to(self.device),) if self.is_first else ()
        target = labels.to(self.device) if self.is_last else None
        self._step_loss = loss
        try:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self._step_loss = None
        if self.is_last:
            total = torch.stack([l.detach().float() for l in losses]).sum()
            batch_loss = total if self._user_loss is None else total / self.n_microbatches
        else:
            batch_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(batch_loss, group=self.group, group_src=self.last_rank)
        return batch_loss
