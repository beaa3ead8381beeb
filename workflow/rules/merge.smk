# Fold the LoRA adapter into its base model (plain HF weights, logits checked against the adapter).
rule merge_lora:
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
