"""The memory model (stages/planning/memory.py): the ZeRO paper's model-state formulas, exact
parameter counts, the nearest layout that fits, and the estimate against what real engines hold
and peak at (bench/memory_plan.py: 2 gloo ranks on the CPU, the profiler's allocator records)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from stages.config import check_config
from stages.model import build_model, config_for_flavour
from stages.model.config import FLAVOURS, LlamaConfig
from stages.errors import ConfigError
from stages.planning.memory import (
    ADAM_BYTES,
    MASTER_BYTES,
    estimate_memory,
    estimate_phases,
    nearest_fitting_layout,
    parameter_count,
    zero_model_states,
)

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "memory_plan.py"
GB = 10**9


@pytest.fixture(autouse=True)
def _no_device_check(monkeypatch):
    """bf16 sections are planned for GPUs; this CPU's own bf16 support is beside the point."""
    monkeypatch.setenv("LLM_LIFECYCLE_DEVICE_CHECK", "0")


def pretrain_section(flavour: str = "70b", vocab_size: int = 32000, **overrides):
    """A validated pretrain section of an experiment on `flavour` (schema defaults otherwise)."""
    exp = {"model": {"flavour": flavour}, "data": {"vocab_size": vocab_size}, "pretrain": overrides}
    return check_config({"experiments": {"t": exp}})["experiments"]["t"]["pretrain"]


# -- the ZeRO paper ---------------------------------------------------------------------------------

# Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B parameters, Nd = 64 ranks, mixed-precision Adam (K = 12).
PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("stage", list(PAPER_GB))
def test_model_states_reproduce_the_zero_paper(stage):
    states = zero_model_states(7_500_000_000, stage, 64)
    assert sum(states.values()) / GB == pytest.approx(PAPER_GB[stage], abs=0.05)


# A Llama of ~7.5B parameters: 36 layers of the 7B shape.
PSI_ARCH = {**FLAVOURS["7b"], "num_hidden_layers": 36}


@pytest.mark.parametrize("stage", list(PAPER_GB))
def test_the_estimate_holds_the_papers_model_states(stage):
    """Parameters + gradients + optimizer state of the estimate (bf16, gradients accumulated over
    micro-batches as the paper assumes) are the paper's formula for this model's Psi: exactly,
    except for ZeRO-3's norm weights, which stay whole on every rank (0.05%)."""
    psi = parameter_count(PSI_ARCH, 32000)
    assert psi == pytest.approx(7.5e9, rel=0.01)
    section = pretrain_section("7b", world_size=64, sharding=["none", "stage1", "stage2", "stage3"][stage], bf16=True,
                               per_device_train_batch_size=1, gradient_accumulation_steps=4, max_length=2048)
    backward = estimate_phases(PSI_ARCH, section, vocab_size=32000)["backward"]
    held = backward.parameters + backward.gradients + backward.optimizer
    assert held == pytest.approx(sum(zero_model_states(psi, stage, 64).values()), rel=1e-3)
    assert held / GB == pytest.approx(PAPER_GB[stage] * psi / 7.5e9, rel=0.02)


# -- parameter counts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour, overrides", [
    ("debug", {}), ("tiny", {}), ("1b", {}),  # 1b ties lm_head to the embedding
    ("debug", {"attention_bias": True, "mlp_bias": True}),
    ("debug", {"model_type": "qwen2"}),  # q/k/v bias, no o_proj bias
    ("gpt-tiny", {}), ("gpt2-124m", {}),  # GPT-2 blocks: fused qkv, GELU MLP, LayerNorm, learned positions
    ("moe-debug", {}), ("moe-tiny", {}),  # Mixtral blocks: router and 4 / 8 experts per layer
])
def test_parameter_count_equals_the_built_model(flavour, overrides):
    config = config_for_flavour(flavour, vocab_size=1024, **overrides)
    model = build_model(config, device="meta")  # shapes only, nothing allocated
    built = sum(p.numel() for p in model.parameters())  # a tied weight once
    arch = {**FLAVOURS[flavour], **overrides}
    assert parameter_count(arch, 1024) == built == config.num_parameters()


def test_parameter_count_of_the_llama2_sizes():
    assert parameter_count(FLAVOURS["7b"], 32000) == 6_738_415_616  # "6.74B"
    assert parameter_count(FLAVOURS["13b"], 32000) == 13_015_864_320  # "13.0B"
    assert parameter_count(FLAVOURS["70b"], 32000) == 68_976_648_192  # "68.98B"


def test_a_checkpoint_config_json_is_read_like_a_flavour():
    hf = LlamaConfig(vocab_size=4096, **FLAVOURS["tiny"]).to_hf_dict()  # what config.json holds
    assert parameter_count(hf, 4096) == parameter_count(FLAVOURS["tiny"], 4096)
    mha = {**FLAVOURS["tiny"], "num_key_value_heads": None, "head_dim": None}  # nulls take the defaults
    assert parameter_count(mha, 4096) == LlamaConfig(vocab_size=4096, **mha).num_parameters()


# Families whose blocks differ from Llama's: Qwen3 (q/k head norms, attention_bias on q/k/v/o), GLM
# (q/k/v bias by default, one gate_up_proj), GLM-4 (GLM plus a norm after each sub-block).
NEWER_FAMILIES = {"qwen3": "Qwen3Config", "glm": "GlmConfig", "glm4": "Glm4Config"}


@pytest.mark.parametrize("family", list(NEWER_FAMILIES))
@pytest.mark.parametrize("attention_bias", [True, False, None])  # None: config.json leaves it to the family
def test_parameter_count_of_qwen3_and_glm_equals_transformers(family, attention_bias):
    import torch
    import transformers

    kwargs = {} if attention_bias is None else {"attention_bias": attention_bias}
    config = getattr(transformers, NEWER_FAMILIES[family])(
        vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=2, **kwargs)
    arch = config.to_dict()
    if attention_bias is None:
        del arch["attention_bias"]
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert parameter_count(arch, 1024) == theirs == LlamaConfig.from_hf_dict(arch).num_parameters()


# Mixtures of experts as transformers saves them (each family's spelling of the expert count, Qwen's
# sparse-layer choice and shared expert, OLMoE's whole-projection q/k norms)
MOE_FAMILIES = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                      decoder_sparse_step=2),
    "qwen3_moe": dict(num_experts=6, moe_intermediate_size=48, mlp_only_layers=[0]),
    "olmoe": dict(num_experts=4),
}


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_parameter_count_of_the_mixtures_of_experts_equals_transformers(family):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(family, vocab_size=1024, hidden_size=64, intermediate_size=192,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               num_experts_per_tok=2, **MOE_FAMILIES[family])
    arch = json.loads(config.to_json_string())
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert parameter_count(arch, 1024) == theirs == LlamaConfig.from_hf_dict(arch).num_parameters()


def test_a_mixture_of_experts_saves_its_routed_experts_activations():
    """moe-tiny against tiny (the same attention and width): a token saves its 2 experts' SwiGLU
    (2 x 384 wide against tiny's 704), their dispatched inputs and outputs, and the router's."""
    section = pretrain_section("tiny", vocab_size=4096, per_device_train_batch_size=8, max_length=256)
    dense, moe = (estimate_phases(FLAVOURS[f], section, vocab_size=4096)["layers"].activations
                  for f in ("tiny", "moe-tiny"))
    a, tokens, layers = 4, 8 * 256, 4  # fp32 on the CPU
    per_layer = 2 * (2 * 256 * a + 4 * 384 * a) + 8 * (a + 4) - 4 * 704 * a  # what a sparse layer saves more
    assert moe - dense == tokens * layers * per_layer


def test_expert_parallelism_holds_a_share_of_the_experts_and_shards_their_state_over_their_holders():
    """moe-tiny on 4 ranks, ZeRO-1: with expert_parallel_degree 2 a rank holds 4 of the 8 experts of
    each layer, and their Adam state is sharded over the 2 ranks holding them (the rest over all 4).
    bench/memory_plan.py --flavours moe-tiny --cases none ep2 measures it (2026-11-30: ep2 279.9 MiB
    against 347.7 without, the estimate 0.956 of it: the busier expert rank holds 7.8 MiB more than the
    other, routing being uneven; the estimate assumes balanced routing)."""
    arch = FLAVOURS["moe-tiny"]
    experts = arch["num_hidden_layers"] * 3 * arch["num_experts"] * arch["hidden_size"] * arch["intermediate_size"]
    psi = parameter_count(arch, 4096)
    split, whole = (estimate_phases(arch, pretrain_section("moe-tiny", 4096, world_size=4, sharding="stage1", **ep),
                                    vocab_size=4096)["backward"] for ep in ({"expert_parallel_degree": 2}, {}))
    assert whole.parameters - split.parameters == experts // 2 * 4  # fp32
    per_parameter = MASTER_BYTES + ADAM_BYTES
    assert whole.optimizer == per_parameter * math.ceil(psi / 4)
    assert split.optimizer == per_parameter * (math.ceil((psi - experts) / 4) + math.ceil(experts // 2 / 2))
    # backward through a sparse layer: the all-to-all's send and receive rows, k per token, beside the bucket
    split, whole = (estimate_phases(arch, pretrain_section("moe-tiny", 4096, world_size=4, sharding="stage1",
                                                           max_length=256, per_device_train_batch_size=4, **ep),
                                    vocab_size=4096)["layers"] for ep in ({"expert_parallel_degree": 2}, {}))
    assert split.buffers - whole.buffers == 2 * (4 * 256) * arch["num_experts_per_tok"] * arch["hidden_size"] * 4
    with pytest.raises(ConfigError, match="does not divide num_experts=8"):
        pretrain_section("moe-tiny", 4096, world_size=3, expert_parallel_degree=3)


# GPT-2 through its own config.json names, and the families that train through transformers' model,
# sized as GPT-2-like blocks: exact for GPT-2 and GPT-NeoX, within 0.2% for Bloom (its embedding
# LayerNorm) and OPT (its projection sizes)
TRANSFORMERS_FAMILIES = {
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, n_positions=128), 0.0),
    "opt": (dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                 max_position_embeddings=128), 0.002),
    "bloom": (dict(hidden_size=64, n_layer=2, n_head=4), 0.002),
    "gpt_neox": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4), 0.0),
}


@pytest.mark.parametrize("family", list(TRANSFORMERS_FAMILIES))
def test_parameter_count_of_gpt2_and_the_transformers_families(family):
    """These checkpoints' config.json use their own key names: the plan reads them (a GPT-2, OPT,
    Bloom or NeoX checkpoint experiment is planned when Snakemake parses the workflow)."""
    import torch
    import transformers

    fields, tolerance = TRANSFORMERS_FAMILIES[family]
    config = transformers.AutoConfig.for_model(family, vocab_size=1024, **fields)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert parameter_count(config.to_dict(), 1024) == pytest.approx(theirs, rel=tolerance)


def finetune_section(method: str, **overrides):
    exp = {"model": {"flavour": "debug"}, "data": {"vocab_size": 320}, "finetune": {method: overrides}}
    return check_config({"experiments": {"t": exp}})["experiments"]["t"]["finetune"][method]


@pytest.mark.parametrize("method, overrides", [
    ("lora", {}), ("lora", {"target_modules": ["q_proj", "v_proj"], "lora_rank": 4}),
    ("lora", {"target_modules": ["mlp.down_proj"]}), ("prefix", {"num_prefix_tokens": 8}),
    ("prefix", {"num_prefix_tokens": 8, "prefix_projection": True}),
    ("prefix", {"num_prefix_tokens": 8, "prefix_projection": True, "prefix_projection_hidden_size": 40}),
])
def test_adapters_train_what_they_add_to_the_model(method, overrides):
    """Trained parameters (AdamW's 8 bytes each, fp32 without ZeRO) are those the adapter code adds."""
    from stages.adapters import attach_adapter

    section = finetune_section(method, **overrides)
    model = attach_adapter(build_model(config_for_flavour("debug", vocab_size=320), seed=0), method, section)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    step = estimate_phases(FLAVOURS["debug"], section, vocab_size=320, trained=method,
                           lora_rank=section.get("lora_rank"), num_prefix_tokens=section.get("num_prefix_tokens"),
                           device="cpu")["step"]
    assert step.optimizer == 8 * trained
    assert step.parameters == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", list(NEWER_FAMILIES))
@pytest.mark.parametrize("method, overrides", [
    ("lora", {}), ("lora", {"target_modules": ["q_proj", "down_proj"]}), ("prefix", {"num_prefix_tokens": 8}),
])
def test_adapters_of_qwen3_and_glm_train_what_they_add(model_type, method, overrides):
    """As above for our model of Qwen3 (two head norms a layer), GLM (LoRA on the fused gate_up_proj)
    and GLM-4 (four norms a layer)."""
    from stages.adapters import attach_adapter

    section = finetune_section(method, **overrides)
    config = config_for_flavour("debug", vocab_size=320, model_type=model_type, attention_bias=True)
    model = attach_adapter(build_model(config, seed=0), method, section)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    step = estimate_phases(config.to_hf_dict(), section, vocab_size=320, trained=method,
                           lora_rank=section.get("lora_rank"),
                           num_prefix_tokens=section.get("num_prefix_tokens"), device="cpu")["step"]
    assert step.optimizer == 8 * trained
    assert step.parameters == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", [{}, {"target_parameters": ["gate_up_proj", "down_proj"]},
                                       {"target_parameters": ["down_proj"], "expert_parallel_degree": 2}])
def test_lora_on_a_mixture_trains_what_it_adds(overrides):
    """moe-debug's LoRA: attention only by default (routers and experts frozen), the routed experts'
    own factors too with target_parameters (stages.adapters.expert_lora), a rank's share of them under
    expert parallelism."""
    from stages.adapters import attach_adapter
    from stages.parallel.experts import local_experts

    exp = {"model": {"flavour": "moe-debug"}, "data": {"vocab_size": 320},
           "finetune": {"lora": {"world_size": 2, **overrides}}}
    section = check_config({"experiments": {"t": exp}})["experiments"]["t"]["finetune"]["lora"]
    model = attach_adapter(build_model(config_for_flavour("moe-debug", vocab_size=320), seed=0), "lora", section)
    ep = section["expert_parallel_degree"]
    kept = {str(e) for e in local_experts(4, 0, ep)}  # expert rank 0's experts
    trained = sum(p.numel() for name, p in model.named_parameters()
                  if p.requires_grad and (".experts." not in name or name.split(".experts.")[1].split(".")[0] in kept))
    step = estimate_phases(FLAVOURS["moe-debug"], section, vocab_size=320, trained="lora",
                           lora_rank=section["lora_rank"], device="cpu")["step"]
    assert step.optimizer == 8 * trained


def test_pipeline_ranks_hold_every_parameter_once():
    section = pretrain_section("13b", world_size=4, pipeline_parallel_degree=4, sharding="none",
                               gradient_accumulation_steps=4, max_length=512)
    held = sum(estimate_phases(FLAVOURS["13b"], section, vocab_size=32000, pipeline_rank=r)["step"].parameters
               for r in range(4))
    assert held == 4 * parameter_count(FLAVOURS["13b"], 32000)  # fp32: 4 bytes each


def test_the_module_imports_no_torch():
    """It runs when Snakemake parses the workflow."""
    code = "import sys, stages.planning.memory; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# -- the estimate's parts --------------------------------------------------------------------------------

def test_offload_moves_the_optimizer_state_off_the_gpu_only():
    section = pretrain_section("7b", world_size=8, sharding="stage2", sharding_offload=True, bf16=True,
                               per_device_train_batch_size=1, max_length=2048)
    gpu = estimate_memory(FLAVOURS["7b"], section, vocab_size=32000, device="cuda")
    cpu = estimate_memory(FLAVOURS["7b"], section, vocab_size=32000, device="cpu")
    shard = -(-parameter_count(FLAVOURS["7b"], 32000) // 8)
    assert gpu.optimizer == 0 and gpu.offloaded == 16 * shard  # fp32 master, moments, fp32 gradients
    assert cpu.offloaded == 0 and cpu.optimizer == 12 * shard  # a CPU's "offload" is the same memory


def test_recompute_keeps_one_input_per_layer():
    common = dict(world_size=8, tensor_parallel_degree=8, sharding="stage1", per_device_train_batch_size=1,
                  gradient_accumulation_steps=4, max_length=4096, bf16=True)
    full = estimate_phases(FLAVOURS["70b"], pretrain_section(**common), vocab_size=32000)["backward"]
    kept = estimate_phases(FLAVOURS["70b"], pretrain_section(recompute=True, **common), vocab_size=32000)["backward"]
    inputs = 80 * 4096 * 8192 * 2  # every layer's bf16 input
    assert kept.activations - inputs < full.activations / 10


def test_sequence_parallelism_splits_the_norms_and_a_recomputed_layers_input():
    """The norms' share of a layer's activations (and under recompute the layer's saved input)
    divides by tp with sequence_parallel; at tp 1 it changes nothing. The bytes themselves are
    checked against real tp2 runs by bench/memory_plan.py (tp2_sp in its default run, which the
    slow test below holds within 20%; tp2_sp_recompute with --cases)."""
    common = dict(world_size=8, tensor_parallel_degree=8, sharding="stage1", per_device_train_batch_size=1,
                  gradient_accumulation_steps=4, max_length=4096, bf16=True)

    def activations(**section):
        return estimate_phases(FLAVOURS["70b"], pretrain_section(**{**common, **section}), vocab_size=32000)[
            "backward"].activations

    assert activations(sequence_parallel=True) < activations()
    inputs = 80 * 4096 * 8192 * 2  # every layer's bf16 input
    assert activations(recompute=True) - activations(recompute=True, sequence_parallel=True) == inputs - inputs // 8
    alone = dict(world_size=1, tensor_parallel_degree=1)
    assert activations(sequence_parallel=True, **alone) == activations(**alone)


def test_context_parallelism_halves_the_activations_at_cp2():
    """Every token's tensors divide by cp (attention's core is recomputed, so a layer keeps only its
    rank's q, k and v): at 4k tokens cp2 holds half of cp1's activations for 1b and 7b (the issue's
    target: <= 0.55x). Under full recompute the rebuilt layer holds the group's keys and values and
    the mask, counted on top. bench/memory_plan.py measures cp2 (default cases; `--flavours tiny@4k
    --cases none cp2` at 4k tokens: 0.500 measured, 2026-11-29)."""
    common = dict(world_size=2, sharding="none", per_device_train_batch_size=1, gradient_accumulation_steps=2,
                  max_length=4096, bf16=True)

    def activations(flavour, **section):
        phases = estimate_phases(FLAVOURS[flavour], pretrain_section(flavour, **{**common, **section}),
                                 vocab_size=32000)
        return max(phase.activations for phase in phases.values())

    for flavour in ("1b", "7b"):
        assert activations(flavour, context_parallel_degree=2) <= 0.55 * activations(flavour)
        assert activations(flavour, context_parallel_degree=2, recompute=True) <= 0.55 * activations(
            flavour, recompute=True)
    # the rows are padded to 2 x cp tokens: 4097 tokens take 2 x 1025 on each of 2 ranks, as 4100 do
    assert activations("1b", max_length=4097, context_parallel_degree=2) == activations(
        "1b", max_length=4100, context_parallel_degree=2) > activations("1b", max_length=4096, context_parallel_degree=2)


def test_ring_attention_holds_one_block_of_keys_where_all_gather_holds_the_row():
    """At 64k tokens over 8 ranks, a layer's backward under the all-gather core holds the whole row's
    keys and values and its (T/cp x T) mask; ring attention holds two blocks and a tile of scores, and
    saves what the all-gather core keeps (q, k, v, o_proj's input) plus its log-sum-exp. So at the
    moment one layer runs backward ("layers") ring needs less, with and without recompute, while the
    loss's peak ("backward") is the same up to the log-sum-exp. bench/memory_plan.py measures it
    (`--flavours tiny@4k --cases cp2 cp2_ring`)."""
    common = dict(world_size=8, sharding="none", per_device_train_batch_size=1, gradient_accumulation_steps=1,
                  max_length=65536, bf16=True, context_parallel_degree=8)

    def phases(**section):
        return estimate_phases(FLAVOURS["1b"], pretrain_section("1b", **{**common, **section}), vocab_size=32000)

    for recompute in (False, True):
        ring, gathered = phases(context_parallel_mode="ring", recompute=recompute), phases(recompute=recompute)
        assert ring["layers"].total < gathered["layers"].total, recompute
        lse = 16 * 65536 // 8 * 32 * 4  # 16 layers x a rank's tokens x 32 heads, fp32
        assert ring["backward"].activations - gathered["backward"].activations == (0 if recompute else lse)


def _saved_bytes_of_one_layer(config: LlamaConfig, dtype_name: str, tokens: int) -> int:
    """Bytes of the distinct storages autograd saves in one forward of our decoder layer 0 (one row
    of `tokens`), its input included, its weights and the shared cos / sin not."""
    import torch

    dtype = getattr(torch, dtype_name)
    model = build_model(config, seed=0).to(dtype)
    layer = model.model.layers["0"]
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    cos = sin = None  # GPT-2: learned positions, nothing to rotate
    if model.rotary_emb is not None:
        cos, sin = (t.detach() for t in model.rotary_emb(tokens, x.device, dtype))
    shared = [*layer.parameters(), *(t for t in (cos, sin) if t is not None)]
    skip = {t.untyped_storage().data_ptr() for t in shared}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin)
    return sum(saved.values())


QWEN3 = dict(model_type="qwen3", hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
GLM4 = dict(model_type="glm4", hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.5)


# a flavour with field overrides, or a config.json
LAYER_CASES = {"tiny": ("tiny", {}), "tiny_mha": ("tiny", {"num_key_value_heads": 8}), "qwen3": QWEN3,
               "glm4": GLM4, "gpt_tiny": ("gpt-tiny", {})}


@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("dtype, tokens", [("float32", 256), ("bfloat16", 256), ("bfloat16", 1024)])
def test_a_layers_activations_on_a_cpu_are_the_bytes_autograd_saves(case, dtype, tokens):
    """Full training, one micro-batch: the CPU plan's bytes per decoder layer (the activation
    difference between 2 layers and 1) equal what our layer saves, to the byte: k and v of the KV
    heads only under GQA (tiny: 4 KV heads for 8 query heads), each norm's 1/rms, Qwen3's head
    norms, GLM-4's extra norms, GPT-2's LayerNorm and fused qkv; in bf16 at 256 tokens the fp32
    copies attention runs on here (stages.model.attention_precision) and o_proj's bf16 input, at
    1,024 tokens bf16 throughout."""
    from stages.model.attention_precision import CPU_HAS_AMX

    if dtype == "bfloat16" and tokens == 256 and CPU_HAS_AMX:
        pytest.skip("bf16 attention stays bf16 on AMX CPUs; the plan counts the fp32 copies (the larger figure)")
    if isinstance(LAYER_CASES[case], tuple):
        flavour, overrides = LAYER_CASES[case]
        arch, config = {**FLAVOURS[flavour], **overrides}, config_for_flavour(flavour, 512, **overrides)
    else:
        arch = LAYER_CASES[case]
        config = LlamaConfig.from_hf_dict({**arch, "vocab_size": 512})
    section = pretrain_section("tiny", vocab_size=512, bf16=dtype == "bfloat16", per_device_train_batch_size=1,
                               max_length=tokens)
    planned = [estimate_phases({**arch, "num_hidden_layers": n}, section, vocab_size=512, device="cpu")["backward"]
               for n in (1, 2)]
    assert planned[1].activations - planned[0].activations == _saved_bytes_of_one_layer(config, dtype, tokens)


@pytest.mark.parametrize("kwargs, message", [
    ({"trained": "everything"}, "trained="), ({"trained": "lora"}, "lora_rank"),
    ({"trained": "prefix"}, "num_prefix_tokens"), ({"device": "tpu"}, "device="),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(FLAVOURS["tiny"], pretrain_section("tiny", 4096), vocab_size=4096, **kwargs)


# -- the nearest layout that fits --------------------------------------------------------------------

# Llama-2 70B pretraining on 64 GPUs of 80 GB: tensor parallel over a node of 8, ZeRO-1, no recompute.
LAYOUT_70B = dict(world_size=64, tensor_parallel_degree=8, pipeline_parallel_degree=1, sharding="stage1",
                  per_device_train_batch_size=1, gradient_accumulation_steps=8, max_length=4096, bf16=True,
                  recompute=False)


def test_a_70b_layout_that_cannot_fit_80gb_is_rejected_with_the_nearest_that_fits():
    section = pretrain_section(**LAYOUT_70B)
    estimate = estimate_memory(FLAVOURS["70b"], section, vocab_size=32000)
    print(f"70B, dp8 x tp8, ZeRO-1: {estimate.total / GB:.1f} GB per device "
          f"({', '.join(f'{k} {v / GB:.1f}' for k, v in estimate.as_dict().items() if k in PARTS)})")
    assert estimate.total > 80 * GB
    nearest = nearest_fitting_layout(FLAVOURS["70b"], section, vocab_size=32000, device_memory=80 * GB,
                                     devices_per_node=8)
    fitted = estimate_memory(FLAVOURS["70b"], {**section, **nearest}, vocab_size=32000)
    print(f"nearest: {nearest}: {fitted.total / GB:.1f} GB")
    # the first knob of PREFERENCE is enough: sequence parallelism (the norms' activations / 8, no extra
    # compute); with it already on and twice the micro-batch, the next one, ZeRO-2
    assert nearest == {"sequence_parallel": True}
    assert fitted.total <= 80 * GB
    with_sp = pretrain_section(**{**LAYOUT_70B, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4},
                               sequence_parallel=True)
    assert estimate_memory(FLAVOURS["70b"], with_sp, vocab_size=32000).total > 80 * GB
    assert nearest_fitting_layout(FLAVOURS["70b"], with_sp, vocab_size=32000, device_memory=80 * GB,
                                  devices_per_node=8) == {"sharding": "stage2"}


PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")


def test_a_layout_that_fits_is_accepted_unchanged():
    section = pretrain_section(**{**LAYOUT_70B, "sharding": "stage3", "recompute": True})
    assert estimate_memory(FLAVOURS["70b"], section, vocab_size=32000).total <= 80 * GB
    assert nearest_fitting_layout(FLAVOURS["70b"], section, vocab_size=32000, device_memory=80 * GB,
                                  devices_per_node=8) == {}


def test_the_nearest_layout_keeps_the_global_batch_and_the_rules():
    """On 40 GB no single knob is enough; what is proposed keeps micro x accumulation, and a pipeline
    only with ZeRO-0/1 and accumulation >= pp."""
    section = pretrain_section(**LAYOUT_70B)
    nearest = nearest_fitting_layout(FLAVOURS["70b"], section, vocab_size=32000, device_memory=40 * GB,
                                     devices_per_node=8)
    trial = {**section, **nearest}
    assert len(nearest) > 1
    assert estimate_memory(FLAVOURS["70b"], trial, vocab_size=32000).total <= 40 * GB
    assert trial["per_device_train_batch_size"] * trial["gradient_accumulation_steps"] == 8
    if trial["pipeline_parallel_degree"] > 1:
        assert trial["sharding"] in ("none", "stage1")
        assert trial["gradient_accumulation_steps"] >= trial["pipeline_parallel_degree"]


def test_no_layout_fits_when_the_devices_are_too_small():
    section = pretrain_section(**{**LAYOUT_70B, "world_size": 8})
    assert nearest_fitting_layout(FLAVOURS["70b"], section, vocab_size=32000, device_memory=8 * GB,
                                  devices_per_node=8) is None


def test_an_align_micro_batch_of_pairs_runs_two_rows_each():
    """Preference alignment: per_device_train_batch_size counts pairs, each a chosen and a rejected row
    in one forward; planned as an SFT micro-batch of twice the rows, and the nearest layout is given
    in pairs."""
    from stages.sections import AlignSettings, LoraSettings, SftSettings

    layout = {"max_length": 256, "world_size": 1, "sharding": "none"}
    arch = FLAVOURS["tiny"]
    align = AlignSettings.of({**layout, "per_device_train_batch_size": 8})
    sft = SftSettings.of({**layout, "per_device_train_batch_size": 16})
    assert estimate_memory(arch, align, vocab_size=4096) == estimate_memory(arch, sft, vocab_size=4096)
    adapter = {"lora_rank": 8, "target_modules": ["q_proj"]}  # align's LoRA targets are its own key's
    lora_align = align.replace(tuning="lora", **adapter)
    lora_sft = LoraSettings.of({**layout, "per_device_train_batch_size": 16, **adapter})
    assert (estimate_memory(arch, lora_align, vocab_size=4096, trained="lora", lora_rank=8)
            == estimate_memory(arch, lora_sft, vocab_size=4096, trained="lora", lora_rank=8))
    small = int(0.3 * estimate_memory(arch, align, vocab_size=4096).total)
    assert nearest_fitting_layout(arch, align, vocab_size=4096, device_memory=small, devices_per_node=1) == {
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}  # 2 rows: SFT's would be 2 x 8


# -- against real engines --------------------------------------------------------------------------------

def run_bench(out: Path, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(BENCH), "--out", str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())["records"]


@pytest.mark.multiproc
def test_model_states_equal_what_real_engines_hold(tmp_path):
    """2 gloo ranks of the debug flavour per layout, a census of distinct tensor storages just
    before the last optimizer step: parameters (ZeRO-3: partitions and the small parameters kept
    whole), gradients (p.grad and ZeRO's gradient partitions), optimizer state (AdamW's moments and
    ZeRO's fp32 master partitions). Equal to the byte up to ZeRO's flat-buffer alignment (its
    partitions are padded to a multiple of 2 x dp elements: < 0.1% here)."""
    records = run_bench(tmp_path / "bench.json", "--flavours", "debug", "--steps", "2",
                        "--cases", "stage1", "stage2", "stage3", "tp2", "pp2")
    assert sorted(r["case"] for r in records) == ["pp2", "stage1", "stage2", "stage3", "tp2"]
    for record in records:
        for rank in record["model_states"]:
            for part, estimate in rank["estimate"].items():
                assert estimate == pytest.approx(rank["held"][part], rel=1e-3), (record["case"], rank["rank"], part)
        assert record["within_target"], record["case"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_estimate_is_within_20_percent_of_the_measured_peak(tmp_path):
    """bench/memory_plan.py's default run: tiny and debug, every ZeRO stage, tp2, pp2, recompute,
    bf16, LoRA and prefix on 2 ranks; the estimate's peak within 20% of the highest measured
    rank's, with DeepSpeed's gradient bucket and without it (~4 min)."""
    records = run_bench(tmp_path / "bench.json")
    assert {r["case"] for r in records} >= {"none", "stage1", "stage2", "stage3", "tp2", "pp2", "stage1_recompute",
                                            "cp2"}
    for record in records:
        assert abs(record["ratio"] - 1) <= 0.2, record["case"]
        assert abs(record["ratio_without_buckets"] - 1) <= 0.2, record["case"]
