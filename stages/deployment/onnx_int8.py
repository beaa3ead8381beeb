"""The INT8 variant of an exported decoder, and what it costs against the float graph.

`quantize_int8` is onnxruntime's block-wise quantization (`MatMulNBitsQuantizer`, bits 8): the
weight of every MatMul whose second input is an initializer (q/k/v/o, gate/up/down, an untied
lm_head) becomes int8, symmetric, one scale per `block_size` weights along the input dimension,
in a `MatMulNBits` node (the operator onnxruntime-genai's model builder writes), with
accuracy_level 4: the product runs on int8 kernels with the activations quantized per block of
the same size at run time (without it the CPU kernel dequantizes the weights every call: 11
tokens/s against 39 for the float graph on SmolLM2-135M). Attention's activation x activation
MatMuls, the embedding (a Gather), norms and the KV cache stay float32, so the graph's inputs and
outputs are unchanged and the same generator and onnxruntime-genai run it.

Why weight-only: onnxruntime's dynamic quantization (`quantize_dynamic`: int8 weights per channel
and activations quantized per tensor at run time, DynamicQuantizeLinear + MatMulInteger) kept the
debug and tiny models (perplexity x1.004) but not SmolLM2-135M, whose activations have the
outlier channels SmoothQuant exists for: on 8 windows of 128 tokens of English text its top-1
agreement with the float graph was 0.630 and perplexity x1.690 (x1.083 with down_proj left float);
8-bit MatMulNBits with 32-weight blocks gave 0.957 and x1.0036 at accuracy_level 4 (65 tokens/s
at batch 1, dynamic int8 62, float 39), 0.988 and x0.9998 with float activations (11 tokens/s);
4-bit blocks 0.712, x1.241.

`int8_quality` compares the two graphs on the same sequences:
    top1_agreement   share of positions where both graphs' argmax over the vocabulary agree
    ppl_float, ppl_int8, ppl_ratio
                     perplexity of each graph on `sequences` (position t predicts token t + 1),
                     and int8 / float (1.0: no loss)
    greedy_agreement share of greedily generated tokens equal position by position, from the
                     same left-padded prompts (a divergence early makes the rest differ too)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.deployment.onnx_generate import OnnxDecoder, greedy_generate
from stages.metrics.logit_agreement import top1_agreement

log = logging.getLogger(__name__)

ACCURACY_LEVEL = 4  # MatMulNBits computes in int8 (activations quantized per block at run time)


def quantize_int8(src: Path, dst: Path, block_size: int = 32, external_data: bool = False) -> None:
    """Write `dst`, the 8-bit weight-only quantization of the float graph `src` (see module docstring)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=8, block_size=block_size, is_symmetric=True,
                                     accuracy_level=ACCURACY_LEVEL)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=external_data)


def perplexity(decoder: OnnxDecoder, sequences: np.ndarray, attention_mask: np.ndarray | None = None) -> float:
    """exp(mean NLL) of `sequences` (B, L) under `decoder`, positions 1.. scored (masked ones not)."""
    mask = np.ones_like(sequences) if attention_mask is None else attention_mask
    logits = decoder.logits(sequences, mask)[:, :-1].astype(np.float64)  # (B, L-1, V)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = sequences[:, 1:]
    nll = -np.take_along_axis(log_probs, target[..., None], axis=-1)[..., 0]  # (B, L-1)
    scored = mask[:, 1:] * mask[:, :-1]  # a prediction from a pad or of a pad is not scored
    return float(np.exp((nll * scored).sum() / scored.sum()))


@dataclass
class Int8Quality:
    top1_agreement: float
    ppl_float: float
    ppl_int8: float
    ppl_ratio: float
    greedy_agreement: float
    greedy_tokens: int


def int8_quality(float_decoder: OnnxDecoder, int8_decoder: OnnxDecoder, sequences: np.ndarray,
                 sequence_mask: np.ndarray, prompts: np.ndarray, prompt_mask: np.ndarray, max_new_tokens: int,
                 pad_token_id: int) -> Int8Quality:
    """The INT8 graph against the float one (see module docstring): scores on `sequences` (B, L)
    where `sequence_mask` is 1, greedy generation (no eos: every row runs `max_new_tokens`) from
    the left-padded `prompts`."""
    top1 = top1_agreement(float_decoder.logits(sequences, sequence_mask), int8_decoder.logits(sequences, sequence_mask),
                          where=sequence_mask.astype(bool))
    ppl_float = perplexity(float_decoder, sequences, sequence_mask)
    ppl_int8 = perplexity(int8_decoder, sequences, sequence_mask)
    width = prompts.shape[1]
    want = greedy_generate(float_decoder, prompts, prompt_mask, max_new_tokens, None, pad_token_id)[:, width:]
    got = greedy_generate(int8_decoder, prompts, prompt_mask, max_new_tokens, None, pad_token_id)[:, width:]
    quality = Int8Quality(top1, ppl_float, ppl_int8, ppl_int8 / ppl_float, float((want == got).mean()), int(want.size))
    log.info("int8 vs float: top-1 agreement %.4f, perplexity %.3f vs %.3f (x%.4f), greedy tokens agree %.4f",
             quality.top1_agreement, ppl_int8, ppl_float, quality.ppl_ratio, quality.greedy_agreement)
    return quality
