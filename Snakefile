# The LLM lifecycle as one workflow: prepare (+ plan) -> pretrain -> finetune {sft, lora, prefix} ->
# merge_lora -> quantize {wint8, wint4, gptq-w4, a8w8-smooth} -> export (ONNX) + deploy (GGUF,
# compressed-tensors) -> evaluate -> report.
# `snakemake --cores all results/llama/quant_eval.json` builds the chain for experiment `llama`.
from snakemake.utils import min_version

from stages.config import check_yaml_syntax

min_version("9.0")

# A YAML syntax error is reported as file:line:column (Snakemake's loader drops the position).
check_yaml_syntax("config/config.yaml")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"  # the front page of `snakemake --report report.html`


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/deploy.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/predict.smk"
include: "workflow/rules/compare.smk"


rule all:
    input:
        DEFAULT_TARGETS,
    default_target: True
