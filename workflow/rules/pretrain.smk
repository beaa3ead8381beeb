# 4D-parallel pretraining: world_size = data x tensor x pipeline parallel degrees (checked when the
# workflow is parsed), DeepSpeed ZeRO (`pretrain.sharding`) over the data-parallel group.
# Locally torchrun starts the ranks on this node (gloo on CPU, NCCL on GPU); inside a SLURM job
# (the slurm profile) srun starts one task per rank, with `tasks` = world_size declared below.
# Checkpoints go to results/{experiment}/checkpoints/pretrain/, which is not an output: Snakemake
# leaves it alone when a job fails, and rerunning the same command resumes from the newest complete
# checkpoint. The output directory appears only when training is done (atomic rename).
# With unified_checkpoint: false and tp or pp > 1 the ranks write their slices to pretrain_shards/
# (rule pretrain_sharded) and merge_tp makes pretrain/ of them.
rule pretrain:
    input:
        unpack(pretrain_inputs),
    output:
        directory("results/{experiment}/pretrain"),
    wildcard_constraints:
        experiment=UNIFIED_PRETRAIN,
    log:
        "results/{experiment}/logs/pretrain.log",
    benchmark:
        "results/{experiment}/benchmarks/pretrain.tsv"
    params:
        model=section("model"),
        config=section("pretrain"),
        nproc=pretrain_world_size,
        checkpoints=lambda wildcards: f"results/{wildcards.experiment}/checkpoints/pretrain",
        init=init_flag,
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
        "$launch -m stages.pretrain --data {input.data} --out {output} --checkpoints {params.checkpoints} "
        "--model-config {params.model:q} --config {params.config:q} {params.init} > {log} 2>&1"


use rule pretrain as pretrain_sharded with:
    output:
        directory("results/{experiment}/pretrain_shards"),
    wildcard_constraints:
        experiment=SHARDED_PRETRAIN,


# PaddleNLP's merge_tp_params: the tensor/pipeline-parallel slices -> the single-device HF layout.
rule merge_tp:
    input:
        "results/{experiment}/pretrain_shards",
    output:
        directory("results/{experiment}/pretrain"),
    wildcard_constraints:
        experiment=SHARDED_PRETRAIN,
    log:
        "results/{experiment}/logs/merge_tp.log",
    benchmark:
        "results/{experiment}/benchmarks/merge_tp.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.merge_tp --shards {input} --out {output} > {log} 2>&1"
