rule prepare:
    input:
        corpus_files,
    output:
        directory("results/{experiment}/data"),
    log:
        "results/{experiment}/logs/prepare.log",
    benchmark:
        "results/{experiment}/benchmarks/prepare.tsv"
    params:
        config=section("data"),
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.prepare --out {output} --config {params.config:q} > {log} 2>&1"
