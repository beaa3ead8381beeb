# The memory plan (python -m stages.plan): per-device memory of every training job of the experiment
# in its layout, and the SLURM resources derived from it. The workflow already refused, when it was
# parsed, a layout that does not fit cluster.device_memory_gb / node_memory_gb; this rule records the
# plan in results/{experiment}/plan.json, which every training rule reads (it logs the planned memory
# beside the measured peak).
rule plan:
    output:
        "results/{experiment}/plan.json",
    log:
        "results/{experiment}/logs/plan.log",
    benchmark:
        "results/{experiment}/benchmarks/plan.tsv"
    params:
        experiment=plan_params,
    threads: 1
    resources:
        **cluster_resources("plan"),
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.plan --experiment {wildcards.experiment} --experiment-json {params.experiment:q} "
        "--out {output} > {log} 2>&1"
