"""How `stages.predict` generates: its settings (the `predict` config section, plus the command
line's chat_template and backend), checked, and the flags workflow/rules/predict.smk passes.
Torch-free, so Snakemake checks a predict section while it parses the workflow."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stages.errors import InputError
from stages.inference import BACKENDS
from stages.settings import complete as complete_section
from stages.settings import defaults as section_defaults

DECODE_STRATEGIES = ("greedy_search", "sampling")
CHAT_TEMPLATE_CHOICES = ("auto", "true", "false")


SECTION_DEFAULTS: dict[str, Any] = section_defaults("predict")  # the schema's, its one source


@dataclass(frozen=True)
class PredictSettings:
    """How to generate; field names are PaddleNLP's (llm/predictor.py), but `max_length` counts the
    prompt too, as finetune.sft's max_length does (see "Lengths" in the module docstring). The
    defaults are the `predict` section's in workflow/schemas/config.schema.yaml."""

    batch_size: int = SECTION_DEFAULTS["batch_size"]  # records per generate call
    src_length: int = SECTION_DEFAULTS["src_length"]  # prompt tokens kept (left truncation)
    max_length: int = SECTION_DEFAULTS["max_length"]  # prompt + generated tokens, per record
    # a further cap on generated tokens (None: max_length decides)
    max_new_tokens: int | None = SECTION_DEFAULTS["max_new_tokens"]
    decode_strategy: str = SECTION_DEFAULTS["decode_strategy"]  # greedy_search or sampling
    top_k: int = SECTION_DEFAULTS["top_k"]  # sampling: keep the k most likely tokens (0: all)
    top_p: float = SECTION_DEFAULTS["top_p"]  # sampling: nucleus mass kept (1.0: all)
    temperature: float = SECTION_DEFAULTS["temperature"]  # sampling: logits divided by this
    seed: int = SECTION_DEFAULTS["seed"]  # torch.manual_seed before the first batch
    # the decode engine's compiled step (torch.compile on a StaticCache), where the engine runs the model
    compile: bool = SECTION_DEFAULTS["compile"]
    # greedy, one record per batch: draft tokens prompt lookup lets one forward check (0: off)
    prompt_lookup_num_tokens: int = SECTION_DEFAULTS["prompt_lookup_num_tokens"]
    # auto | true | false; not a config key: the rule's input lies in the data dir, so `auto`
    # follows its index.json (sft_format), as evaluate does
    chat_template: str = "auto"
    # torch | onnxruntime; not a config key either: which runtime runs --model (onnxruntime: an
    # export directory with model.onnx, greedy only)
    backend: str = "torch"

    def __post_init__(self):
        for key in ("batch_size", "src_length", "max_length"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise InputError(f"predict.{key}={getattr(self, key)!r} must be a positive integer")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
            raise InputError(f"predict.max_new_tokens={self.max_new_tokens!r} must be a positive integer or null")
        if self.src_length >= self.max_length:
            raise InputError(f"predict.src_length={self.src_length} must be below predict.max_length="
                             f"{self.max_length} (prompt + generated tokens), or no token could be generated")
        if self.decode_strategy not in DECODE_STRATEGIES:
            raise InputError(f"predict.decode_strategy={self.decode_strategy!r}; valid: {', '.join(DECODE_STRATEGIES)}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"predict.top_k={self.top_k!r} must be an integer >= 0 (0: no top-k filtering)")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"predict.top_p={self.top_p!r} must be in (0, 1] (1.0: no nucleus filtering)")
        if not self.temperature > 0.0:
            raise InputError(f"predict.temperature={self.temperature!r} must be positive")
        if self.chat_template not in CHAT_TEMPLATE_CHOICES:
            raise InputError(f"predict.chat_template={self.chat_template!r}; valid: {', '.join(CHAT_TEMPLATE_CHOICES)}")
        if self.backend not in BACKENDS:
            raise InputError(f"--backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if not isinstance(self.compile, bool):
            raise InputError(f"predict.compile={self.compile!r} must be true or false")
        if not isinstance(self.prompt_lookup_num_tokens, int) or self.prompt_lookup_num_tokens < 0:
            raise InputError(f"predict.prompt_lookup_num_tokens={self.prompt_lookup_num_tokens!r} must be an integer "
                             ">= 0 (0: off)")
        if self.prompt_lookup_num_tokens and self.compile:
            raise InputError("predict.prompt_lookup_num_tokens with predict.compile: prompt lookup checks its drafts "
                             "in several-token forwards, which the compiled one-token step does not run; choose one")
        if self.prompt_lookup_num_tokens and self.backend == "onnxruntime":
            raise InputError("--backend onnxruntime runs its own graph; predict.prompt_lookup_num_tokens is for the "
                             "torch backend")
        if self.backend == "onnxruntime" and self.compile:
            raise InputError("--backend onnxruntime runs its own graph; predict.compile is for the torch backend")
        if self.backend == "onnxruntime" and self.decode_strategy != "greedy_search":
            raise InputError(f"--backend onnxruntime generates with greedy_search only, not {self.decode_strategy}")


DEFAULTS: dict[str, Any] = asdict(PredictSettings())  # the command line's: the section's, chat_template, backend


def settings_flags(section: dict[str, Any]) -> str:
    """The command-line flags of a `predict` config section (workflow/rules/predict.smk's params),
    checked; missing keys take the schema's defaults, a null max_new_tokens is left out."""
    section = complete_section(section, "predict")
    PredictSettings(**section)  # a bad value fails while Snakemake builds the DAG, before any job
    return " ".join(f"--{key.replace('_', '-')} {str(value).lower() if isinstance(value, bool) else value}"
                    for key, value in section.items() if value is not None)
