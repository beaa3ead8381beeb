# Tokenizer + tokenized corpus + normalised SFT data. With model.model_name_or_path the imported
# checkpoint's own tokenizer is used (no tokenizer is trained).
rule prepare:
    conda: ENVIRONMENT
    input:
        unpack(prepare_inputs),
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
        **code_params("stages.prepare"),
    resources:
        **cluster_resources("prepare"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.prepare --out {output} --config {params.config:q} "
        "{params.tokenizer} > {log} 2>&1"


# A local pretrained checkpoint (model.model_name_or_path), checked and copied into the experiment:
# supported architecture, safetensors only, a tokenizer, our Llama's logits equal transformers'.
rule import_base:
    conda: ENVIRONMENT
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
        **code_params("stages.import_base"),
    threads: 1
    resources:
        **cluster_resources("import_base"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.import_base --source {params.source:q} --out {output} "
        "> {log} 2>&1"


# A sweep member's data and starting model (results/<member>/{data,pretrain,base}) are copies of its
# shared upstream experiment's, made once for every member with the same model, data and
# pretraining sections (stages/sweeps.py). Hard links where the file system allows (artifacts are
# never changed in place: a rerun replaces the whole directory), a plain copy otherwise; not a
# symlink, which a storage provider cannot hold and a module prefix would break. The copy's
# .snakemake_timestamp (Snakemake's mark of a directory's time) is its own file, not a link.
rule share_upstream:
    conda: ENVIRONMENT
    input:
        shared_artifact,
    output:
        directory("results/{experiment}/{artifact}"),
    wildcard_constraints:
        experiment=SHARING_UPSTREAM,
        artifact="data|pretrain|base",
    log:
        "results/{experiment}/logs/share_{artifact}.log",
    localrule: True
    shell:
        "((cp -al {input:q} {output:q} 2>/dev/null || (rm -rf {output:q} && cp -a {input:q} {output:q})) "
        "&& rm -f {output:q}/.snakemake_timestamp) > {log} 2>&1"  # Snakemake's own mark: not shared
