# Fold the LoRA adapter into its base model (plain HF weights, logits checked against the adapter).
rule merge_lora:
    conda: ENVIRONMENT
    input:
        adapter="results/{experiment}/lora",
        base=finetune_base,
    output:
        directory("results/{experiment}/lora-merged"),
    log:
        "results/{experiment}/logs/merge_lora.log",
    benchmark:
        "results/{experiment}/benchmarks/merge_lora.tsv"
    params:
        **code_params("stages.merge"),
    resources:
        **cluster_resources("merge_lora"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.merge --adapter {input.adapter} --base {input.base} --out {output} > {log} 2>&1"


# The aligned adapter (align.tuning: lora) folded into the model it aligned (align.source): the
# variant `align-merged`, evaluated beside `align` and quantizable (quantize.source: align-merged).
use rule merge_lora as merge_align with:
    input:
        adapter="results/{experiment}/align",
        base=align_source_dir,
    output:
        directory("results/{experiment}/align-merged"),
    log:
        "results/{experiment}/logs/merge_align.log",
    benchmark:
        "results/{experiment}/benchmarks/merge_align.tsv"
    resources:
        **cluster_resources("merge_align"),
