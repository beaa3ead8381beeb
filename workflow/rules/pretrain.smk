# 4D-parallel pretraining: world_size = data x tensor x pipeline parallel degrees (checked when the
# workflow is parsed), DeepSpeed ZeRO (`pretrain.sharding`) over the data-parallel group.
# Locally torchrun starts the ranks on this node (gloo on CPU, NCCL on GPU); inside a SLURM job
# (the slurm profile) srun starts one task per rank, with `tasks` = world_size declared below.
rule pretrain:
    input:
        "results/{experiment}/data",
    output:
        directory("results/{experiment}/pretrain"),
    log:
        "results/{experiment}/logs/pretrain.log",
    benchmark:
        "results/{experiment}/benchmarks/pretrain.tsv"
    params:
        model=section("model"),
        config=section("pretrain"),
        nproc=pretrain_world_size,
    threads: 2
    resources:
        nodes=1,
        tasks=pretrain_world_size,
        cpus_per_task=2,
        mem_mb=8000,
        runtime=120,
    conda:
        "../../environment.yml"
    shell:
        "if [ -n \"${{SLURM_JOB_ID:-}}\" ]; then launch=\"srun --ntasks {params.nproc} python\"; "
        "else launch=\"torchrun --standalone --nproc_per_node {params.nproc}\"; fi; "
        "$launch -m stages.pretrain --data {input} --out {output} "
        "--model-config {params.model:q} --config {params.config:q} > {log} 2>&1"
