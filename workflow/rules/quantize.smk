# Weight-only post-training quantization of `quantize.source`, one output per variant
# (GPTQ variants also read the experiment's data for calibration).
rule quantize:
    conda: ENVIRONMENT
    input:
        unpack(quantize_input),
    output:
        directory("results/{experiment}/quant/{variant}"),
    log:
        "results/{experiment}/logs/quantize_{variant}.log",
    benchmark:
        "results/{experiment}/benchmarks/quantize_{variant}.tsv"
    params:
        config=quantize_section,
        data=quantize_data_flag,
        **code_params("stages.quantize", exclude=other_methods_modules),
    resources:
        **cluster_resources("quantize"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.quantize --source {input.source} --out {output} --variant {wildcards.variant} "
        "{params.data} --config {params.config:q} > {log} 2>&1"
