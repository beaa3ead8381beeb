# pandas aggregates every variant's metrics and the rules' benchmark TSVs; matplotlib draws the
# plots. The report()-tagged files make `snakemake --report report.html` a page per experiment.
rule report:
    conda: ENVIRONMENT
    input:
        evals=all_eval_files,
        export="results/{experiment}/export",
        deploy="results/{experiment}/deploy/manifest.json",
        plan="results/{experiment}/plan.json",  # recorded with the results
        training=training_dirs,  # their train_log.csv: the training plot
        benchmarks=report_benchmarks,  # the stage timings table and plot
    output:
        quant_eval=report("results/{experiment}/quant_eval.json", caption="../report/quant_eval.rst",
                          category="{experiment}", subcategory="Tables", labels={"file": "quant_eval.json"}),
        csv=report("results/{experiment}/report.csv", caption="../report/metrics.rst",
                   category="{experiment}", subcategory="Tables", labels={"file": "report.csv (every metric)"}),
        md="results/{experiment}/report.md",
        training=report("results/{experiment}/report/training.png", caption="../report/training.rst",
                        category="{experiment}", subcategory="Plots", labels={"file": "training curves"}),
        quantization=report("results/{experiment}/report/quantization.png", caption="../report/quantization.rst",
                            category="{experiment}", subcategory="Plots", labels={"file": "quantization trade-off"}),
        stages=report("results/{experiment}/report/stages.png", caption="../report/stages.rst",
                      category="{experiment}", subcategory="Plots", labels={"file": "stage time and memory"}),
        quality=report("results/{experiment}/report/quality.csv", caption="../report/quality.rst",
                       category="{experiment}", subcategory="Tables", labels={"file": "quality"}),
        size=report("results/{experiment}/report/size.csv", caption="../report/size.rst",
                    category="{experiment}", subcategory="Tables", labels={"file": "size and memory"}),
        speed=report("results/{experiment}/report/speed.csv", caption="../report/speed.rst",
                     category="{experiment}", subcategory="Tables", labels={"file": "speed"}),
        timings=report("results/{experiment}/report/stages.csv", caption="../report/stage_timings.rst",
                       category="{experiment}", subcategory="Tables", labels={"file": "stage timings"}),
        deploy=report("results/{experiment}/report/deploy.csv", caption="../report/deploy.rst",
                      category="{experiment}", subcategory="Tables", labels={"file": "deployment"}),
    log:
        "results/{experiment}/logs/report.log",
    benchmark:
        "results/{experiment}/benchmarks/report.tsv"
    params:
        source=value("quantize", "source"),
        variants=quant_variants,
        start=start_variant,
        quantize=section("quantize"),
        align=align_source_flag,
        figures_dir=subpath(output.training, parent=True),
        **code_params("stages.report"),
    resources:
        **cluster_resources("report"),
    # the experiment dir is quant_eval.json's: eval/, benchmarks/ and the training dirs are inputs, so
    # they are there under a module prefix and in a storage provider's local copies alike
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.report --experiment-dir \"$(dirname {output.quant_eval:q})\" "
        "--source {params.source} --start {params.start} --variants {params.variants} --csv {output.csv} --md {output.md} "
        "--quant-eval {output.quant_eval} --figures-dir {params.figures_dir} --quantize-config {params.quantize:q} "
        "--deploy-manifest {input.deploy}{params.align} "
        "> {log} 2>&1"
