"""stages/harness/variant_lm.py and tasks.py against lm-evaluation-harness's own HF backend
(`HFLM`), on a random-init Llama saved by the installed transformers with the prepare stage's
tokenizer: the same requests give the same log-likelihoods (1e-5), greedy generations and local
task scores; a LoRA adapter through our loader equals HFLM's `peft=`; an ONNX export scores as its
torch source; bad task names and hub-only tasks fail with the fix."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from checkpoint_fixtures import save_prepared_tokenizer
from stages.errors import InputError
from stages.inference.loading import load_variant
from stages.harness.variant_lm import VariantLM
from stages.harness.tasks import LOCAL_TASKS, run_tasks

TOLERANCE = 1e-5
MAX_LENGTH = 24  # short, so that contexts are cut and the rolling scores take several windows
QUESTIONS = ["what colour is the apple?", "what colour is the sky?", "what colour is grass?", "what colour is snow?",
             "what colour is coal?", "what colour is a plum?"]
ANSWERS = ["red", "blue", "green", "white", "black", "purple"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Llama saved by transformers' save_pretrained, with our prepared tokenizer (bos in front)."""
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer_dir = save_prepared_tokenizer(root / "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A prepare data dir's sft/dev.json and preference/dev.json (what the local tasks read)."""
    root = tmp_path_factory.mktemp("lm_eval_data")
    (root / "sft").mkdir()
    (root / "preference").mkdir()
    (root / "sft" / "dev.json").write_text("".join(
        json.dumps({"src": q, "tgt": a}) + "\n" for q, a in zip(QUESTIONS, ANSWERS)))
    (root / "preference" / "dev.json").write_text("".join(
        json.dumps({"src": q, "chosen": a, "rejected": ANSWERS[(i + 1) % len(ANSWERS)]}) + "\n"
        for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS))))
    return root


def _hflm(path, **kwargs) -> HFLM:
    return HFLM(pretrained=str(path), device="cpu", batch_size=3, max_length=MAX_LENGTH, dtype="float32", **kwargs)


def _ours(path) -> VariantLM:
    model, tokenizer, _ = load_variant(path)
    return VariantLM(model, tokenizer, batch_size=2, max_length=MAX_LENGTH)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


LOGLIKELIHOOD = [("the colour of the apple is", " red"), ("the colour of the sky is", " blue"),
                 ("", "the colour of grass is green"),  # empty context: the bos conditions
                 ("what colour is it? " * 6, "one two three"),  # longer than MAX_LENGTH: cut from the left
                 ("question answer:", " one")]
ROLLING = [("the colour of the apple is red, the colour of the sky is blue, snow is white, coal is black",),
           ("a banana is yellow",)]


def _assert_scores_equal(ours, theirs):
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    torch.testing.assert_close(torch.tensor([s for s, _ in ours], dtype=torch.float64),
                               torch.tensor([s for s, _ in theirs], dtype=torch.float64), rtol=0, atol=TOLERANCE)


def test_loglikelihoods_and_generations_equal_lm_evals_hf_backend(checkpoint):
    ours, theirs = _ours(checkpoint), _hflm(checkpoint)
    assert ours.max_length == theirs.max_length == MAX_LENGTH
    assert ours.tok_encode("the sky") == theirs.tok_encode("the sky")
    assert ours.tok_encode("the sky")[0] == 1  # the prepared tokenizer puts the bos in front
    _assert_scores_equal(ours.loglikelihood(_requests("loglikelihood", LOGLIKELIHOOD)),
                         theirs.loglikelihood(_requests("loglikelihood", LOGLIKELIHOOD)))
    torch.testing.assert_close(torch.tensor(ours.loglikelihood_rolling(_requests("loglikelihood_rolling", ROLLING))),
                               torch.tensor(theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", ROLLING))),
                               rtol=0, atol=TOLERANCE)
    gen = [("the colour of the apple is", {"until": ["sky"], "max_gen_toks": 6, "do_sample": False}),
           ("what colour is it?", {"until": ["\n"], "max_gen_toks": 4}),
           ("snow is white, coal is", {"until": ["sky"], "max_gen_toks": 6, "do_sample": False})]
    ours_text = ours.generate_until(_requests("generate_until", gen))
    assert ours_text == theirs.generate_until(_requests("generate_until", gen))
    assert any(ours_text)  # a random model still says something in 4-6 tokens


def test_sampled_generations_are_seeded_and_an_onnx_variant_refuses_them(checkpoint, tmp_path):
    """do_sample: true samples on the decode engine from a fixed seed (the same text on every call);
    an ONNX export, which generates greedily only, says so."""
    from stages import export

    ours = _ours(checkpoint)
    sampled = [("the colour of the apple is", {"until": ["\n"], "max_gen_toks": 6, "do_sample": True,
                                               "temperature": 1.5})] * 2 + [("a banana is", {"max_gen_toks": 6,
                                                                                           "do_sample": True})]
    first = ours.generate_until(_requests("generate_until", sampled))
    assert first == ours.generate_until(_requests("generate_until", sampled))
    assert first[0] != first[1]  # two draws of one generator, not one draw repeated
    greedy = ours.generate_until(_requests("generate_until", [(sampled[0][0], {"max_gen_toks": 6})]))
    assert greedy[0] not in first[:2]
    export.run(checkpoint, tmp_path / "onnx", {"int8": False})
    model, tokenizer, kind = load_variant(tmp_path / "onnx")
    assert kind == "onnx"
    with pytest.raises(ValueError, match="do_sample: true.*not a torch model"):
        VariantLM(model, tokenizer).generate_until(_requests("generate_until", sampled[:1]))


def test_local_tasks_score_as_with_lm_evals_hf_backend(checkpoint, data_dir):
    ours = run_tasks(_ours(checkpoint), list(LOCAL_TASKS), data_dir=data_dir, max_gen_toks=4)
    theirs = run_tasks(_hflm(checkpoint), list(LOCAL_TASKS), data_dir=data_dir, max_gen_toks=4)
    assert ours["tasks"] == theirs["tasks"]
    qa, pairs = ours["tasks"]["lifecycle_qa"], ours["tasks"]["lifecycle_pairs"]
    assert qa["samples"] == pairs["samples"] == len(QUESTIONS)
    assert set(qa["metrics"]) == {"exact_match"} and set(pairs["metrics"]) == {"acc", "acc_norm"}
    assert qa["higher_is_better"] == {"exact_match": True}
    assert 0.0 <= pairs["metrics"]["acc"] <= 1.0
    limited = run_tasks(_ours(checkpoint), ["lifecycle_pairs"], data_dir=data_dir, limit=2)
    assert limited["tasks"]["lifecycle_pairs"]["samples"] == 2 and limited["limit"] == 2


def test_tasks_run_without_lm_evals_environment_report(checkpoint, data_dir, capfd, monkeypatch):
    """simple_evaluate's collect_env subprocesses and `git describe` are skipped (0.26 s a job, and a "fatal: not
    a git repository" line in the log outside a checkout), and lm-eval's own functions are back afterwards."""
    import lm_eval.evaluator

    before = (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash)
    monkeypatch.chdir(data_dir)  # not a git checkout
    run_tasks(_ours(checkpoint), ["lifecycle_pairs"], data_dir=data_dir, limit=2)
    assert "not a git repository" not in capfd.readouterr().err
    assert (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash) == before


def test_a_trained_model_gets_the_local_tasks_right(checkpoint, data_dir, tmp_path):
    """The scores measure something: after a few steps on the dev answers the model answers them."""
    model, tokenizer, _ = load_variant(checkpoint)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    texts = [tokenizer(q + a, add_special_tokens=True)["input_ids"] + [2] for q, a in zip(QUESTIONS, ANSWERS)]
    for _ in range(100):
        for ids in texts:
            batch = torch.tensor([ids])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    scores = run_tasks(VariantLM(model, tokenizer), list(LOCAL_TASKS), data_dir=data_dir, max_gen_toks=4)
    assert scores["tasks"]["lifecycle_qa"]["metrics"]["exact_match"] == 1.0
    assert scores["tasks"]["lifecycle_pairs"]["metrics"]["acc"] == 1.0


@torch.no_grad()
def _answers_every_example(model, examples) -> bool:
    """Whether each learned token of every (ids, labels) example is the model's argmax after its prefix
    (so greedy decoding from the prompt reproduces the answer)."""
    for ids, labels in examples:
        predicted = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1)
        target = torch.tensor(labels[1:])
        learned = target != -100
        if not torch.equal(predicted[learned], target[learned]):
            return False
    return True


def test_the_chat_template_path_reads_what_sft_taught(tmp_path, data_dir):
    """A model trained on our chat encoding (stages.data.sft, ChatML, eos <|im_end|>) answers the
    local tasks through lm-eval's apply_chat_template: the prompt lm-eval renders is the one the
    model learned to answer."""
    from checkpoint_fixtures import chat_tokenizer, save_checkpoint, save_tiny_tokenizer
    from stages.data.sft import SftRecord, encode_example

    tokenizer = chat_tokenizer(save_tiny_tokenizer(tmp_path / "tokenizer"))
    model_dir = save_checkpoint(tmp_path / "chat", tokenizer)
    model, tokenizer, _ = load_variant(model_dir)
    examples = [encode_example(tokenizer, SftRecord([q], [a]), 64, 96, chat=True) for q, a in zip(QUESTIONS, ANSWERS)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # until every answer token is the model's argmax after its chat prompt: 60 passes were enough on an
    # AVX512 machine, not on one without AVX-512 (2026-11-30: exact match 1/3 there)
    for _ in range(300):
        model.train()
        for ids, labels in examples:
            loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if _answers_every_example(model.eval(), examples):
            break
    assert _answers_every_example(model, examples)
    lm = VariantLM(model, tokenizer)
    scores = run_tasks(lm, list(LOCAL_TASKS), data_dir=data_dir, max_gen_toks=4, chat=True)
    assert scores["chat_template"] is True
    assert scores["tasks"]["lifecycle_qa"]["metrics"]["exact_match"] == 1.0
    assert scores["tasks"]["lifecycle_pairs"]["metrics"]["acc"] == 1.0
    plain = run_tasks(lm, ["lifecycle_qa"], data_dir=data_dir, max_gen_toks=4, chat=False)
    assert plain["tasks"]["lifecycle_qa"]["metrics"]["exact_match"] < 1.0  # the template is what it learned


def test_a_lora_adapter_scores_as_lm_evals_peft_backend(checkpoint, tmp_path):
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "lora")
    transformers.AutoTokenizer.from_pretrained(checkpoint).save_pretrained(tmp_path / "lora")
    model, tokenizer, kind = load_variant(tmp_path / "lora", base_dir=checkpoint)
    assert kind == "adapter"
    ours = VariantLM(model, tokenizer, batch_size=2, max_length=MAX_LENGTH)
    theirs = _hflm(checkpoint, peft=str(tmp_path / "lora"))
    requests = _requests("loglikelihood", LOGLIKELIHOOD)
    _assert_scores_equal(ours.loglikelihood(requests), theirs.loglikelihood(requests))
    plain = _ours(checkpoint).loglikelihood(requests)
    assert max(abs(a - b) for (a, _), (b, _) in zip(ours.loglikelihood(requests), plain)) > 1e-3  # the adapter counts


def test_unknown_and_hub_tasks_fail_with_the_fix(checkpoint, data_dir, tmp_path):
    lm = _ours(checkpoint)
    with pytest.raises(InputError, match="evaluate.lm_eval_tasks names .*no_such_task"):
        run_tasks(lm, ["no_such_task"], data_dir=data_dir, include_path=tmp_path)
    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: no-such-org/no-such-dataset\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n")
    with pytest.raises(InputError, match="jobs run offline.*lm_eval_include_path"):
        run_tasks(lm, ["hub_task"], data_dir=data_dir, include_path=tmp_path)
    with pytest.raises(InputError, match="names a task twice"):
        run_tasks(lm, ["lifecycle_qa", "lifecycle_qa"], data_dir=data_dir)


def test_a_users_yaml_task_on_local_files(checkpoint, data_dir, tmp_path):
    """A task in lm-eval's own YAML, its data a local JSON-lines file, found in the include path."""
    rows = [{"q": f"the colour of the {x} is", "choices": [" red", " blue"], "gold": i % 2}
            for i, x in enumerate(["apple", "sky", "grass", "plum"])]
    (tmp_path / "colours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "colours.yaml").write_text(
        "task: colours\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'colours.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n")
    ours = run_tasks(_ours(checkpoint), ["colours"], data_dir=data_dir, include_path=tmp_path)
    theirs = run_tasks(_hflm(checkpoint), ["colours"], data_dir=data_dir, include_path=tmp_path)
    assert ours["tasks"] == theirs["tasks"] and ours["tasks"]["colours"]["samples"] == 4


def test_a_real_checkpoint_scores_as_with_lm_evals_hf_backend(smollm2_dir):
    """SmolLM2-135M-Instruct (a real pretrained model): the same log-likelihoods (1e-5, in fp32) and
    greedy generations through our loader as through lm-eval's own."""
    model, tokenizer, _ = load_variant(smollm2_dir)
    ours = VariantLM(model, tokenizer, batch_size=2)
    theirs = HFLM(pretrained=str(smollm2_dir), device="cpu", batch_size=3, dtype="float32")
    assert ours.max_length == theirs.max_length
    prose = ("Snakemake reruns a rule only when its inputs, its hyperparameters or its code change, and "
             "outputs appear only when whole.")
    requests = _requests("loglikelihood", [("The capital of France is", " Paris"), ("2 + 2 =", " 4"),
                                           (prose[:60], prose[60:]), ("", prose)])
    _assert_scores_equal(ours.loglikelihood(requests), theirs.loglikelihood(requests))
    gen = _requests("generate_until", [("The capital of France is", {"until": ["."], "max_gen_toks": 8}),
                                       ("Snakemake reruns a rule", {"until": ["\n"], "max_gen_toks": 8})])
    assert ours.generate_until(gen) == theirs.generate_until(gen)
