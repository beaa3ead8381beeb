# The memory plan (python -m stages.plan). The workflow already refused, when it was parsed, a layout
# that does not fit cluster.device_memory_gb / node_memory_gb. Two rules record it:
# - plan_job: one training job's planned per-device memory, results/{experiment}/plan/{job}.json, the
#   input its training rule reads (it logs the plan beside the measured peak). Its params are what
#   the estimate depends on (the architecture and that job's section), so changing a LoRA setting
#   re-plans and retrains LoRA only, and a time limit or partition re-plans nothing.
# - plan: the whole plan with every job's SLURM resources, results/{experiment}/plan.json (the report
#   takes it, so the default target records it).
rule plan_job:
    conda: ENVIRONMENT
    output:
        "results/{experiment}/plan/{job}.json",
    wildcard_constraints:
        job="pretrain|finetune_sft|finetune_lora|finetune_prefix|align",
    log:
        "results/{experiment}/logs/plan_{job}.log",
    benchmark:
        "results/{experiment}/benchmarks/plan_{job}.tsv"
    params:
        experiment=plan_job_params,
        **code_params("stages.plan"),
    threads: 1
    localrule: True  # one JSON file in a second: not worth a cluster job
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.plan --experiment {wildcards.experiment} --experiment-json {params.experiment:q} "
        "--job {wildcards.job} --out {output} > {log} 2>&1"


rule plan:
    conda: ENVIRONMENT
    output:
        "results/{experiment}/plan.json",
    log:
        "results/{experiment}/logs/plan.log",
    benchmark:
        "results/{experiment}/benchmarks/plan.tsv"
    params:
        experiment=plan_params,
        **code_params("stages.plan"),
    threads: 1
    localrule: True
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.plan --experiment {wildcards.experiment} --experiment-json {params.experiment:q} "
        "--out {output} > {log} 2>&1"
