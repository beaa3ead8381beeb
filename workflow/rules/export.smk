# The deployable artifact of the quantization source: ONNX, checked in onnxruntime against torch.
rule export:
    conda: ENVIRONMENT
    input:
        quant_source_dir,
    output:
        directory("results/{experiment}/export"),
    log:
        "results/{experiment}/logs/export.log",
    benchmark:
        "results/{experiment}/benchmarks/export.tsv"
    params:
        config=section("export"),
        **code_params("stages.export"),
    resources:
        **cluster_resources("export"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.export --model {input} --out {output} --config {params.config:q} > {log} 2>&1"
