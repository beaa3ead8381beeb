"""Tests of stages/prepare.py: the whole data artifact, determinism, errors before writing, CLI."""

import json
import re

import numpy as np
import pytest
from pydoc_data.topics import topics
from transformers import AutoTokenizer

from stages import prepare
from stages.data import attributes, records
from stages.data.corpus import CorpusError, load_split
from stages.data.mix_sources import load_mix_sources
from stages.data.sft import read_sft_file
from stages.data.validate import DataConfigError

SMALL = dict(corpus=["builtin:pydoc"], sft="builtin:attributes", vocab_size=512, validation_fraction=0.05,
             num_sft_train=200, num_sft_dev=16, seed=42, chat_template=True)
FILES = ["index.json", "meta.json", "preference/dev.json", "preference/train.json", "sft/dev.json", "sft/train.json",
         "tokenizer/special_tokens_map.json",
         "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "train.bin", "train.idx",
         "validation.bin", "validation.idx"]


def listing(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def pydoc_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "data"
    return out, prepare.run(out, SMALL)


def test_writes_the_documented_files(pydoc_run):
    out, metrics = pydoc_run
    assert listing(out) == FILES
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_meta_and_metrics(pydoc_run):
    out, metrics = pydoc_run
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "prepare" and meta["parent"] is None and meta["seed"] == 42
    assert meta["config"] == {**SMALL, "preference": None, "tokenizer": None} and meta["metrics"] == metrics
    index = json.loads((out / "index.json").read_text())
    assert metrics["vocab_size"] == index["vocab_size"] == 512 and index["dtype"] == "uint16"
    assert metrics["num_documents_train"] + metrics["num_documents_validation"] == len(topics)
    assert metrics["num_documents_validation"] >= 1
    for split in ("train", "validation"):
        assert metrics[f"num_tokens_{split}"] == index["splits"][split]["num_tokens"]
    assert (metrics["num_sft_train"], metrics["num_sft_dev"]) == (200, 16)
    assert (metrics["num_preference_train"], metrics["num_preference_dev"]) == (200, 16)
    assert 0 < metrics["train_unigram_entropy_bits"] < np.log2(512)


def test_token_files_decode_to_the_corpus(pydoc_run):
    out, _ = pydoc_run
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    decoded = []
    for split in ("train", "validation"):
        tokens, offsets = load_split(out, split)
        for start, end in zip(offsets[:-1], offsets[1:]):
            assert tokens[end - 1] == tok.eos_token_id
            decoded.append(tok.decode(tokens[start:end - 1].tolist()))
    assert sorted(decoded) == sorted(topics.values())


def test_builtin_records_are_training_text_only(tmp_path):
    """builtin:records joins the train split, after the other documents; validation holds general
    text only (the pydoc topics here), whose perplexity is what forgetting is measured on."""
    with_records = tmp_path / "data"
    more = prepare.run(with_records, {**SMALL, "corpus": ["builtin:pydoc", "builtin:records"]})
    assert more["num_documents_train"] + more["num_documents_validation"] == len(topics) + records.DOCUMENTS
    tok = AutoTokenizer.from_pretrained(str(with_records / "tokenizer"))
    tokens, offsets = load_split(with_records, "train")
    tail = [tok.decode(tokens[s:e - 1].tolist()) for s, e in zip(offsets[-records.DOCUMENTS - 1:-1],
                                                                 offsets[-records.DOCUMENTS:])]
    assert tail == records.documents()
    # named in a fine-tuning section's mix_datasets, it is the same text, tokenized there
    mixed, = load_mix_sources(["builtin:records"], with_records, tok, "finetune.lora.mix_datasets")
    assert mixed.tolist() == tokens[offsets[-records.DOCUMENTS - 1]:].tolist()
    tokens, offsets = load_split(with_records, "validation")
    held_out = {tok.decode(tokens[s:e - 1].tolist()) for s, e in zip(offsets[:-1], offsets[1:])}
    assert held_out <= set(topics.values())
    with pytest.raises(CorpusError, match="only builtin:records, which is training text only"):
        prepare.run(tmp_path / "records_only", {**SMALL, "corpus": ["builtin:records"]})
    assert not (tmp_path / "records_only").exists()


def test_records_pair_a_record_with_its_sentence():
    text = records.documents(count=3, pairs=50)
    assert text == records.documents(count=3, pairs=50)  # fixed text
    lines = "".join(text).splitlines()
    assert len(lines) == 300
    task_words = {*attributes.SIZES, *attributes.COLORS, *attributes.SHAPES, *attributes.NUMBER_WORDS.values()}
    for record, sentence in zip(lines[::2], lines[1::2]):
        values = dict(field.split(": ") for field in record.split("; "))
        assert {"name", "job", "city"} <= set(values) <= {"name", "job", "city", "drink", "sport"}
        article = "an" if values["job"][0] in "aeiou" else "a"
        assert sentence.startswith(f"{values['name']} is {article} {values['job']} from {values['city']}")
        habits = [f"{verb} {values[key]}" for key, verb in (("drink", "drinks"), ("sport", "plays")) if key in values]
        assert sentence.endswith(" who " + " and ".join(habits) + "." if habits else f"{values['city']}.")
        assert not task_words & set(re.findall(r"[a-z]+", (record + " " + sentence).lower()))
    assert len({r.split(": ")[0] for r in lines[::2]}) == 5  # the key order varies: every key comes first


def test_sft_files(pydoc_run):
    out, _ = pydoc_run
    train, dev = read_sft_file(out / "sft" / "train.json"), read_sft_file(out / "sft" / "dev.json")
    assert len(train) == 200 and len(dev) == 16
    assert not {r.src[0] for r in train} & {r.src[0] for r in dev}


def test_tokenizer_learns_sft_words(tmp_path):
    """SFT train texts join the tokenizer's training text, so the task's words become tokens."""
    (tmp_path / "c.txt").write_text("A small corpus about nothing in particular. " * 5)
    prepare.run(tmp_path / "out", {**SMALL, "corpus": [str(tmp_path / "c.txt")], "vocab_size": 400})
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"))
    for word in (" crosses", " enormous", " purple", "three"):
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word


def test_deterministic(pydoc_run, tmp_path):
    out, _ = pydoc_run
    again = tmp_path / "data"
    prepare.run(again, SMALL)
    for name in FILES:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def test_user_corpus_and_sft_dir(tmp_path):
    (tmp_path / "texts").mkdir()
    for i in range(5):
        (tmp_path / "texts" / f"{i}.txt").write_text(f"document number {i} talks about apples. " * 20)
    (tmp_path / "my_sft" / "train").mkdir(parents=True)
    (tmp_path / "my_sft" / "train" / "b.json").write_text('{"src": ["q1", "q2"], "tgt": ["a1", "a2"]}\n')
    (tmp_path / "my_sft" / "train" / "a.json").write_text('{"src": "hello", "tgt": "world"}\n')
    (tmp_path / "my_sft" / "dev.json").write_text('{"src": ["x"], "tgt": ["y"]}\n')
    metrics = prepare.run(tmp_path / "out", dict(corpus=["texts/*.txt"], sft="my_sft", vocab_size=300,
                          validation_fraction=0.2, num_sft_train=1, num_sft_dev=1, seed=0), base_dir=tmp_path)
    assert (metrics["num_documents_train"], metrics["num_documents_validation"]) == (4, 1)
    assert (metrics["num_sft_train"], metrics["num_sft_dev"]) == (2, 1)
    assert (tmp_path / "out" / "sft" / "train.json").read_text() == (
        '{"src": "hello", "tgt": "world"}\n{"src": ["q1", "q2"], "tgt": ["a1", "a2"]}\n')
    assert (tmp_path / "out" / "sft" / "dev.json").read_text() == '{"src": "x", "tgt": "y"}\n'


def test_single_document_corpus(tmp_path):
    (tmp_path / "one.txt").write_text("just one document, split at token level. " * 10)
    metrics = prepare.run(tmp_path / "out", {**SMALL, "corpus": [str(tmp_path / "one.txt")], "vocab_size": 300,
                                             "num_sft_train": 5, "num_sft_dev": 2})
    assert (metrics["num_documents_train"], metrics["num_documents_validation"]) == (1, 1)


@pytest.mark.parametrize("breakage, error, match", [
    ("corpus_line", CorpusError, r"bad.jsonl:2: malformed JSON"),
    ("sft_line", DataConfigError, r"data.sft: .*dev.json:1: record has no 'tgt'"),
    ("missing", DataConfigError, r"data.corpus\[1\]: 'nowhere/\*.txt' .* matches no file"),
])
def test_bad_input_raises_before_writing(tmp_path, breakage, error, match):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + ('{oops\n' if breakage == "corpus_line" else ""))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "train.json").write_text('{"src": "a", "tgt": "b"}\n')
    (tmp_path / "sft" / "dev.json").write_text('{"src": "a"}\n' if breakage == "sft_line" else '{"src": "a", "tgt": "b"}\n')
    corpus = ["bad.jsonl"] + (["nowhere/*.txt"] if breakage == "missing" else [])
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("an earlier result")
    with pytest.raises(error, match=match):
        prepare.run(out, dict(corpus=corpus, sft="sft", vocab_size=300, validation_fraction=0.1,
                              num_sft_train=1, num_sft_dev=1, seed=0), base_dir=tmp_path)
    assert listing(out) == ["previous.txt"]  # the earlier artifact is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out", "sft"]


def test_main_cli(tmp_path):
    config = {**SMALL, "num_sft_train": 20, "num_sft_dev": 4, "vocab_size": 300}
    metrics = prepare.main(["--out", str(tmp_path / "d"), "--config", json.dumps(config)])
    assert metrics["num_sft_train"] == 20 and (tmp_path / "d" / "meta.json").is_file()


@pytest.mark.parametrize("config, match", [
    ("{not json", "--config is not valid JSON"),
    ("[1, 2]", "--config must be a JSON object"),
    (json.dumps({**SMALL, "vocab": 3}), r"'data.vocab' is unknown; did you mean 'vocab_size'"),
    (json.dumps({**SMALL, "validation_fraction": 0.7}), r"'data.validation_fraction': 0.7 is greater than or equal to"),
])
def test_main_rejects_bad_config(tmp_path, capsys, config, match):
    with pytest.raises(SystemExit) as e:
        prepare.main(["--out", str(tmp_path / "d"), "--config", config])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "d").exists()


# -- a starting checkpoint's own tokenizer ------------------------------------------------------
@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    from checkpoint_fixtures import chat_tokenizer, save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", chat_tokenizer(tiny_tokenizer_dir))


def test_a_checkpoint_keeps_its_tokenizer(chat_checkpoint, tmp_path):
    """No tokenizer is trained: the corpus is tokenized with the checkpoint's own (its files copied
    byte for byte, chat template included), the vocabulary is its embedding's, and index.json
    records the tokenizer's fingerprint and the chat format."""
    from stages.data.tokenizer import tokenizer_fingerprint

    config = {**SMALL, "num_sft_train": 20, "num_sft_dev": 4}
    metrics = prepare.run(tmp_path / "d", config, tokenizer_dir=chat_checkpoint)
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    own = AutoTokenizer.from_pretrained(chat_checkpoint)
    assert metrics["vocab_size"] == index["vocab_size"] == json.loads(
        (chat_checkpoint / "config.json").read_text())["vocab_size"] == len(own) + 3
    assert index["tokenizer_fingerprint"] == tokenizer_fingerprint(own)
    assert index["sft_format"] == "chat_template" and index["bos_token_id"] is None
    assert index["eos_token_id"] == own.convert_tokens_to_ids("<|im_end|>")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "d" / "tokenizer" / name).read_bytes() == (chat_checkpoint / name).read_bytes()
    tokens, offsets = load_split(tmp_path / "d", "train")
    first = np.asarray(tokens[offsets[0]:offsets[1] - 1]).tolist()
    assert own.decode(first) in {topics[k] for k in topics}  # the model's ids, decoded by the model
    plain = prepare.run(tmp_path / "p", {**config, "chat_template": False}, tokenizer_dir=chat_checkpoint)
    assert plain["vocab_size"] == metrics["vocab_size"]
    assert json.loads((tmp_path / "p" / "index.json").read_text())["sft_format"] == "plain"


def test_a_model_evaluated_on_data_of_another_tokenizer_is_refused(chat_checkpoint, debug_model_dir, tmp_path):
    """The ids of data prepared with one tokenizer mean other tokens to a model of another: the
    stages that read both (finetune, evaluate) refuse, naming both."""
    from stages import evaluate, finetune
    from sft_fixtures import finetune_section

    prepare.run(tmp_path / "d", {**SMALL, "num_sft_train": 20, "num_sft_dev": 4}, tokenizer_dir=chat_checkpoint)
    match = (rf"tokenizer mismatch: {debug_model_dir} carries tokenizer \w{{12}} \(\d+ tokens\) but "
             rf"{tmp_path / 'd'} was tokenized with tokenizer \w{{12}}.*from {chat_checkpoint}")
    with pytest.raises(ValueError, match=match):
        evaluate.run(debug_model_dir, tmp_path / "d", tmp_path / "e.json", "x", {})
    with pytest.raises(ValueError, match=match):
        finetune.run("lora", debug_model_dir, tmp_path / "d", tmp_path / "lora", finetune_section("lora"))
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "lora").exists()
