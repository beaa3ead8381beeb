# pandas aggregates every variant's metrics and the rules' benchmark TSVs.
rule report:
    input:
        evals=all_eval_files,
        export="results/{experiment}/export",
        plan="results/{experiment}/plan.json",  # recorded with the results
    output:
        quant_eval="results/{experiment}/quant_eval.json",
        csv=report("results/{experiment}/report.csv", caption="../report/metrics.rst", category="Metrics"),
        md="results/{experiment}/report.md",
    log:
        "results/{experiment}/logs/report.log",
    benchmark:
        "results/{experiment}/benchmarks/report.tsv"
    params:
        source=value("quantize", "source"),
        variants=quant_variants,
        start=start_variant,
        quantize=section("quantize"),
    resources:
        **cluster_resources("report"),
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.report --experiment-dir results/{wildcards.experiment} "
        "--source {params.source} --start {params.start} --variants {params.variants} --csv {output.csv} --md {output.md} "
        "--quant-eval {output.quant_eval} --quantize-config {params.quantize:q} > {log} 2>&1"
