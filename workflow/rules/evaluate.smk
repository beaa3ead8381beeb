# Perplexity, exact match, BLEU-4, ROUGE-L, size and generation speed of one variant, and the
# lm-evaluation-harness tasks evaluate.lm_eval_tasks names.
rule evaluate:
    conda: ENVIRONMENT
    input:
        unpack(variant_inputs),
        data="results/{experiment}/data",
        lm_eval_tasks=lm_eval_task_files,
    output:
        "results/{experiment}/eval/{variant}.json",
    log:
        "results/{experiment}/logs/evaluate_{variant}.log",
    benchmark:
        "results/{experiment}/benchmarks/evaluate_{variant}.tsv"
    params:
        config=section("evaluate"),
        src_length=value("finetune", "sft", "src_length"),
        model_dir=variant_model,
        base=base_flag,
        **code_params("stages.evaluate"),
    threads: 1
    resources:
        **cluster_resources("evaluate"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.evaluate --model {params.model_dir} {params.base} "
        "--data {input.data} --out {output} --variant {wildcards.variant} --config {params.config:q} "
        "--src-length {params.src_length} > {log} 2>&1"
