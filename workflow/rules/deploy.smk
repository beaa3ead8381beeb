# Artifacts for runtimes outside the pipeline (stages/deploy.py), chosen by the `deploy` section:
# GGUF files of the quantization source (llama.cpp, Ollama, LM Studio) and A8W8 variants in the
# compressed-tensors format (vLLM, transformers). Each is checked with the runtime users deploy
# with (transformers' GGUF loader, for a mixture of experts transformers on our reading of the
# file; transformers with compressed-tensors) on the experiment's validation text before its
# directory appears. deploy/manifest.json lists them with the ONNX
# graphs of export/ and their checks: `snakemake --cores all results/llama/deploy/manifest.json`.
rule deploy_gguf:
    conda: ENVIRONMENT
    input:
        model=quant_source_dir,
        data="results/{experiment}/data",
    output:
        directory("results/{experiment}/deploy/gguf-{gguf_type}"),
    wildcard_constraints:
        gguf_type="f32|f16|q8_0|q4_0",
    log:
        "results/{experiment}/logs/deploy_gguf-{gguf_type}.log",
    benchmark:
        "results/{experiment}/benchmarks/deploy_gguf-{gguf_type}.tsv"
    params:
        config=section("deploy"),
        **code_params("stages.deploy"),
    resources:
        **cluster_resources("deploy"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.deploy gguf --model {input.model} --type {wildcards.gguf_type} --data {input.data} "
        "--out {output} --config {params.config:q} > {log} 2>&1"


rule deploy_compressed_tensors:
    conda: ENVIRONMENT
    input:
        model="results/{experiment}/quant/{variant}",
        data="results/{experiment}/data",
    output:
        directory("results/{experiment}/deploy/compressed-tensors-{variant}"),
    log:
        "results/{experiment}/logs/deploy_compressed-tensors-{variant}.log",
    benchmark:
        "results/{experiment}/benchmarks/deploy_compressed-tensors-{variant}.tsv"
    params:
        config=section("deploy"),
        **code_params("stages.deploy"),
    resources:
        **cluster_resources("deploy"),
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.deploy compressed-tensors --model {input.model} --data {input.data} --out {output} "
        "--config {params.config:q} > {log} 2>&1"


rule deploy_manifest:
    conda: ENVIRONMENT
    input:
        export="results/{experiment}/export",
        artifacts=deploy_artifacts,
    output:
        "results/{experiment}/deploy/manifest.json",
    log:
        "results/{experiment}/logs/deploy_manifest.log",
    params:
        **code_params("stages.deploy"),
    localrule: True  # reads a few meta.json files
    # the experiment dir is the output's grandparent: export/ and deploy/*/ are inputs, so they are
    # there under a module prefix and in a storage provider's local copies alike
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.deploy manifest "
        "--experiment-dir \"$(dirname \"$(dirname {output:q})\")\" --out {output} > {log} 2>&1"
