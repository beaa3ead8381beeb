"""LoRA and prefix tuning on our own model (stages/adapters/lora_linear.py, prefix_kv.py,
peft_files.py): the adapter it trains is peft's, read by peft on transformers' model with the same
logits; tensor parallelism splits the factors and the prefix by heads with the single-device
forward and gradients; packed rows give the loss and gradients of the examples one by one. Llama,
and Qwen3 (q/k head norms) and GLM-4 (LoRA on the fused gate_up_proj, partial interleaved RoPE)."""

from __future__ import annotations

import peft
import pytest
import torch
from parallel_fixtures import run_gloo
from sft_fixtures import finetune_section
from transformers import AutoModelForCausalLM

from stages.adapters import attach_adapter
from stages.adapters.peft_files import peft_config_for, peft_tensors, write_adapter
from stages.adapters.prefix_kv import from_peft, to_peft
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.model.config import config_for_flavour
from stages.model.llama import build_model
from stages.training.batches import PackedSftBatches, SftBatches
from stages.training.checkpointing import trained_parameters

TOL = 1e-5
NEWER = {"qwen3": {}, "glm4": {"partial_rotary_factor": 0.5}}  # beside attention_bias: true


@pytest.fixture(scope="module")
def newer_model_dirs(tmp_path_factory, debug_model_dir):
    """{family: HF-layout directory} of our debug-flavour Qwen3 and GLM-4, the debug model's tokenizer."""
    from stages.checkpoint.hf import load_config

    out = {}
    for family, extra in NEWER.items():
        config = config_for_flavour("debug", vocab_size=load_config(debug_model_dir).vocab_size, model_type=family,
                                    attention_bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
        out[family] = tmp_path_factory.mktemp(family) / "model"
        with atomic_dir(out[family]) as tmp:
            save_pretrained(build_model(config, seed=0), tmp, tokenizer_dir=debug_model_dir)
    return out


def _adapted(model_dir, method: str, **overrides):
    """Our model from `model_dir` with a fresh adapter whose weights are all non-zero (B too)."""
    torch.manual_seed(0)
    model = load_pretrained(model_dir)
    section = finetune_section(method, **overrides)
    attach_adapter(model, method, section)
    with torch.no_grad():
        for _, p in trained_parameters(model):
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval(), section


@pytest.mark.parametrize("method, overrides", [("lora", {"target_modules": "all-linear"}),
                                               ("lora", {"target_modules": ["q_proj", "down_proj"], "lora_rank": 3}),
                                               ("prefix", {"num_prefix_tokens": 5}),
                                               ("prefix", {"num_prefix_tokens": 5, "prefix_projection": True,
                                                           "prefix_projection_hidden_size": 24})])
def test_our_adapter_is_peft_s_on_transformers(tmp_path, debug_model_dir, method, overrides):
    """Written by peft_files, read by PeftModel.from_pretrained on transformers' Llama: same logits."""
    _check_adapter_is_peft_s(tmp_path, debug_model_dir, method, overrides)


@pytest.mark.parametrize("family", list(NEWER))
@pytest.mark.parametrize("method, overrides", [("lora", {"target_modules": "all-linear"}),
                                               ("prefix", {"num_prefix_tokens": 5})])
def test_our_adapter_is_peft_s_on_qwen3_and_glm4(tmp_path, newer_model_dirs, family, method, overrides):
    _check_adapter_is_peft_s(tmp_path, newer_model_dirs[family], method, overrides)


def _check_adapter_is_peft_s(tmp_path, debug_model_dir, method, overrides):
    model, section = _adapted(debug_model_dir, method, **overrides)
    tensors = {name: p.detach() for name, p in trained_parameters(model)}
    write_adapter(tmp_path, peft_config_for(method, section, debug_model_dir),
                  peft_tensors(method, tensors, model.config.num_hidden_layers), debug_model_dir)
    base = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        expected = theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    plain = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32)(input_ids=ids).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapter changes the output
    assert torch.allclose(ours, expected, atol=TOL, rtol=TOL)
    config = theirs.peft_config["default"]
    assert config.base_model_name_or_path == str(debug_model_dir) and config.inference_mode
    if method == "lora":  # every layer peft wraps got trained factors (peft fills missing ones with B = 0)
        wrapped = {n.removeprefix("base_model.model.") for n, m in theirs.named_modules()
                   if isinstance(m, peft.tuners.lora.LoraLayer)}
        assert wrapped == {n.split(".lora_")[0] for n in tensors}


def test_prefix_table_round_trips():
    table = torch.randn(4, 3 * 2 * 2 * 5)
    pairs = from_peft(table, num_layers=3, kv_heads=2, head_dim=5)
    assert pairs[1][0].shape == (2, 4, 5)
    assert torch.equal(to_peft(pairs), table)


def test_our_prefix_draws_the_table_as_peft_does(debug_model_dir):
    """Same seed, same initial prefix as peft's nn.Embedding (N(0, 1), one (P, L*2*K*hd) table)."""
    torch.manual_seed(3)
    ours = load_pretrained(debug_model_dir)
    attach_adapter(ours, "prefix", finetune_section("prefix", num_prefix_tokens=4))
    torch.manual_seed(3)
    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(debug_model_dir),
                                 peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    tensors = {name: p.detach() for name, p in trained_parameters(ours)}
    table = peft_tensors("prefix", tensors, ours.config.num_hidden_layers)["prompt_embeddings"]
    assert table.shape == theirs.prompt_encoder.default.embedding.weight.shape
    assert table.std().item() == pytest.approx(1.0, abs=0.1)


def test_our_projection_is_peft_s_prefix_encoder(debug_model_dir):
    """prefix_projection: same seed, same embedding and MLP as peft's PrefixEncoder, and the same table."""
    torch.manual_seed(3)
    ours = load_pretrained(debug_model_dir)
    attach_adapter(ours, "prefix", finetune_section("prefix", num_prefix_tokens=4, prefix_projection=True))
    torch.manual_seed(3)
    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(debug_model_dir),
                                 peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                         prefix_projection=True))
    encoder = theirs.prompt_encoder.default
    mine = dict(trained_parameters(ours))
    assert sorted(mine) == sorted(f"prefix_encoder.{k}" for k, _ in encoder.named_parameters())
    for name, param in encoder.named_parameters():
        assert torch.equal(mine[f"prefix_encoder.{name}"], param), name
    tensors = {name: p.detach() for name, p in mine.items()}
    with torch.no_grad():
        expected = encoder(torch.arange(4)[None])[0]
    assert torch.allclose(peft_tensors("prefix", tensors, ours.config.num_hidden_layers)["prompt_embeddings"],
                          expected, atol=1e-6)


def test_a_projection_trains_its_mlp_and_leaves_the_base(debug_model_dir):
    model, _ = _adapted(debug_model_dir, "prefix", num_prefix_tokens=3, prefix_projection=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    model(ids).pow(2).mean().backward()
    trained = dict(trained_parameters(model))
    assert trained and all(name.startswith("prefix_encoder.") for name in trained)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trained)


def _tp_forward_backward(rank, world, model_dir, method, overrides, sequence_parallel=False):
    """Our adapted model, tensor-parallel over the group: logits and adapter gradients, gathered whole."""
    import torch.distributed as dist

    from stages.parallel import apply_tensor_parallel
    from stages.parallel.plan import gather_full_state_dict

    model, _ = _adapted(model_dir, method, **overrides)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    logits.pow(2).mean().backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    for _, p in trained_parameters(model):
        p.data = p.grad  # gather the gradients as if they were the weights
    grads = {k: v for k, v in gather_full_state_dict(model, dist.group.WORLD).items()
             if "lora_" in k or "prefix_" in k}
    return logits.detach(), grads, frozen


@pytest.mark.multiproc
@pytest.mark.parametrize("method, overrides", [("lora", {"target_modules": "all-linear"}),
                                               ("prefix", {"num_prefix_tokens": 3})])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sequence_parallel"])
def test_tensor_parallel_adapter_matches_the_single_device_one(debug_model_dir, method, overrides, sequence_parallel):
    """tp2: LoRA's A whole / B split (column) and A split / B whole (row), the prefix split by KV
    heads: the same logits and the same whole gradients as one device, the base frozen; with
    sequence parallelism too (9 tokens: padded to 10 inside the layers)."""
    _check_tensor_parallel_adapter(debug_model_dir, method, overrides, sequence_parallel)


@pytest.mark.multiproc
def test_tensor_parallel_lora_splits_each_half_of_glm_s_gate_up_proj(newer_model_dirs):
    """GLM-4's gate_up_proj ([gate; up]): rank r holds [gate_r; up_r] of the base and of LoRA's B."""
    _check_tensor_parallel_adapter(newer_model_dirs["glm4"], "lora", {"target_modules": "all-linear"})


def _check_tensor_parallel_adapter(debug_model_dir, method, overrides, sequence_parallel=False):
    model, _ = _adapted(debug_model_dir, method, **overrides)
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    logits.pow(2).mean().backward()
    expected = {n: p.grad for n, p in trained_parameters(model)}
    for rank_logits, grads, frozen in run_gloo(_tp_forward_backward, 2, debug_model_dir, method, overrides,
                                               sequence_parallel):
        assert torch.allclose(rank_logits, logits.detach(), atol=TOL, rtol=TOL)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, expected[name], atol=TOL, rtol=1e-4), name
        assert frozen and not any("lora_" in n or "prefix_" in n for n in frozen)


def _examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        ids = torch.randint(3, 200, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out


@pytest.mark.parametrize("method", ["sft", "lora", "prefix"])
def test_packed_rows_give_the_loss_and_gradients_of_padded_ones(debug_model_dir, method):
    """The same examples, padded one per row or packed several per row (positions restarting,
    attention kept inside each example): the same summed loss and gradients within 1e-5."""
    from stages.training.step import token_sum_loss

    examples = _examples(9)
    padded = SftBatches(examples, 32, 0, seed=0)
    packed = PackedSftBatches(examples, 32, 0, seed=0)
    assert len(packed.rows) < len(examples) and packed.fill > 0.5
    results = []
    for batches in ([(padded.ids, padded.labels)], [(packed.ids, packed.labels, packed.position_ids)]):
        torch.manual_seed(0)
        model = load_pretrained(debug_model_dir) if method == "sft" else _adapted(debug_model_dir, method)[0]
        ids, labels, *pos = batches[0]
        loss = token_sum_loss(model, ids, labels, None, pos[0] if pos else None)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in trained_parameters(model)}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert int((padded.labels[:, 1:] != -100).sum()) == int((packed.labels[:, 1:] != -100).sum())
    assert torch.allclose(loss_a, loss_b, rtol=TOL)
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=TOL, rtol=1e-4), name


def test_packing_refuses_an_example_longer_than_the_row():
    with pytest.raises(ValueError, match="more than max_length=8"):
        PackedSftBatches(_examples(3) + [(list(range(3, 13)), [-100] + list(range(4, 13)))], 8, 0, seed=0)


def test_packed_row_layout():
    """Position ids restart per example, the padding is one more segment, no label on any
    example's first token."""
    examples = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [8, 9]), ([10, 11, 12, 13], [-100, -100, 12, 13])]
    packed = PackedSftBatches(examples, 10, 0, seed=0)
    assert len(packed.rows) == 1
    row = packed.rows[0]
    starts = [0]
    for i in row[:-1]:
        starts.append(starts[-1] + len(examples[i][0]))
    positions = packed.position_ids[0].tolist()
    assert [positions[s] for s in starts] == [0] * 3 and positions[9] == 0  # the pad segment
    assert all(packed.labels[0, s] == -100 for s in starts)
    assert int((packed.labels != -100).sum()) == 2 + 1 + 2  # example 1 loses its first label only


def test_lora_model_is_built_like_the_flavour():
    model = build_model(config_for_flavour("debug", vocab_size=64), seed=0)
    attach_adapter(model, "lora", finetune_section("lora", target_modules="all-linear"))
    names = [n for n, _ in trained_parameters(model)]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".")[-3] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"}


@pytest.fixture(scope="module")
def other_bases(tmp_path_factory, tiny_tokenizer_dir, debug_model_dir):
    """Debug-flavour models of another width and another depth than debug_model_dir's."""
    import json

    from stages.checkpoint.atomic import atomic_dir
    from stages.checkpoint.hf import save_pretrained

    config = json.loads((debug_model_dir / "config.json").read_text())
    out = {}
    for name, change in {"wider": {"intermediate_size": config["intermediate_size"] * 2},
                         "deeper": {"num_hidden_layers": config["num_hidden_layers"] + 1}}.items():
        model = build_model(config_for_flavour("debug", vocab_size=config["vocab_size"], bos_token_id=1,
                                               eos_token_id=2, pad_token_id=0, **change), seed=0)
        with atomic_dir(tmp_path_factory.mktemp("bases") / name) as tmp:
            save_pretrained(model, tmp, tokenizer_dir=tiny_tokenizer_dir)
        out[name] = tmp.parent / name
    return out


@pytest.mark.parametrize("method, base, message", [
    ("lora", "wider", r"does not fit base model .*wider.*down_proj.lora_A.weight is \[4, 192\].*in_features=192"),
    ("prefix", "deeper", r"does not fit base model .*deeper.*num_layers=2, the base has num_hidden_layers=3"),
])
def test_an_adapter_for_another_base_names_the_mismatch(tmp_path, debug_model_dir, other_bases, method, base, message):
    from stages import evaluate, merge
    from stages.adapters.peft_files import check_adapter_fits

    overrides = {"target_modules": ["down_proj"]} if method == "lora" else {}
    model, section = _adapted(debug_model_dir, method, **overrides)
    tensors = {name: p.detach() for name, p in trained_parameters(model)}
    write_adapter(tmp_path / "adapter", peft_config_for(method, section, debug_model_dir),
                  peft_tensors(method, tensors, model.config.num_hidden_layers), other_bases[base])
    check_adapter_fits(tmp_path / "adapter", debug_model_dir)  # its own base fits
    with pytest.raises(ValueError, match=message):
        evaluate.load_variant(tmp_path / "adapter")  # adapter_config.json names the other base
    if method == "lora":
        with pytest.raises(ValueError, match=message):
            merge.run(tmp_path / "adapter", tmp_path / "merged", base_dir=other_bases[base])
        assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("family", ["ours", "transformers"])
def test_a_prefix_from_tokens_is_the_kv_cache_of_those_tokens(debug_model_dir, family):
    """prefix_init=tokens: the adapted model's logits on x equal the base model's logits on
    (tokens + x) at x's positions, for our model and for peft's prefix on transformers' model."""
    section = finetune_section("prefix", num_prefix_tokens=4)
    tokens = [5, 17, 42, 9]
    ids = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(2))
    base = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = base(input_ids=torch.cat([torch.tensor([tokens]), ids], dim=1)).logits[:, 4:]
        if family == "ours":
            model = load_pretrained(debug_model_dir).eval()
            attach_adapter(model, "prefix", section, init_ids=tokens)
            logits = model(ids)
        else:
            model = attach_adapter(AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32),
                                   "prefix", section, init_ids=tokens).eval()
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.allclose(logits, expected, atol=TOL, rtol=TOL)


def test_adapter_config_is_the_same_bytes_in_every_process(tmp_path, debug_model_dir):
    """peft keeps target_modules as a set and writes it in iteration order, which follows the
    process's string-hash seed; written sorted, two processes with other seeds write equal bytes."""
    import os
    import subprocess
    import sys

    script = ("import sys, json; from pathlib import Path; from sft_fixtures import finetune_section;"
              "from stages.adapters.peft_files import peft_config_for, write_adapter;"
              "section = finetune_section('lora', target_modules="
              "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'up_proj', 'down_proj']);"
              "write_adapter(Path(sys.argv[1]), peft_config_for('lora', section, sys.argv[2]), {}, sys.argv[2])")
    here = os.path.dirname(__file__)
    written = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-c", script, str(out), str(debug_model_dir)], check=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(here)))
        written.append((out / "adapter_config.json").read_bytes())
    assert written[0] == written[1]
    import json
    targets = json.loads(written[0])["target_modules"]
    assert targets == sorted(targets) and len(targets) == 6
