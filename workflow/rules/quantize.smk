# Weight-only post-training quantization of `quantize.source`, one output per variant.
rule quantize:
    input:
        quantize_input,
    output:
        directory("results/{experiment}/quant/{variant}"),
    log:
        "results/{experiment}/logs/quantize_{variant}.log",
    benchmark:
        "results/{experiment}/benchmarks/quantize_{variant}.tsv"
    params:
        config=section("quantize"),
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.quantize --source {input} --out {output} --variant {wildcards.variant} "
        "--config {params.config:q} > {log} 2>&1"
