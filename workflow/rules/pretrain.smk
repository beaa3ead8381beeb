# Data-parallel pretraining: torchrun launches `world_size` ranks on this node (gloo on CPU,
# NCCL on GPU); DeepSpeed applies the ZeRO stage from `pretrain.sharding`.
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
        tasks=1,
        cpus_per_task=pretrain_world_size,
        mem_mb=8000,
        runtime=120,
    conda:
        "../../environment.yml"
    shell:
        "torchrun --standalone --nproc_per_node {params.nproc} -m stages.pretrain "
        "--data {input} --out {output} --model-config {params.model:q} --config {params.config:q} "
        "> {log} 2>&1"
