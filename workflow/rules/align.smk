# Preference alignment (DPO, IPO, SimPO, ORPO) of `align.source` (results/{experiment}/sft by
# default) on the pairs prepare writes to data/preference/, when align.enabled. Two rules:
# - score_pairs: the reference model's log-probs of every pair, once (dpo and ipo only; simpo and orpo
#   are reference-free). Its params are only the keys that change the scores (the source and the
#   pairs' encoding), so a new beta, method or learning rate reruns `align` and not this.
# - align: training on the engine in the align section's layout, launched as finetune is; nodes,
#   tasks and memory from the experiment's plan (plan/align.json). tuning full writes a model,
#   tuning lora a peft adapter whose base is the source (the `align` variant is evaluated with it).
#   With align.mix_ratio, the files of align.mix_datasets are inputs too (editing one reruns it).
#   Checkpoints go to checkpoints/align/ beside the output, as pretraining's (pretrain.smk says why).


rule score_pairs:
    conda: ENVIRONMENT
    input:
        unpack(scoring_inputs),
    output:
        directory("results/{experiment}/align_reference"),
    log:
        "results/{experiment}/logs/score_pairs.log",
    benchmark:
        "results/{experiment}/benchmarks/score_pairs.tsv"
    params:
        config=scoring_section,
        **code_params("stages.score_pairs"),
    threads: 1
    resources:
        **cluster_resources("score_pairs"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.score_pairs --model {input.model} --data {input.data} "
        "--out {output} --config {params.config:q} > {log} 2>&1"


rule align:
    conda: ENVIRONMENT
    input:
        unpack(align_inputs),
        mix=align_mix_files,
    output:
        directory("results/{experiment}/align"),
    log:
        "results/{experiment}/logs/align.log",
    benchmark:
        "results/{experiment}/benchmarks/align.tsv"
    params:
        config=section("align"),
        reference=reference_flag,
        **code_params("stages.launch", "stages.align"),
    threads: 1
    priority: align_priority
    resources:
        **cluster_resources("align"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.launch --nproc {resources.tasks} --nodes {resources.nodes} "
        "-- stages.align --model {input.model} --data {input.data} {params.reference} --out {output} "
        "--config {params.config:q} --checkpoints \"$(dirname {output:q})/checkpoints/align\" "
        "--plan {input.plan} > {log} 2>&1"
