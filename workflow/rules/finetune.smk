# Full SFT, LoRA and prefix tuning of the pretrained model (or the imported checkpoint,
# results/{experiment}/base) on the src/tgt data, all on the distributed training engine in the
# layout of their finetune.<method> section. stages.launch starts the ranks (torchrun here, or the
# module itself for one rank; srun inside a SLURM job); nodes, tasks and memory come from the experiment's plan.
# Checkpoints go to checkpoints/<method>/ beside the output, as pretraining's (pretrain.smk says why).
rule finetune:
    conda: ENVIRONMENT
    input:
        model=finetune_base,
        data="results/{experiment}/data",
        plan="results/{experiment}/plan/finetune_{method}.json",
        mix=finetune_mix_files,
    output:
        directory("results/{experiment}/{method}"),
    log:
        "results/{experiment}/logs/finetune_{method}.log",
    benchmark:
        "results/{experiment}/benchmarks/finetune_{method}.tsv"
    params:
        config=finetune_section,
        **code_params("stages.launch", "stages.finetune"),
    threads: 1
    priority: finetune_priority
    resources:
        **cluster_resources("finetune"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.launch --nproc {resources.tasks} --nodes {resources.nodes} "
        "-- stages.finetune --method {wildcards.method} --model {input.model} --data {input.data} --out {output} "
        "--config {params.config:q} --checkpoints \"$(dirname {output:q})/checkpoints/{wildcards.method}\" "
        "--plan {input.plan} > {log} 2>&1"
