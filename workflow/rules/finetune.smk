# Full SFT, LoRA and prefix tuning of the pretrained model (or the imported checkpoint,
# results/{experiment}/base) on the src/tgt data, all on the distributed training engine in the
# layout of their finetune.<method> section. Locally torchrun starts the ranks; inside a SLURM job
# srun does, with `tasks` = world_size.
rule finetune:
    input:
        model=finetune_base,
        data="results/{experiment}/data",
    output:
        directory("results/{experiment}/{method}"),
    log:
        "results/{experiment}/logs/finetune_{method}.log",
    benchmark:
        "results/{experiment}/benchmarks/finetune_{method}.tsv"
    params:
        config=finetune_section,
        nproc=finetune_world_size,
        checkpoints=lambda wildcards: f"results/{wildcards.experiment}/checkpoints/{wildcards.method}",
    threads: 1
    resources:
        nodes=1,
        tasks=finetune_world_size,
        mem_mb=4000,
        runtime=60,
    conda:
        "../../environment.yml"
    shell:
        "if [ -n \"${{SLURM_JOB_ID:-}}\" ]; then launch=\"srun --ntasks {params.nproc} python\"; "
        "else launch=\"torchrun --standalone --nproc_per_node {params.nproc}\"; fi; "
        "$launch -m stages.finetune --method {wildcards.method} --model {input.model} "
        "--data {input.data} --out {output} --config {params.config:q} --checkpoints {params.checkpoints} "
        "> {log} 2>&1"
