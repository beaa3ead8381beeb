"""stages/training/engine.py (and families.py) with transformers' own models: GPT-2, OPT, Bloom and
GPT-NeoX train on the engine like our Llama does, with data parallel and ZeRO only.

- every family, one process: the loss falls, the output loads with `AutoModelForCausalLM` (no
  missing key, a tied lm_head stored once), its logits equal the engine's final model, and
  config.json keeps every field of the source;
- OPT full SFT through `python -m stages.finetune` in one process and over ZeRO-1 x2, ZeRO-3 x2
  and data parallel x2 (with recompute): the same loss curve within 1e-5 relative, the same final
  weights within 1e-4 (OPT's gradient-free key bias within 1e-3) and logits (GPT-2's full SFT runs
  our model: tests/unit/test_finetune_gpt2.py);
- a ZeRO-1 x2 checkpoint of step 5 resumes in one process on the uninterrupted curve;
- tensor / pipeline parallelism with such a model is refused, naming the model type.

Dropout is off in the tiny configs: each rank draws the dropout masks of its own examples, so with
dropout the layouts would agree only in distribution.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runs_in_one_world import start_world
from sft_fixtures import finetune_section, toy_records, torchrun_finetune_sft, train_losses, write_toy_data
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from stages.checkpoint.hf import load_state_dict
from stages.data.sft import encode_example
from stages.parallel import ParallelDegrees
from stages.training import engine, families
from stages.training.distributed import init_distributed
from stages.training.parallelize import check_model_fits
from stages.training.batches import SftBatches

ROOT = Path(__file__).resolve().parents[2]

# Tiny random-init configs (width 64, 2 layers, 4 heads), dropout off; vocab and special ids from the tokenizer.
FAMILY_CONFIGS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    "gpt_neox": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0),
}
# Families our model implements, saved by transformers: full SFT trains them through our model.
OUR_FAMILY_CONFIGS = {
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, sliding_window=16),
}
SFT = dict(learning_rate=1e-2, warmup_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2)


def save_family(model_type: str, tokenizer_dir: Path, out: Path) -> Path:
    """A random-init `model_type` model and the tiny tokenizer, saved by transformers into `out`."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, **{**FAMILY_CONFIGS, **OUR_FAMILY_CONFIGS}[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """model_type -> its saved directory (built on first use)."""
    root = tmp_path_factory.mktemp("families")
    return functools.cache(lambda model_type: save_family(model_type, tiny_tokenizer_dir, root / model_type))


# -- one process, every family --------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", list(OUR_FAMILY_CONFIGS))
def test_our_families_train_through_our_model_and_stay_theirs(model_type, model_dir, tmp_path):
    """A Qwen2 / Mistral checkpoint saved by transformers trains on our model (every layout open to
    it) and comes out as the same transformers class, config fields kept, logits equal to ours."""
    from stages.model import LlamaForCausalLM

    source_dir = model_dir(model_type)
    model = families.load_causal_lm(source_dir)
    assert isinstance(model, LlamaForCausalLM) and model.config.model_type == model_type
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source_dir)
    examples = [encode_example(tokenizer, r, 16, 24) for r in toy_records()[:48]]
    section = finetune_section("sft", max_steps=8, **SFT)
    init_distributed()
    engine.train(model, SftBatches(examples, 24, 0, seed=0), section, tmp_path / "out",
                 stage="finetune-sft", tokenizer_dir=source_dir, parent=source_dir, meta_config=section)
    losses = train_losses(tmp_path / "out")
    assert sum(losses[-3:]) < sum(losses[:3]) - 1.0, losses
    source = json.loads((source_dir / "config.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written.get(k) for k in source if k not in ("transformers_version",)} == \
        {k: v for k, v in source.items() if k != "transformers_version"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert loaded.config.model_type == model_type
    ids = torch.tensor([examples[0][0] * 2])  # 2 x the example: longer than Mistral's window of 16
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), loaded(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", list(FAMILY_CONFIGS))
def test_family_trains_and_writes_what_transformers_loads(model_type, model_dir, tmp_path):
    source_dir = model_dir(model_type)
    model = families.load_causal_lm(source_dir)
    assert type(model).__module__.startswith("transformers.")  # not a family of ours
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source_dir)
    examples = [encode_example(tokenizer, r, 16, 24) for r in toy_records()[:48]]
    section = finetune_section("sft", max_steps=8, **SFT)
    init_distributed()  # a world of one, in this process
    metrics = engine.train(model, SftBatches(examples, 24, 0, seed=0), section, tmp_path / "out",
                           stage="finetune-sft", tokenizer_dir=source_dir, parent=source_dir, meta_config=section)
    losses = train_losses(tmp_path / "out")
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3]) - 1.0, losses
    assert metrics["flops_per_token"] > 6 * metrics["num_parameters"] // 2

    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    stored = load_state_dict(tmp_path / "out")
    tied = loaded.config.tie_word_embeddings
    assert ("lm_head.weight" in stored) != tied  # a tied lm_head is stored once, under the embedding's name
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight or not tied
    ids = torch.tensor([examples[0][0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)

    written = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads((source_dir / "config.json").read_text())
    assert written == original  # every field of the source, the model_type included
    assert (tmp_path / "out" / "generation_config.json").exists() and (tmp_path / "out" / "tokenizer.json").exists()


# -- OPT over data parallel and ZeRO ----------------------------------------------------------------------
LAYOUTS = {  # name -> (processes, section keys); every one sees the global batch of 8 examples
    "single": (1, dict(world_size=1)),
    "stage1x2": (2, dict(world_size=2, sharding="stage1", per_device_train_batch_size=2)),
    "stage3x2": (2, dict(world_size=2, sharding="stage3", gradient_accumulation_steps=1)),
    "dp2_recompute": (2, dict(world_size=2, per_device_train_batch_size=2, recompute=True)),
}
STEPS = dict(max_steps=10, save_steps=5, save_total_limit=0)


def torchrun_sft(nproc: int, model: Path, data: Path, out: Path, checkpoints: Path | None = None,
                 **overrides) -> list[float]:
    """`python -m stages.finetune --method sft` on `nproc` gloo ranks; returns train_log.csv's losses."""
    config = finetune_section("sft", **{**SFT, **STEPS, **overrides})
    return torchrun_finetune_sft(nproc, model, data, out, config, checkpoints)


@pytest.fixture(scope="module")
def opt_runs(tmp_path_factory, model_dir, data_dir):
    """Layout name -> (losses, out dir, checkpoint dir) of a 10-step OPT full SFT on transformers'
    OPTForCausalLM: the one-process run on first use; the two-rank layouts, on first use of one,
    one after another in one torchrun (tests/unit/runs_in_one_world.py)."""
    root = tmp_path_factory.mktemp("opt")
    two_ranks = [n for n, (nproc, _) in LAYOUTS.items() if nproc == 2]

    @functools.cache
    def world():
        return start_world(2, {n: {"stage": "finetune", "method": "sft", "model": model_dir("opt"), "data": data_dir,
                                   "out": root / n / "out", "checkpoints": root / n / "ckpt",
                                   "section": dict(finetune_section("sft", **{**SFT, **STEPS, **LAYOUTS[n][1]}))}
                               for n in two_ranks}, root / "world")

    @functools.cache
    def run(name: str):
        if name in two_ranks:
            out = world().out(name)
            return train_losses(out), out, root / name / "ckpt"
        losses = torchrun_sft(LAYOUTS[name][0], model_dir("opt"), data_dir, root / name / "out", root / name / "ckpt",
                              **LAYOUTS[name][1])
        return losses, root / name / "out", root / name / "ckpt"

    return run


def assert_same_model(got_dir: Path, ref_dir: Path) -> None:
    """Every OPT tensor within 1e-4 of the reference, and the same logits.

    The key bias (`k_proj.bias`) is the exception, within 1e-3: in exact arithmetic it gets no
    gradient (it shifts every attention score of a query by q.b_k, which the softmax ignores), so
    Adam turns the rounding noise it does get into lr-sized steps that differ with the reduction
    order. The logits show that it changes nothing."""
    got, ref = load_state_dict(got_dir), load_state_dict(ref_dir)
    assert sorted(got) == sorted(ref) and "lm_head.weight" not in got  # OPT ties lm_head
    for key in ref:
        if key.endswith("k_proj.bias"):
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-3, msg=key)
            continue
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-4, msg=key)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits for d in (got_dir, ref_dir)]
    torch.testing.assert_close(*logits, rtol=0, atol=1e-4)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_opt_layout_matches_the_single_process_run(opt_runs, name):
    reference, ref_out, _ = opt_runs("single")
    losses, out, _ = opt_runs(name)
    assert len(losses) == len(reference) == 10 and reference[-1] < reference[0] - 1.0
    assert losses == pytest.approx(reference, rel=1e-5)
    assert_same_model(out, ref_out)
    meta = json.loads((out / "meta.json").read_text())["metrics"]
    assert meta["zero_stage"] == {"stage1x2": 1, "stage3x2": 3}.get(name, 0)


@pytest.mark.multiproc
def test_opt_zero1_checkpoint_resumes_in_one_process(opt_runs, model_dir, data_dir, tmp_path):
    """Saved at step 5 by ZeRO-1 x2 (found in its directory: layout keys are not in the fingerprint),
    resumed by one process: steps 6-10 continue the uninterrupted single-process curve."""
    reference, ref_out, _ = opt_runs("single")
    _, _, checkpoints = opt_runs("stage1x2")
    losses = torchrun_sft(1, model_dir("opt"), data_dir, tmp_path / "out", checkpoints, **LAYOUTS["single"][1])
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["metrics"]["resumed_from_step"] == 5
    assert losses[5:] == pytest.approx(reference[5:], rel=1e-5)
    assert_same_model(tmp_path / "out", ref_out)
    (checkpoint,) = sorted(p for p in next(checkpoints.iterdir()).iterdir() if p.is_dir())
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.model_type == "opt"  # a loadable checkpoint


# -- what such a model cannot do ----------------------------------------------------------------------------
def test_model_parallel_is_only_for_our_families():
    assert families.own_families() == ("glm", "glm4", "llama", "mistral", "mixtral", "olmoe", "qwen2", "qwen2_moe",
                                       "qwen3", "qwen3_moe")
    assert families.model_parallel_families() == ("glm", "glm4", "llama", "mistral", "qwen2", "qwen3")
    assert families.supports_model_parallel("llama") and not families.supports_model_parallel("gpt2")
    assert not families.supports_model_parallel("mixtral")  # a mixture of experts: data parallel and ZeRO
    families.check_model_parallel("qwen2", 2, 2)
    families.check_model_parallel("opt", 1, 1)
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree=2: model_type='opt' trains through "
                                         r"transformers.*\(glm, glm4, llama, mistral, qwen2, qwen3\)"
                                         r".*sharding: stage1"):
        families.check_model_parallel("opt", 1, 2)


@pytest.mark.parametrize("degrees", [dict(tensor_parallel_degree=2), dict(pipeline_parallel_degree=2)])
def test_engine_refuses_to_split_a_transformers_model(model_dir, degrees):
    model = AutoModelForCausalLM.from_pretrained(model_dir("gpt2"))
    section = finetune_section("sft")
    with pytest.raises(ValueError, match=r"model_type='gpt2' trains through transformers' GPT2LMHeadModel"):
        check_model_fits(model, section, ParallelDegrees(world_size=2, **degrees))


def test_families_module_imports_no_torch():
    code = ("import sys; from stages.training.families import supports_model_parallel; "
            "assert supports_model_parallel('mistral'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
