# 4D-parallel pretraining: world_size = data x tensor x pipeline parallel degrees (checked when the
# workflow is parsed), DeepSpeed ZeRO (`pretrain.sharding`) over the data-parallel group.
# stages.launch starts the ranks: torchrun on this machine (gloo on CPU, NCCL on GPU), or inside a
# SLURM job (the slurm profile) `srun --overlap` with one task per rank over the job's nodes; nodes,
# tasks and memory come from the experiment's memory plan; the job reads its own estimate
# (results/{experiment}/plan/pretrain.json) and logs it beside its measured peak.
# Checkpoints go to checkpoints/pretrain/ beside the output (results/{experiment}/checkpoints/pretrain/,
# derived in the job from {output}), which is not an output: Snakemake leaves it alone when a job
# fails, and rerunning the same command resumes from the newest complete checkpoint. With a storage
# provider {output} is the output's local copy, so the checkpoints stay on the local side
# (--local-storage-prefix, node-local scratch on a cluster): a rerun there resumes; a rerun elsewhere
# starts again from step 0, which gives the same weights, only later. Nothing half-written reaches
# storage: the output is uploaded once the job has ended. The output directory appears only when
# training is done (atomic rename).
# With unified_checkpoint: false and tp or pp > 1 the ranks write their slices to pretrain_shards/
# (rule pretrain_sharded) and merge_tp makes pretrain/ of them.
rule pretrain:
    conda: ENVIRONMENT
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
        init=init_flag,
        **code_params("stages.launch", "stages.pretrain"),
    threads: 2
    resources:
        **cluster_resources("pretrain"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.launch --nproc {resources.tasks} --nodes {resources.nodes} "
        "-- stages.pretrain --data {input.data} --out {output} --checkpoints \"$(dirname {output:q})/checkpoints/pretrain\" "
        "--model-config {params.model:q} --config {params.config:q} {params.init} --plan {input.plan} "
        "> {log} 2>&1"


use rule pretrain as pretrain_sharded with:
    output:
        directory("results/{experiment}/pretrain_shards"),
    wildcard_constraints:
        experiment=SHARDED_PRETRAIN,


# PaddleNLP's merge_tp_params: the tensor/pipeline-parallel slices -> the single-device HF layout.
rule merge_tp:
    conda: ENVIRONMENT
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
    params:
        **code_params("stages.merge_tp"),
    threads: 1
    resources:
        **cluster_resources("merge_tp"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.merge_tp --shards {input} --out {output} > {log} 2>&1"
