# A sweep's members (or a comparison's listed experiments) side by side: the chosen metrics of the
# chosen variants per experiment, and their mean and spread over seeds (stages/compare.py).
rule compare:
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
        **code_params("stages.compare"),
    localrule: True
    # results/ is the output's grandparent: the members' evaluations are inputs there
    shell:
        "LLM_LIFECYCLE_CODE={params.code} python -m stages.compare --spec {params.spec:q} "
        "--out-dir \"$(dirname {output.csv:q})\" --results \"$(dirname \"$(dirname {output.csv:q})\")\" > {log} 2>&1"
