# A sweep's members (or a comparison's listed experiments) side by side: the chosen metrics of the
# chosen variants per experiment, and their mean and spread over seeds (stages/compare.py).
rule compare:
    conda: ENVIRONMENT
    input:
        comparison_inputs,
    output:
        csv="results/{comparison}/compare.csv",
        md="results/{comparison}/compare.md",
        plot=report("results/{comparison}/compare.png", caption="../report/compare.rst", category="Comparisons",
                    labels={"comparison": "{comparison}"}),
    wildcard_constraints:
        comparison=COMPARISON_NAMES,
    log:
        "results/{comparison}/logs/compare.log",
    params:
        spec=lambda wildcards: json.dumps(COMPARISONS[wildcards.comparison], sort_keys=True),
        # results/ (under a module prefix or a storage provider's local copies too): the output's
        # path before the comparison's name; the members' evaluations are inputs there
        results=lambda wildcards, output: output.csv.removesuffix(f"{wildcards.comparison}/compare.csv"),
        **code_params("stages.compare"),
    localrule: True
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.compare --spec {params.spec:q} "
        "--out-dir \"$(dirname {output.csv:q})\" --results {params.results:q} > {log} 2>&1"
