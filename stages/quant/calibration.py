"""Calibration inputs for GPTQ: a (num_samples, seq_len) int64 tensor of token ids, built from the
experiment's prepared data as `quantize.calibration` says.

    num_samples  windows wanted (fewer when the source holds fewer whole windows, with a warning)
    seq_len      tokens per window
    source       corpus: non-overlapping windows of the training token split (`results/<n>/data`,
                         `stages.data.corpus.TokenFile`), drawn at random without replacement;
                 sft:    training prompts with their answers (`results/<n>/data/sft/train.json`),
                         encoded as finetune encodes them (`stages.data.sft.encode_example`, in the
                         data's `sft_format`), shuffled, concatenated and cut into windows (pad-free
                         packing: no pad token, every position is a real token);
                 a path: a JSON-lines file of the SFT format ({"src": ..., "tgt": ...}), treated as sft
    seed         the random choice of windows / the shuffle of the records
    dtype        the calibration forwards' precision: float32, bfloat16 (autocast; the weights and
                 what the methods accumulate stay float32, `stages.quant.block_calibration`), or auto
                 (the default): bfloat16 where this machine multiplies it natively, else float32
                 (decided by the quantize job and recorded in meta.json)

Calibration windows are unpadded because `gptq_quantize_model` calls the model with input_ids alone,
so every position counts in the Hessians. A source that yields no whole window is a
`CalibrationError` naming the key, raised before the model is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.data.corpus import TokenFile
from stages.data.sft import SftDataError, SftRecord, encode_example, read_sft_file
from stages.data.sft_format import data_chat_format, format_name
from stages.errors import InputError
from stages.metrics.host_memory import available_memory_bytes

log = logging.getLogger(__name__)

KEY = "quantize.calibration"
SOURCES = ("corpus", "sft")  # anything else is a path
DTYPES = ("float32", "bfloat16", "auto")


class CalibrationError(InputError):
    """The calibration settings cannot give a single window; the message names the key and the fix."""


@dataclass(frozen=True)
class CalibrationSettings:
    """`quantize.calibration`, defaults from the schema (stages.config fills them)."""

    num_samples: int = 32  # windows of seq_len tokens
    seq_len: int = 128  # tokens per window
    source: str = "corpus"  # corpus | sft | path to a JSON-lines SFT file
    seed: int = 0  # choice of windows, shuffle of SFT records
    dtype: str = "auto"  # float32 | bfloat16 | auto: the calibration forwards' precision

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CalibrationError(f"{KEY}.dtype={self.dtype!r} must be one of {list(DTYPES)}")
        if self.num_samples < 1:
            raise CalibrationError(f"{KEY}.num_samples={self.num_samples}: the calibration set would be empty; "
                                   "use at least 1 (32 is a good start for small models)")
        if self.seq_len < 2:
            raise CalibrationError(f"{KEY}.seq_len={self.seq_len} must be at least 2 tokens")

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> "CalibrationSettings":
        return cls(**{k: section[k] for k in ("num_samples", "seq_len", "source", "seed", "dtype") if k in section})


def corpus_windows(data_dir: str | Path, num_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n, seq_len) non-overlapping windows of the training split, n = min(num_samples, available),
    chosen at random with `seed`. Windows cross document boundaries (with their eos), as in pretraining."""
    tokens = TokenFile.open(data_dir, "train").tokens
    available = len(tokens) // seq_len
    if available == 0:
        raise CalibrationError(f"{KEY}.source=corpus: the training split of {data_dir} holds {len(tokens)} "
                               f"tokens, fewer than {KEY}.seq_len={seq_len}; the calibration set is empty. "
                               f"Lower {KEY}.seq_len or use source: sft")
    n = _how_many(num_samples, available, f"{data_dir} (train split)")
    starts = np.random.default_rng(seed).choice(available, size=n, replace=False) * seq_len
    windows = np.stack([np.asarray(tokens[s:s + seq_len], dtype=np.int64) for s in starts])  # (n, seq_len)
    return torch.from_numpy(windows)


def sft_windows(records: list[SftRecord], tokenizer, num_samples: int, seq_len: int, seed: int,
                chat: bool = False, where: str = "sft") -> torch.Tensor:
    """(n, seq_len) windows of the encoded examples (prompt and answer, `encode_example` with
    src_length = max_length = seq_len), in an order shuffled with `seed`, concatenated and cut:
    short examples share a window, none is padded. Only as many records are encoded as needed."""
    order = np.random.default_rng(seed).permutation(len(records))
    need = num_samples * seq_len
    stream: list[int] = []
    for i in order:
        ids, _ = encode_example(tokenizer, records[i], seq_len, seq_len, chat)
        stream += ids
        if len(stream) >= need:
            break
    available = len(stream) // seq_len
    if available == 0:
        raise CalibrationError(f"{KEY}.source={where}: its {len(records)} examples encode to {len(stream)} tokens, "
                               f"fewer than {KEY}.seq_len={seq_len}; the calibration set is empty. Lower "
                               f"{KEY}.seq_len or use more examples")
    n = _how_many(num_samples, available, where)
    return torch.tensor(stream[:n * seq_len], dtype=torch.int64).view(n, seq_len)  # (n, seq_len)


def _how_many(num_samples: int, available: int, where: str) -> int:
    if available < num_samples:
        log.warning("%s holds %d whole calibration windows, fewer than %s.num_samples=%d: using %d",
                    where, available, KEY, num_samples, available)
    return min(num_samples, available)


def calibration_ids(settings: CalibrationSettings, data_dir: str | Path | None, tokenizer=None,
                    model_dir: str | Path | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The calibration ids (n, seq_len) int64 and their description for meta.json.

    `data_dir`: the experiment's prepared data (needed by corpus and sft); `tokenizer` (and the
    `model_dir` it came from, for the tokenizer check): needed by sft and a path."""
    s = settings
    info: dict[str, Any] = {"source": s.source, "num_samples": s.num_samples, "seq_len": s.seq_len, "seed": s.seed}
    if s.source in SOURCES and data_dir is None:
        raise CalibrationError(f"{KEY}.source={s.source} reads the experiment's prepared data: pass --data "
                               "results/<name>/data")
    if s.source == "corpus":
        ids = corpus_windows(data_dir, s.num_samples, s.seq_len, s.seed)
    else:
        if tokenizer is None:
            raise CalibrationError(f"{KEY}.source={s.source} needs the model's tokenizer to encode SFT records")
        path = Path(data_dir) / "sft" / "train.json" if s.source == "sft" else Path(s.source)
        if not path.is_file():
            what = "run the prepare stage first" if s.source == "sft" else \
                "use corpus, sft or the path of a JSON-lines file of {\"src\": ..., \"tgt\": ...} records"
            raise CalibrationError(f"{KEY}.source={s.source}: {path} is not a file; {what}")
        chat = data_chat_format(tokenizer, model_dir, data_dir)
        try:
            records = read_sft_file(path)
        except SftDataError as e:  # e.g. an empty file: say which key brought it in
            raise CalibrationError(f"{KEY}.source={s.source}: {e}") from None
        ids = sft_windows(records, tokenizer, s.num_samples, s.seq_len, s.seed, chat, where=s.source)
        info["sft_format"] = format_name(chat)
    info.update(num_windows=ids.shape[0], num_tokens=ids.numel())
    log.info("calibration: %d windows of %d tokens from %s", ids.shape[0], s.seq_len, s.source)
    return ids, info


def calibration_memory_bytes(num_parameters: int, widths: list[tuple[int, int]], num_windows: int,
                             seq_len: int, batch: int) -> dict[str, int]:
    """An upper estimate, in bytes, of what layer-by-layer calibration (GPTQ, A8W8) holds at once:

        model       the float32 model plus the source state dict: 8 bytes per parameter
        activations the inputs and outputs of one decoder block for every window, float32, and
                    GPTQ's reused attention outputs (`FinishedOutputs`):
                    3 * num_windows * seq_len * hidden (hidden = the narrowest input width)
        forward     one block's forward on `batch` windows: its widest layer's input and output
                    and the attention scores (hidden / 64 heads of seq_len^2), float32
        hessians    GPTQ's Hessian of the widest layer and its working copies: 4 * in^2 float32
    `widths`: (out, in) of every quantized layer."""
    hidden = min(i for _, i in widths)
    widest_in, widest_out = max(i for _, i in widths), max(o for o, _ in widths)
    parts = {
        "model": 8 * num_parameters,
        "activations": 3 * num_windows * seq_len * hidden * 4,
        "forward": batch * seq_len * (widest_in + widest_out + max(1, hidden // 64) * seq_len) * 4 * 2,
        "hessians": 4 * widest_in * widest_in * 4,
    }
    return {**parts, "total": sum(parts.values())}


def check_calibration_memory(num_parameters: int, widths: list[tuple[int, int]], num_windows: int,
                             seq_len: int, batch: int, available: int | None = None) -> int:
    """The estimate of `calibration_memory_bytes` (total), or a CalibrationError before any model
    is loaded when it exceeds the available memory (`available`, default MemAvailable)."""
    need = calibration_memory_bytes(num_parameters, widths, num_windows, seq_len, batch)
    available = available_memory_bytes() if available is None else available
    if available is not None and need["total"] > available:
        gib = 2**30
        detail = ", ".join(f"{k} {v / gib:.2f}" for k, v in need.items() if k != "total")
        raise CalibrationError(
            f"calibration needs about {need['total'] / gib:.2f} GiB ({detail} GiB) but {available / gib:.2f} GiB "
            f"are available: {num_windows} windows of {seq_len} tokens; lower {KEY}.num_samples or {KEY}.seq_len "
            "(the activations part scales with their product), or run on a machine with more memory")
    return need["total"]
