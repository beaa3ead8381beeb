# Batch prediction: one variant answers every record of the experiment's SFT dev file.
# `snakemake --cores all results/llama/predictions/lora.jsonl` (any variant evaluate knows: base,
# pretrain, sft, lora, prefix, lora-merged, and each quantize.variants name for quant/<name>).
# The input lies in the prepare data dir, so the predictor's --chat-template auto follows its
# index.json (sft_format), as evaluate does. The flags come from the experiment's `predict`
# section, complete since the workflow's config check filled the schema's defaults.
from stages.serving.generation_settings import settings_flags


rule predict:
    conda: ENVIRONMENT
    input:
        unpack(variant_inputs),
        data="results/{experiment}/data",
    output:
        predictions="results/{experiment}/predictions/{variant}.jsonl",
        summary="results/{experiment}/predictions/{variant}.summary.json",
    log:
        "results/{experiment}/logs/predict_{variant}.log",
    benchmark:
        "results/{experiment}/benchmarks/predict_{variant}.tsv"
    params:
        flags=lambda wildcards: settings_flags(experiment(wildcards)["predict"]),
        model_dir=variant_model,
        base=base_flag,
        **code_params("stages.predict"),
    threads: 1
    resources:
        **cluster_resources("predict"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.predict --model {params.model_dir} {params.base} "
        "--input {input.data}/sft/dev.json --out {output.predictions} {params.flags} > {log} 2>&1"
