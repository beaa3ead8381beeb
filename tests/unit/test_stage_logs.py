"""stages/stage_logs.py, and the logs of real stages on tiny inputs: the first line names what the
stage reads and writes, and its long loops log `k/n` progress lines (in a log file: no `\\r` bars)."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stages import evaluate, predict, prepare
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import save_pretrained
from stages.data.corpus import read_index
from stages.model import build_model, config_for_flavour
from stages.stage_logs import Progress, duration, io_line, log_io

ROOT = Path(__file__).resolve().parents[2]
DATA = dict(corpus=["builtin:pydoc"], sft="builtin:attributes", vocab_size=300, validation_fraction=0.05,
            num_sft_train=40, num_sft_dev=8, seed=0)
EVALUATE = {"max_new_tokens": 4, "num_dev_examples": 6, "ppl_max_length": 16, "ppl_max_windows": 5,
            "per_device_eval_batch_size": 2, "speed_prefill_tokens": 8, "speed_batch_sizes": [1, 2],
            "speed_decode_tokens": 3, "speed_repeats": 1}
TIME = r"\d+\.\d s"  # duration() below a minute


# -- the helpers ---------------------------------------------------------------------------------

def test_io_line_names_every_path_with_what_it_is():
    line = io_line("quantize", reads={"float model": Path("r/lora-merged"), "calibration": None,
                                      "corpus": ["a.txt", Path("b.txt")], "nothing given": []},
                   writes={"variant wint4": "r/quant/wint4"})
    assert line == ("quantize: reads r/lora-merged (float model), a.txt, b.txt (corpus); "
                    "writes r/quant/wint4 (variant wint4)")
    assert io_line("plan", {}, {"plan": "stdout"}) == "plan: reads nothing; writes stdout (plan)"


def test_only_rank_zero_logs_the_first_line(monkeypatch, caplog):
    with caplog.at_level(logging.INFO):
        monkeypatch.setenv("RANK", "1")
        log_io("pretrain", {"data": "d"}, {"model": "m"})
        monkeypatch.setenv("RANK", "0")
        log_io("pretrain", {"data": "d"}, {"model": "m"})
    assert caplog.messages == ["pretrain: reads d (data); writes m (model)"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_logs_each_tenth_with_count_elapsed_and_time_left(caplog):
    clock, log = Clock(), logging.getLogger("test.progress")
    progress = Progress(log, "windows", 23, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for _ in range(0, 23, 4):  # batches of 4, the last of 3, 6 s each
            clock.now += 6.0
            progress.advance(min(4, 23 - progress.done))
    # every batch crosses a tenth of 23 (one that crosses two logs once)
    assert caplog.messages == [
        "windows 4/23 (17%), 6.0 s elapsed, ~28.5 s left", "windows 8/23 (34%), 12.0 s elapsed, ~22.5 s left",
        "windows 12/23 (52%), 18.0 s elapsed, ~16.5 s left", "windows 16/23 (69%), 24.0 s elapsed, ~10.5 s left",
        "windows 20/23 (86%), 30.0 s elapsed, ~4.5 s left", "windows 23/23 (100%), 36.0 s elapsed"]


def test_progress_of_a_quick_loop_logs_its_end_only(caplog):
    clock, log = Clock(), logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        progress = Progress(log, "records", 1000, clock=clock)
        for _ in range(1000):
            clock.now += 0.001
            progress.advance()
    assert caplog.messages == ["records 1000/1000 (100%), 1.0 s elapsed"]


def test_progress_lines_keep_min_interval_and_a_heartbeat(caplog):
    clock, log = Clock(), logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        progress = Progress(log, "records", 1000, clock=clock)
        for _ in range(1000):  # a tenth every 6.25 s (binary fractions: no rounding in the sums)
            clock.now += 0.0625
            progress.advance()
        assert [m.split()[1] for m in caplog.messages] == [f"{k}/1000" for k in range(100, 1001, 100)]
        caplog.clear()
        slow = Progress(log, "blocks", 100, eta=False, clock=clock)
        for k in range(3):  # a slow item: no milestone yet, but the heartbeat is due
            clock.now += 61 if k == 1 else 1
            slow.advance(detail=f"block {k}")
        steps = Progress(log, "steps", 2, lines=2, min_interval_s=0, eta=False, clock=clock)
        steps.advance(detail="exported")
    assert caplog.messages == ["blocks 2/100 (2%), 1 min 02 s elapsed: block 1",
                               "steps 1/2 (50%), 0.0 s elapsed: exported"]


def test_duration():
    assert [duration(s) for s in (4.24, 185, 3725)] == ["4.2 s", "3 min 05 s", "1 h 02 min"]


# -- real stages ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A prepared data dir and a debug model with its tokenizer: what evaluate, predict and
    quantize read."""
    root = tmp_path_factory.mktemp("stage_logs")
    prepare.run(root / "data", DATA)
    index = read_index(root / "data")
    config = config_for_flavour("debug", vocab_size=index["vocab_size"], bos_token_id=1, eos_token_id=2,
                                pad_token_id=0)
    with atomic_dir(root / "model") as tmp:
        save_pretrained(build_model(config, seed=0), tmp, tokenizer_dir=root / "data" / "tokenizer")
    return root


def _matching(messages, pattern):
    return [m for m in messages if re.fullmatch(pattern, m)]


def test_prepare_log(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        prepare.run(tmp_path / "data", DATA)
    assert caplog.messages[0] == (
        "prepare: reads builtin:pydoc (corpus), builtin:attributes (SFT records); writes "
        f"{tmp_path / 'data'} (tokenizer, train/validation tokens, sft/train.json, sft/dev.json, preference/*.json)")
    texts = _matching(caplog.messages, rf"tokenizer training texts read \d+/(\d+) \(\d+%\), {TIME} elapsed.*")
    assert 1 <= len(texts) <= 10 and re.match(r"tokenizer training texts read (\d+)/\1 \(100%\)", texts[-1])
    assert _matching(caplog.messages, rf"documents tokenized (\d+)/\1 \(100%\), {TIME} elapsed")


def test_evaluate_log(chain, tmp_path, caplog):
    out = tmp_path / "eval.json"
    with caplog.at_level(logging.INFO):
        evaluate.run(chain / "model", chain / "data", out, "debug", EVALUATE)
    assert caplog.messages[0] == (f"evaluate: reads {chain / 'model'} (model), {chain / 'data'} (validation and "
                                  f"train tokens, sft/dev.json, preference/dev.json); writes {out} (metrics)")
    for what, n in (("perplexity windows", 5), ("dev answer perplexity examples", 6),
                    ("generation on dev examples", 6)):
        lines = _matching(caplog.messages, rf"{what} \d+/{n} \(\d+%\), {TIME} elapsed(, ~{TIME} left)?")
        assert lines and lines[-1].startswith(f"{what} {n}/{n} (100%)"), (what, caplog.messages)
    speed = _matching(caplog.messages, rf"speed measurements \d/3 \(\d+%\), {TIME} elapsed: .* tokens/s")
    assert [s.split(":")[1].strip() for s in speed] == ["prefill, batch 1 x 8 tokens", "prefill, batch 2 x 8 tokens",
                                                        "decode, batch 1, 3 new tokens"]


def test_predict_log(chain, tmp_path, caplog):
    out = tmp_path / "pred.jsonl"
    with caplog.at_level(logging.INFO):
        predict.run(chain / "model", chain / "data" / "sft" / "dev.json", out,
                    predict.PredictSettings(batch_size=3, max_new_tokens=2))
    assert caplog.messages[0] == (f"predict: reads {chain / 'model'} (model), {chain / 'data' / 'sft' / 'dev.json'} "
                                  f"(records); writes {out} (predictions), {tmp_path / 'pred.summary.json'} (summary)")
    batches = _matching(caplog.messages, rf"predicted records \d/8 \(\d+%\), {TIME} elapsed.*: \d of 3 batches")
    counts = [b.split()[2] for b in batches]  # the batches end at 3, 6, 8; a quick run logs the last only
    assert counts[-1] == "8/8" and set(counts) <= {"3/8", "6/8", "8/8"}


def test_quantize_log_file_as_snakemake_writes_it(chain, tmp_path):
    """The command line, its output redirected to a file as the rule's shell does (`> {log} 2>&1`)."""
    out, log = tmp_path / "wint8", tmp_path / "quantize_wint8.log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "stages.quantize", "--source", str(chain / "model"),
                               "--out", str(out), "--variant", "wint8"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} __main__ INFO quantize: reads (\S+) \(float model\); "
                        r"writes (\S+) \(variant wint8, method rtn\)", lines[0]), lines[0]
    assert lines[0].endswith(f"reads {chain / 'model'} (float model); writes {out} (variant wint8, method rtn)")
    layers = _matching([line.split(" INFO ", 1)[-1] for line in lines], r"RTN 8-bit layers \d+/(\d+) .*")
    assert 1 <= len(layers) <= 10 and re.match(r"RTN 8-bit layers (\d+)/\1 \(100%\)", layers[-1]), layers
    assert "\r" not in text


def test_the_onnx_libraries_per_node_lines_stay_out_of_a_stage_log():
    """A stage's command line (in its own process, as a rule runs it) logs ONNX libraries' warnings,
    not their INFO line per graph node (3,300 of them in SmolLM2-135M's export log before)."""
    code = ("import logging; from stages.stage_logs import configure_logging; configure_logging(); "
            "from onnxruntime.quantization import matmul_nbits_quantizer as q; "
            "q.logger.info('start to quantize node_linear_0'); q.logger.warning('a real warning'); "
            "logging.getLogger('onnx_ir.passes.common.initializer_deduplication').info('Replaced initializer'); "
            "logging.getLogger('stages.export').info('our own line')")
    err = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stderr
    assert "a real warning" in err and "our own line" in err
    assert "start to quantize" not in err and "Replaced initializer" not in err
