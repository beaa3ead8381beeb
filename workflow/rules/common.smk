# Config validation, wildcard constraints and input functions shared by every rule.
# Validation runs when the workflow is parsed, so bad input is reported before any job starts.
import glob
import json
import re
from pathlib import Path

from stages.checkpoint.source import family_of, read_source_config
from stages.cluster.resources import single_process_resources
from stages.config import ConfigError, align_enabled, check_config, finetune_source, load_schema, needs_reference
from stages.config import pretrain_enabled, sharded_output
from stages.config import experiment as named_experiment
from stages.data.validate import check_data_section, check_mix_datasets, mix_files
from stages.model.config import FLAVOURS
from stages.model.rope_types import depends_on_length
from stages.plan import check_plan
from stages.provenance.code import closure, file_digest, fingerprint, source_path
from stages.quant.variants import BUILTIN_VARIANTS, CALIBRATED_METHODS, METHOD_MODULES, spec_method, variant_settings
from stages.sweeps import expand as expand_sweeps

# The software of every job, workflow/envs/environment.yml (the repository's environment.yml links to
# it): the conda twin of pyproject.toml's pins (tests/unit/test_environment.py checks they agree),
# relative to the rule files in workflow/rules/ and inside workflow/, so a copy of the workflow or a
# module import has it too (Snakemake reads it when it records a job's metadata). Used only with
# `--software-deployment-method conda`; jobs run `python -m stages.<verb>` from the working directory,
# so run Snakemake from the repository root then (docs/workflow.md, "Software").
ENVIRONMENT = "../envs/environment.yml"

# Sweeps (and plain comparisons) first: each sweep's rows become ordinary experiments, members that
# share their upstream (model, data, pretraining) link to one hidden `shared-<hash>` experiment
# that makes it (stages/sweeps.py). Then everything is validated once, here: unknown keys (closest
# name), types and values (the JSON schema), relations between keys; every default filled
# (stages.config.check_config; stages read complete sections).
_USER_EXPERIMENTS = list((config.get("experiments") or {}) if isinstance(config.get("experiments"), dict) else [])
_expanded, COMPARISONS = expand_sweeps(config)
_checked = check_config(_expanded)
config.clear()
config.update(_checked)
# member -> the hidden experiment whose data and starting model it links to
SHARED_UPSTREAM = {m: up for spec in COMPARISONS.values() for m, up in spec["shared"].items()}
for _spec in COMPARISONS.values():  # the variant each member's forgetting (ppl_ratio) is measured against
    _spec["starts"] = {m: finetune_source(config["experiments"][m]) for m in _spec["members"]}
# what `snakemake` builds without a target: the experiments the config lists and every comparison
# (a sweep's members are built as the comparison needs them; the hidden upstreams as members need them)
DEFAULT_TARGETS = [f"results/{name}/quant_eval.json" for name in _USER_EXPERIMENTS] + [
    f"results/{key}/compare.md" for key in COMPARISONS]

for _name, _experiment in config["experiments"].items():
    check_data_section(_experiment["data"], _name, Path.cwd())  # paths are relative to the workdir
    check_mix_datasets(_experiment, _name, Path.cwd())  # finetune.<method> and align

# The memory plan of every experiment (stages/plan.py): a training layout that cannot fit the declared
# device (or node) memory is refused here, before any job is submitted, with the nearest layout that
# fits. The plans also give each job's SLURM resources (nodes, tasks, memory), see cluster_resources.
PLANS = {_name: check_plan(_name, _experiment) for _name, _experiment in config["experiments"].items()}

# The names a target path may hold come from the schema and the config, so that a path naming
# anything else is refused while the DAG is built, before any job starts.
_ROOT_SCHEMA = load_schema()
_SCHEMA = _ROOT_SCHEMA["$defs"]["experiment"]["properties"]
EXPERIMENT_NAME = _ROOT_SCHEMA["properties"]["experiments"]["propertyNames"]["pattern"].strip("^$")
FINETUNE_METHODS = list(_SCHEMA["finetune"]["properties"])  # sft, lora, prefix


def _one_of(names):
    """A wildcard regex matching exactly these experiment names (none: matches nothing)."""
    return "|".join(re.escape(n) for n in names) or "(?!)"


# Experiments that make their own data and starting model (not sweep members that link to a shared one).
_OWNERS = {n: e for n, e in config["experiments"].items() if n not in SHARED_UPSTREAM}
OWN_UPSTREAM = _one_of(list(_OWNERS))
SHARING_UPSTREAM = _one_of(list(SHARED_UPSTREAM))
SHARDED_PRETRAIN = _one_of([n for n, e in _OWNERS.items() if sharded_output(e["pretrain"])])
UNIFIED_PRETRAIN = _one_of([n for n, e in _OWNERS.items() if not sharded_output(e["pretrain"])])
# Experiments that start from a local checkpoint (model.model_name_or_path): rule import_base.
FROM_CHECKPOINT = _one_of([n for n, e in _OWNERS.items() if e["model"]["model_name_or_path"]])
COMPARISON_NAMES = _one_of(list(COMPARISONS))
FINETUNED_VARIANTS = ["sft", "lora", "prefix", "lora-merged"]
ALIGNED_VARIANTS = ("align", "align-merged")  # the aligned model, and its merge when it is a LoRA adapter


wildcard_constraints:
    experiment=EXPERIMENT_NAME,  # a name the schema allows; an undefined one is refused by experiment()
    method="|".join(FINETUNE_METHODS),
    variant=r"[A-Za-z0-9_-]+",


def experiment(wildcards):
    """The experiment a target path names; an unknown name is an error listing the defined ones."""
    return named_experiment(config, wildcards.experiment)


def section(*keys):
    """An input function: the experiment's config section at `keys` as a JSON string (rule params,
    so changing any value in it reruns exactly the rules that read it)."""

    def params(wildcards):
        value = experiment(wildcards)
        for key in keys:
            value = value[key]
        return json.dumps(value, sort_keys=True)

    return params


def value(*keys):
    """An input function: the plain config value at `keys` (for flags such as a source name)."""

    def param(wildcards):
        result = experiment(wildcards)
        for key in keys:
            result = result[key]
        return result

    return param


def finetune_section(wildcards):
    return json.dumps(experiment(wildcards)["finetune"][wildcards.method], sort_keys=True)


# The user's own files (corpus, SFT data, mixed-in text, a checkpoint to start from, a calibration
# file) are inputs so that editing one reruns what reads it; they are local(): they live where the
# user's config says, relative to the working directory, so neither a module prefix nor a storage
# provider applies to them.
def finetune_mix_files(wildcards):
    """The text files the method mixes into fine-tuning (mix_datasets; editing one reruns it)."""
    return [local(f) for f in mix_files(experiment(wildcards)["finetune"][wildcards.method], Path.cwd())]


def align_mix_files(wildcards):
    """The text files align mixes into its rows (its mix_datasets; editing one reruns it)."""
    return [local(f) for f in mix_files(align_section(wildcards), Path.cwd())]


def corpus_files(wildcards):
    """The user's corpus, SFT and preference files (so that editing one reruns prepare); builtin
    sources have none."""
    files = []
    for pattern in experiment(wildcards)["data"]["corpus"]:
        if not pattern.startswith("builtin:"):
            files += sorted(glob.glob(pattern, recursive=True))
    sft = experiment(wildcards)["data"]["sft"]
    if not sft.startswith("builtin:"):
        files += sorted(glob.glob(f"{sft}/train*.json")) + sorted(glob.glob(f"{sft}/train/*.json"))
        files += sorted(glob.glob(f"{sft}/dev*.json")) + sorted(glob.glob(f"{sft}/dev/*.json"))
    preference = experiment(wildcards)["data"]["preference"]  # align's pairs (.json or .jsonl)
    if preference and not preference.startswith("builtin:"):
        for split in ("train", "dev"):
            files += sorted(glob.glob(f"{preference}/{split}*.json*")) + sorted(glob.glob(f"{preference}/{split}/*.json*"))
    return [local(f) for f in files]


def model_variants(wildcards):
    """Variants evaluated from their own dirs: the starting checkpoint (`base`), the pretrained
    model when pretraining runs, every fine-tuned one, and the aligned one (`align`) when enabled,
    with its merge (`align-merged`) when it is a LoRA adapter."""
    exp = experiment(wildcards)
    start = ["base"] if exp["model"]["model_name_or_path"] else []
    aligned = []
    if align_enabled(exp):
        aligned = ["align"] + (["align-merged"] if exp["align"]["tuning"] == "lora" else [])
    return start + (["pretrain"] if pretrain_enabled(exp) else []) + FINETUNED_VARIANTS + aligned


def finetune_priority(wildcards):
    """1 for the fine-tuning the quantized chain waits on (quantize.source's method, or with source
    align the aligned model's source's) and for the one alignment starts from, else 0: with three
    methods on two cores they start first, so the DAG's longest paths are not queued behind another
    method (the default DAG: LoRA, 190 s, had waited 40 s for prefix tuning; SFT, then score_pairs,
    align and its evaluation, 39 s for prefix tuning and an evaluation, 2026-11-29)."""
    exp = experiment(wildcards)
    quantized = exp["quantize"]["source"]
    source = exp["align"]["source"] if quantized in ALIGNED_VARIANTS else quantized
    aligned = exp["align"]["source"] if align_enabled(exp) else None
    return int(wildcards.method in (source.removesuffix("-merged"), (aligned or "").removesuffix("-merged")))


def finetune_base(wildcards):
    """The model fine-tuning starts from: results/<name>/pretrain, or results/<name>/base when the
    experiment fine-tunes a checkpoint without pretraining it."""
    return f"results/{wildcards.experiment}/{finetune_source(experiment(wildcards))}"


def align_source_dir(wildcards):
    """The model preference alignment starts from (and scores the pairs with): results/<name>/<align.source>."""
    return f"results/{wildcards.experiment}/{experiment(wildcards)['align']['source']}"


# Preference alignment (align.smk): its inputs, the scores' params and flags.
def align_section(wildcards):
    """The experiment's align section, or a ConfigError when the experiment does not align."""
    exp = experiment(wildcards)
    if not align_enabled(exp):
        raise ConfigError(f"results/{wildcards.experiment}/align: experiment {wildcards.experiment!r} does not "
                          f"align (experiments.{wildcards.experiment}.align.enabled is false); set "
                          "align.enabled: true")
    return exp["align"]


def align_inputs(wildcards):
    """The source model, the data (its preference pairs), the job's plan and, for dpo and ipo, the
    reference log-probs (`reference`). Used with unpack()."""
    inputs = {"model": align_source_dir(wildcards), "data": f"results/{wildcards.experiment}/data",
              "plan": f"results/{wildcards.experiment}/plan/align.json"}
    if needs_reference(align_section(wildcards)):
        inputs["reference"] = f"results/{wildcards.experiment}/align_reference"
    return inputs


def scoring_inputs(wildcards):
    """The reference model (align.source) and the data; refused for a reference-free method, whose
    align job reads no scores. Used with unpack()."""
    align = align_section(wildcards)
    if not needs_reference(align):
        raise ConfigError(f"results/{wildcards.experiment}/align_reference: align.method={align['method']} is "
                          "reference-free and scores no pairs (dpo and ipo do)")
    return {"model": align_source_dir(wildcards), "data": f"results/{wildcards.experiment}/data"}


def scoring_section(wildcards):
    """The align keys the scores depend on (JSON): the source, the pairs' encoding and which pairs
    the run draws (seed, max_steps, its global batch of pairs, given as one process's batch so that
    another layout of the same batch is the same scoring); no training key (beta, method,
    learning_rate, ...) is here."""
    align = align_section(wildcards)
    dp = align["world_size"] // (align["tensor_parallel_degree"] * align["pipeline_parallel_degree"])
    keys = {k: align[k] for k in ("source", "src_length", "max_length", "per_device_eval_batch_size", "seed",
                                  "max_steps")}
    keys["per_device_train_batch_size"] = align["per_device_train_batch_size"] * align["gradient_accumulation_steps"] * dp
    return json.dumps(keys, sort_keys=True)


def reference_flag(wildcards, input):
    """`--reference <dir>` for dpo and ipo, else nothing."""
    return f"--reference {input.reference}" if "reference" in input.keys() else ""


def align_source_flag(wildcards):
    """` --align-source <align.source>` for the report of an experiment that aligns, else nothing
    (its leading space keeps the command of an experiment without align as it was)."""
    exp = experiment(wildcards)
    return f" --align-source {exp['align']['source']}" if align_enabled(exp) else ""


def align_priority(wildcards):
    """1 when the quantized chain waits on the aligned model (quantize.source: align or align-merged), else 0."""
    return int(experiment(wildcards)["quantize"]["source"] in ALIGNED_VARIANTS)


def start_variant(wildcards):
    """The variant fine-tuning starts from (`base` or `pretrain`): the report's reference."""
    return finetune_source(experiment(wildcards))


def base_source_files(wildcards):
    """The starting checkpoint's files (editing one re-imports it)."""
    path = Path(experiment(wildcards)["model"]["model_name_or_path"])
    return [local(str(p)) for p in sorted(path.iterdir()) if p.is_file()]


def prepare_inputs(wildcards):
    """Corpus files, plus the imported checkpoint whose tokenizer prepare uses (`base`). Used with unpack()."""
    inputs = {"corpus": corpus_files(wildcards)}
    if experiment(wildcards)["model"]["model_name_or_path"]:
        inputs["base"] = f"results/{wildcards.experiment}/base"
    return inputs


def tokenizer_flag(wildcards, input):
    """`--tokenizer <base>` for an experiment with a starting checkpoint, else nothing."""
    return f"--tokenizer {input.base}" if "base" in input.keys() else ""


def pretrain_inputs(wildcards):
    if not pretrain_enabled(experiment(wildcards)):
        raise ConfigError(f"results/{wildcards.experiment}/pretrain: experiment {wildcards.experiment!r} skips "
                          f"pretraining (experiments.{wildcards.experiment}.pretrain.enabled is "
                          f"{json.dumps(experiment(wildcards)['pretrain']['enabled'])} with model.model_name_or_path); set "
                          "pretrain.enabled: true for continued pretraining")
    inputs = {"data": f"results/{wildcards.experiment}/data",
              "plan": f"results/{wildcards.experiment}/plan/pretrain.json"}
    if experiment(wildcards)["model"]["model_name_or_path"]:
        inputs["init"] = f"results/{wildcards.experiment}/base"  # continued pretraining
    return inputs


def plan_params(wildcards):
    """What the whole plan reads of the experiment (JSON): changing evaluation settings does not re-plan."""
    exp = experiment(wildcards)
    aligned = {"align": exp["align"]} if align_enabled(exp) else {}  # absent: plans nothing, changes nothing
    return json.dumps({"model": exp["model"], "data": {"vocab_size": exp["data"]["vocab_size"]},
                       "pretrain": exp["pretrain"], "finetune": exp["finetune"], "cluster": exp["cluster"],
                       **aligned}, sort_keys=True)


def plan_job_params(wildcards):
    """What one job's estimate depends on (JSON): the model, the vocabulary, that job's section, and
    whether its ranks are GPUs; not the other jobs' sections, time limits or site settings."""
    exp = experiment(wildcards)
    job = wildcards.job
    if job == "pretrain":
        sections = {"pretrain": exp["pretrain"], "finetune": {}}
    elif job == "align":
        sections = {"pretrain": dict(exp["pretrain"], enabled=False), "finetune": {}, "align": exp["align"]}
    else:
        method = job.removeprefix("finetune_")
        sections = {"pretrain": dict(exp["pretrain"], enabled=False), "finetune": {method: exp["finetune"][method]}}
    cluster = {"gpus_per_node": exp["cluster"]["gpus_per_node"]}
    return json.dumps({"model": exp["model"], "data": {"vocab_size": exp["data"]["vocab_size"]}, **sections,
                       "cluster": cluster}, sort_keys=True)


def init_flag(wildcards, input):
    """`--init <base>` for continued pretraining of a starting checkpoint, else nothing."""
    return f"--init {input.init}" if "init" in input.keys() else ""


def quant_source_dir(wildcards):
    return f"results/{wildcards.experiment}/{experiment(wildcards)['quantize']['source']}"


def quant_variants(wildcards):
    return experiment(wildcards)["quantize"]["variants"]


def quantize_input(wildcards):
    """The model a quantized variant is made of (`source`), and for calibrated variants (gptq,
    a8w8) the experiment's data (`data`, the calibration source) and a calibration file named by
    path (`calibration`); a variant outside the experiment's `quantize.variants` is refused here,
    before its whole chain is trained. Used with unpack()."""
    quant = experiment(wildcards)["quantize"]
    if wildcards.variant not in quant["variants"]:
        raise ConfigError(f"results/{wildcards.experiment}/quant/{wildcards.variant}: unknown quantize variant "
                          f"{wildcards.variant!r}; experiments.{wildcards.experiment}.quantize.variants lists "
                          f"{', '.join(quant['variants'])} (built-in names: {', '.join(BUILTIN_VARIANTS)}; "
                          "more under quantize.custom_variants)")
    inputs = {"source": quant_source_dir(wildcards)}
    if spec_method(wildcards.variant, quant) in CALIBRATED_METHODS:
        inputs["data"] = f"results/{wildcards.experiment}/data"
        source = quant["calibration"]["source"]
        if source not in ("corpus", "sft"):
            inputs["calibration"] = local(source)  # editing the file reruns the variant
    return inputs


def quantize_section(wildcards):
    """The part of the `quantize` section the variant reads, as its params: its custom spec, its
    method's defaults and, when calibrated, `calibration`; so that changing one method's settings
    reruns only that method's variants."""
    return json.dumps(variant_settings(wildcards.variant, experiment(wildcards)["quantize"]), sort_keys=True)


def quantize_data_flag(wildcards, input):
    """`--data <data>` for a calibrated variant (gptq, a8w8), else nothing."""
    return f"--data {input.data}" if "data" in input.keys() else ""


def onnx_variants(wildcards):
    """`onnx-int8` (export/int8/, evaluated on onnxruntime) when export.int8 is on and the model is
    one the KV-cache graph exports (a family whose every stage runs our model, without dynamic RoPE;
    not GPT-2, which exports through transformers' model: stages/export.py)."""
    exp = experiment(wildcards)
    if not exp["export"]["int8"]:
        return []
    source = exp["model"]["model_name_or_path"]
    if not source:
        return [] if FLAVOURS[exp["model"]["flavour"]].get("model_type") == "gpt2" else ["onnx-int8"]
    config = read_source_config(source)
    dynamic = depends_on_length(config.get("rope_scaling") or config.get("rope_parameters"))
    return ["onnx-int8"] if family_of(config).ours and not dynamic else []


def deploy_artifacts(wildcards):
    """The artifact directories the experiment's `deploy` section asks for."""
    deploy = experiment(wildcards)["deploy"]
    return [f"results/{wildcards.experiment}/deploy/gguf-{t}" for t in deploy["gguf"]] + [
        f"results/{wildcards.experiment}/deploy/compressed-tensors-{v}" for v in deploy["compressed_tensors"]]


def variant_dir(wildcards):
    """The artifact a variant name stands for: a model/adapter dir, a quantized dir, or the int8
    ONNX graph of export/."""
    if wildcards.variant in model_variants(wildcards):
        return f"results/{wildcards.experiment}/{wildcards.variant}"
    if wildcards.variant == "align":
        raise ConfigError(f"results/{wildcards.experiment}/eval/align.json: experiment {wildcards.experiment!r} "
                          f"does not align (experiments.{wildcards.experiment}.align.enabled is false); set "
                          "align.enabled: true for the aligned variant")
    if wildcards.variant in quant_variants(wildcards):
        return f"results/{wildcards.experiment}/quant/{wildcards.variant}"
    if wildcards.variant in onnx_variants(wildcards):
        return f"results/{wildcards.experiment}/export/int8"
    raise ConfigError(f"results/{wildcards.experiment}/eval/{wildcards.variant}.json: unknown variant "
                      f"{wildcards.variant!r} for experiment {wildcards.experiment!r}; expected one of "
                      f"{', '.join(model_variants(wildcards) + quant_variants(wildcards) + onnx_variants(wildcards))}")


def lm_eval_task_files(wildcards):
    """The task YAML files of evaluate.lm_eval_include_path (inputs of every evaluate job, so that
    editing a task reruns the evaluations); none without that directory."""
    task_dir = experiment(wildcards)["evaluate"]["lm_eval_include_path"]
    if task_dir is None:
        return []
    if not Path(task_dir).is_dir():
        raise ValueError(f"experiments.{wildcards.experiment}.evaluate.lm_eval_include_path={task_dir!r} is not a "
                         f"directory (relative to {Path.cwd()}); point it at a directory of lm-eval task YAML files")
    return sorted(str(p) for p in Path(task_dir).rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def variant_inputs(wildcards):
    """What evaluating a variant needs: its dir (`model`; for onnx-int8 the export dir, int8/ is
    inside it), plus the base model for adapter dirs (`base`). Used with unpack()."""
    if wildcards.variant in onnx_variants(wildcards):
        return {"model": f"results/{wildcards.experiment}/export"}
    inputs = {"model": variant_dir(wildcards)}
    if wildcards.variant in ("lora", "prefix"):
        inputs["base"] = finetune_base(wildcards)
    if wildcards.variant == "align" and experiment(wildcards)["align"]["tuning"] == "lora":
        inputs["base"] = align_source_dir(wildcards)  # the adapter's base is the model it aligned
    return inputs


def variant_model(wildcards, input):
    """The directory the variant's model is in, within its declared input."""
    return f"{input.model}/int8" if wildcards.variant in onnx_variants(wildcards) else input.model


def base_flag(wildcards, input):
    """`--base <dir>` for an adapter variant, else nothing."""
    return f"--base {input.base}" if "base" in input.keys() else ""


def shared_artifact(wildcards):
    """What a sweep member links to: the same artifact of its shared upstream experiment."""
    return f"results/{SHARED_UPSTREAM[wildcards.experiment]}/{wildcards.artifact}"


def comparison_inputs(wildcards):
    """Every compared variant's evaluation of every member, and each member's starting model's
    when a metric is a ratio to it (ppl_ratio)."""
    spec = COMPARISONS[wildcards.comparison]
    files = [f"results/{m}/eval/{v}.json" for m in spec["members"] for v in spec["variants"]]
    if any(metric.endswith("_ratio") for metric in spec["metrics"]):
        files += [f"results/{m}/eval/{spec['starts'][m]}.json" for m in spec["members"]]
    return list(dict.fromkeys(files))


def training_dirs(wildcards):
    """The training stages' output dirs (each holds its train_log.csv)."""
    exp = experiment(wildcards)
    start = ["pretrain"] if pretrain_enabled(exp) else []
    aligned = ["align"] if align_enabled(exp) else []
    return [f"results/{wildcards.experiment}/{stage}" for stage in start + FINETUNE_METHODS + aligned]


def report_benchmarks(wildcards):
    """The benchmark TSV of every job the experiment runs itself (a sweep member's data and starting
    model are its shared upstream's), for the report's stage timings."""
    exp, name = experiment(wildcards), wildcards.experiment
    jobs = []
    if name not in SHARED_UPSTREAM:
        jobs.append("prepare")
        if exp["model"]["model_name_or_path"]:
            jobs.append("import_base")
        if pretrain_enabled(exp):
            jobs += ["plan_pretrain", "pretrain"] + (["merge_tp"] if sharded_output(exp["pretrain"]) else [])
    jobs += ["plan"] + [f"plan_finetune_{m}" for m in FINETUNE_METHODS] + [f"finetune_{m}" for m in FINETUNE_METHODS]
    if align_enabled(exp):
        jobs += ["plan_align"] + (["score_pairs"] if needs_reference(exp["align"]) else []) + ["align"]
        jobs += ["merge_align"] if exp["align"]["tuning"] == "lora" else []
    jobs += ["merge_lora"] + [f"quantize_{v}" for v in quant_variants(wildcards)] + ["export"]
    jobs += [f"deploy_gguf-{t}" for t in exp["deploy"]["gguf"]]
    jobs += [f"deploy_compressed-tensors-{v}" for v in exp["deploy"]["compressed_tensors"]]
    variants = model_variants(wildcards) + quant_variants(wildcards) + onnx_variants(wildcards)
    jobs += [f"evaluate_{v}" for v in variants]
    return [f"results/{name}/benchmarks/{job}.tsv" for job in jobs]


def all_eval_files(wildcards):
    variants = model_variants(wildcards) + quant_variants(wildcards) + onnx_variants(wildcards)
    return [f"results/{wildcards.experiment}/eval/{v}.json" for v in variants]


# SLURM resources, derived from the experiment (stages/cluster/resources.py) rather than written in
# the profile: a training job's nodes, tasks and memory per node come from its layout and its plan,
# every other job is one process. The keys a rule declares are fixed when the workflow is parsed;
# a key no experiment needs (GPUs, several nodes, a partition) is left out.
_RESOURCE_KEYS = ["nodes", "tasks", "cpus_per_task", "mem_mb", "runtime"]
_ALL_RESOURCES = [job["resources"] for plan in PLANS.values() for job in plan["jobs"].values()] + [
    single_process_resources(e, "default", 0) for e in config["experiments"].values()]
_RESOURCE_KEYS += sorted({k for r in _ALL_RESOURCES for k in r} - set(_RESOURCE_KEYS))


def _job_resources(wildcards, name):
    experiment(wildcards)  # an undefined experiment name: the error listing the defined ones
    plan = PLANS[wildcards.experiment]
    if name == "pretrain":
        return plan["jobs"]["pretrain"]["resources"]
    if name == "finetune":
        return plan["jobs"][f"finetune_{wildcards.method}"]["resources"]
    if name == "align":
        return plan["jobs"]["align"]["resources"]
    return single_process_resources(experiment(wildcards), name, 4 * plan["model"]["parameters"])


def cluster_resources(name):
    """Resources as keyword arguments, spread with ** into the resources section of a rule; one
    function of the wildcards per key, read from the experiment's plan."""
    def value_of(key):
        def value(wildcards):
            empty = "" if key.startswith("slurm") or key in ("gres", "mpi") else 0  # a string or a number key
            return _job_resources(wildcards, name).get(key, empty)
        return value

    return {key: value_of(key) for key in _RESOURCE_KEYS}


# The code of each rule is one of its params (stages/provenance/code.py), one entry per source file
# of its stage module and every `stages` module that imports, transitively, "code <file> <sha256[:12]>",
# so that an edited file reruns the jobs whose code reaches it (the dry run's reason names the file) and
# `code`, the digest of them all, which each rule's shell puts in LLM_LIFECYCLE_CODE for meta.json.
def code_params(*modules, exclude=None):
    """Params (spread with ** into a rule's params) for a rule running `modules`. `exclude(wildcards)`
    names modules one job does not run (a quantize job runs only its own method's module), so that
    editing one of them reruns only the jobs that run it."""
    everything = closure(modules)

    def job_modules(wildcards):
        return closure(modules, exclude(wildcards)) if exclude else everything

    def entry(module):
        text = f"code {source_path(module)} {file_digest(module)}"
        return text if exclude is None else (lambda wildcards: text if module in job_modules(wildcards) else "")

    params = {f"code_{m.replace('.', '_')}": entry(m) for m in everything}
    params["code"] = fingerprint(everything) if exclude is None else (lambda w: fingerprint(job_modules(w)))
    return params


def other_methods_modules(wildcards):
    """The quantize modules of the methods other than this variant's (not run by its job)."""
    method = spec_method(wildcards.variant, experiment(wildcards)["quantize"])
    return [m for other, modules in METHOD_MODULES.items() if other != method for m in modules]
