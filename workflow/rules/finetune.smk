# Full SFT, LoRA and prefix tuning of the pretrained model on the src/tgt data.
rule finetune:
    input:
        model="results/{experiment}/pretrain",
        data="results/{experiment}/data",
    output:
        directory("results/{experiment}/{method}"),
    log:
        "results/{experiment}/logs/finetune_{method}.log",
    benchmark:
        "results/{experiment}/benchmarks/finetune_{method}.tsv"
    params:
        config=finetune_section,
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.finetune --method {wildcards.method} --model {input.model} "
        "--data {input.data} --out {output} --config {params.config:q} > {log} 2>&1"
