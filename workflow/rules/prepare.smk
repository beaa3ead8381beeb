# Tokenizer + tokenized corpus + normalised SFT data. With model.model_name_or_path the imported
# checkpoint's own tokenizer is used (no tokenizer is trained).
rule prepare:
    input:
        prepare_inputs,
    output:
        directory("results/{experiment}/data"),
    wildcard_constraints:
        experiment=OWN_UPSTREAM,
    log:
        "results/{experiment}/logs/prepare.log",
    benchmark:
        "results/{experiment}/benchmarks/prepare.tsv"
    params:
        config=section("data"),
        tokenizer=tokenizer_flag,
    resources:
        **cluster_resources("prepare"),
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.prepare --out {output} --config {params.config:q} {params.tokenizer} > {log} 2>&1"


# A local pretrained checkpoint (model.model_name_or_path), checked and copied into the experiment:
# supported architecture, safetensors only, a tokenizer, our Llama's logits equal transformers'.
rule import_base:
    input:
        base_source_files,
    output:
        directory("results/{experiment}/base"),
    wildcard_constraints:
        experiment=FROM_CHECKPOINT,
    log:
        "results/{experiment}/logs/import_base.log",
    benchmark:
        "results/{experiment}/benchmarks/import_base.tsv"
    params:
        source=value("model", "model_name_or_path"),
    threads: 1
    resources:
        **cluster_resources("import_base"),
    conda:
        "../../environment.yml"
    shell:
        "python -m stages.import_base --source {params.source:q} --out {output} > {log} 2>&1"


# A sweep member's data and starting model (results/<member>/{data,pretrain,base}) are links to its
# shared upstream experiment's, made once for every member with the same model, data and
# pretraining sections (stages/sweeps.py).
rule share_upstream:
    input:
        shared_artifact,
    output:
        directory("results/{experiment}/{artifact}"),
    wildcard_constraints:
        experiment=SHARING_UPSTREAM,
        artifact="data|pretrain|base",
    log:
        "results/{experiment}/logs/share_{artifact}.log",
    params:
        target=lambda wildcards: f"../{SHARED_UPSTREAM[wildcards.experiment]}/{wildcards.artifact}",
    localrule: True
    conda:
        "../../environment.yml"
    shell:
        "ln -sfn {params.target:q} {output:q} > {log} 2>&1"
