"""Several models behind one server (stages/serve.py --experiment / --model several times), through
the official `openai` client: an experiment's variants are found and named as the report names them,
/v1/models lists them, a request's `model` picks its variant and an unknown one is a 404 naming the
ids; the LoRA and prefix adapters and their served base hold one copy of the base's weights, and
each variant's greedy answer is still stages.predict's for it, alone or beside another variant's
stream; /health counts per model; the command line's naming and its duplicate errors."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

from checkpoint_fixtures import chat_tokenizer, save_adapter, save_checkpoint
from stages import predict, serve
from stages.errors import InputError
from stages.serving.shared_bases import weight_bytes
from stages.serving.variants import experiment_variants

openai = pytest.importorskip("openai")

MAX_LENGTH = 96  # prompt + answer, for the server and the predictor alike
RECORDS = [{"src": "what colour is the apple?"}, {"src": "one two three four"}]
VARIANTS = ["pretrain", "sft", "lora", "prefix", "wint4"]  # the report's order, quantized variants last


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_tokenizer_dir):
    """results/<exp> as the chain lays it out, tiny: pretrain and sft (full models of their own
    weights), LoRA (B != 0) and prefix adapters of pretrain, quant/wint4 of pretrain; beside them
    directories that are no variant (an ONNX export, training checkpoints, evaluations)."""
    import peft

    from stages import quantize

    exp = tmp_path_factory.mktemp("results") / "exp"
    tokenizer = chat_tokenizer(tiny_tokenizer_dir)
    pretrain = save_checkpoint(exp / "pretrain", tokenizer, seed=3)
    save_checkpoint(exp / "sft", tokenizer, seed=4)
    save_adapter(pretrain, exp / "lora", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False, task_type="CAUSAL_LM"))
    save_adapter(pretrain, exp / "prefix", peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    quantize.run(pretrain, exp / "quant" / "wint4", "wint4", 32)
    (exp / "export").mkdir()
    (exp / "export" / "model.onnx").write_bytes(b"")  # an ONNX export is not served
    (exp / "checkpoints" / "sft").mkdir(parents=True)
    (exp / "eval").mkdir()
    return exp


class Running:
    """A server of several models on a free loopback port, serving in a thread."""

    def __init__(self, specs, **options):
        self.server = serve.start_models(specs, **options)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self):
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(*self.server.server_address[:2], timeout=30)
        conn.request("GET", path)
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body

    def close(self):
        serve.stop(self.server)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def running(experiment):
    server = Running(experiment_variants(experiment), max_length=MAX_LENGTH)
    yield server
    server.close()


def _predicted(model_dir: Path, tmp_path: Path) -> list[str]:
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    settings = predict.PredictSettings(batch_size=1, src_length=MAX_LENGTH - 1, max_length=MAX_LENGTH)
    predict.run(model_dir, records, tmp_path / f"{model_dir.name}.jsonl", settings)
    return [json.loads(line)["output"] for line in (tmp_path / f"{model_dir.name}.jsonl").read_text().splitlines()]


def _chat(client, model, text, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          temperature=0, **kwargs)


def test_an_experiments_variants_are_listed_in_the_reports_order(experiment, running):
    specs = experiment_variants(experiment)
    assert [s.model_id for s in specs] == VARIANTS
    assert specs[-1].model_dir == experiment / "quant" / "wint4"
    assert [m.id for m in running.client().models.list().data] == VARIANTS
    kinds = {i: m["kind"] for i, m in running.get("/health")["models"].items()}
    assert kinds == {"pretrain": "hf", "sft": "hf", "lora": "adapter", "prefix": "adapter", "wint4": "quantized"}


def test_each_variant_answers_as_the_predictor_answers_for_it(experiment, running, tmp_path):
    """Greedy, streamed and not: the same text stages.predict writes for that variant's directory
    (tests/unit/test_serve.py proves the one-model server gives the predictor's answer too)."""
    client = running.client()
    answers = {}
    for name in VARIANTS:
        model_dir = experiment / "quant" / name if name == "wint4" else experiment / name
        expected = _predicted(model_dir, tmp_path)
        for record, want in zip(RECORDS, expected):
            answer = _chat(client, name, record["src"])
            assert answer.model == name and answer.choices[0].message.content == want, name
            chunks = _chat(client, name, record["src"], stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert streamed == want, name
        answers[name] = expected
    assert len({tuple(a) for a in answers.values()}) > 1  # the variants do differ: routing is seen


def test_two_variants_streaming_side_by_side_each_give_their_own_answer(running):
    """The chat page's compare mode: one prompt to two models at once, each in its own scheduler
    thread; LoRA runs on the very weights pretrain is answering with."""
    client = running.client()
    alone = {m: _chat(client, m, "one two", max_tokens=16).choices[0].message.content for m in ("pretrain", "lora")}
    together = {}

    def run(model):
        stream = _chat(client, model, "one two", stream=True, max_tokens=16)
        together[model] = "".join(c.choices[0].delta.content or "" for c in stream)

    threads = [threading.Thread(target=run, args=(m,)) for m in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone and alone["pretrain"] != alone["lora"]


def test_adapters_and_their_served_base_hold_one_copy_of_its_weights(running):
    models = {r.served.model_id: r.served.model for r in running.server.models}

    def weight(name, suffix):
        (found,) = [p for n, p in models[name].named_parameters() if n.endswith(suffix)]
        return found

    for suffix in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.base_layer.weight",
                   "embed_tokens.weight", "layers.1.mlp.down_proj.weight"):
        names = [n for n in ("pretrain", "lora", "prefix") if any(k.endswith(suffix) for k, _ in
                                                                  models[n].named_parameters())]
        assert len({weight(n, suffix).data_ptr() for n in names}) == 1, (suffix, names)
    base = weight("pretrain", "embed_tokens.weight")
    assert weight("sft", "embed_tokens.weight").data_ptr() != base.data_ptr()
    assert not any("lora_" in n for n, _ in models["pretrain"].named_parameters())  # LoRA went into its own tree
    base_bytes = sum(t.untyped_storage().nbytes() for t in (*models["pretrain"].parameters(),
                                                              *models["pretrain"].buffers()))
    separate, together = weight_bytes(list(models.values()))
    assert separate - together == 2 * base_bytes  # LoRA and prefix hold none of the base's weights


def test_an_unknown_model_is_a_404_that_names_the_served_ids(running):
    with pytest.raises(openai.NotFoundError, match="'pretrain', 'sft', 'lora', 'prefix', 'wint4'") as error:
        _chat(running.client(), "lora-merged", "hello")
    assert error.value.status_code == 404 and "not served here" in str(error.value)


def test_health_counts_each_models_requests(running):
    before = running.get("/health")
    _chat(running.client(), "prefix", "one", max_tokens=2)
    after = running.get("/health")
    def done(health, model):
        return sum(health["models"][model]["finished"].values())

    assert done(after, "prefix") == done(before, "prefix") + 1
    assert after["models"]["sft"] == before["models"]["sft"]
    assert sum(after["finished"].values()) == sum(before["finished"].values()) + 1
    assert after["status"] == "ok" and after["waiting_or_running"] == 0


def _specs(*argv):
    return serve.model_specs(serve.build_parser().parse_args(list(argv)))


def test_the_command_line_names_each_model_and_refuses_two_with_one_id(experiment, tmp_path):
    sft, other = experiment / "sft", tmp_path / "elsewhere" / "sft"
    assert [s.model_id for s in _specs("--model", str(sft), "--model", str(experiment / "lora"))] == ["sft", "lora"]
    assert [s.model_id for s in _specs("--model", str(sft), "--served-model-name", "mine")] == ["mine"]
    with pytest.raises(InputError, match=f"two models would be served as 'sft': {sft} and {other}"):
        _specs("--model", str(sft), "--model", str(other))
    named = _specs("--model", str(sft), "--model", str(other), "--served-model-name", "a", "--served-model-name", "b")
    assert [(s.model_id, s.model_dir) for s in named] == [("a", sft), ("b", other)]
    with pytest.raises(InputError, match="given 1 times for 2 --model"):
        _specs("--model", str(sft), "--model", str(other), "--served-model-name", "a")
    with pytest.raises(InputError, match="two models would be served as 'sft'"):
        _specs("--experiment", str(experiment), "--model", str(sft))
    assert [s.model_id for s in _specs("--experiment", str(experiment), "--model", str(sft), "--served-model-name",
                                       "sft-again")] == [*VARIANTS, "sft-again"]
    with pytest.raises(InputError, match="--model DIR .* or --experiment"):
        _specs()
    with pytest.raises(InputError, match="holds no model directory"):
        experiment_variants(tmp_path)


def test_a_one_model_server_keeps_served_and_scheduler_and_one_of_several_refuses_to_pick(experiment):
    """What tests and bench/serve.py read of a one-model server; a server of several names its ids instead."""
    one = Running(experiment_variants(experiment)[1:2], max_length=MAX_LENGTH)
    try:
        assert one.server.served.model_id == "sft" and one.server.scheduler is next(iter(one.server.models)).scheduler
        assert one.get("/health")["model"] == "sft"  # /health as before several models
    finally:
        one.close()
    two = Running(experiment_variants(experiment)[:2], max_length=MAX_LENGTH)
    try:
        with pytest.raises(ValueError, match="answers as 2 models"):
            two.server.served  # noqa: B018 (the property raises)
        assert "model" not in two.get("/health")
    finally:
        two.close()


def test_the_command_serves_an_experiment_and_prints_every_id(experiment):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "stages.serve", "--experiment", str(experiment), "--max-length",
                             str(MAX_LENGTH)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        # GPTQModel, imported with the quantized loader, prints its banner on stdout first
        line = next((line for line in proc.stdout if line.startswith("serving ")), "")
        assert line.startswith(f"serving {', '.join(VARIANTS)} at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == VARIANTS
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    assert code == 0


@pytest.mark.slow
def test_the_memory_bench_measures_one_server_against_one_per_variant(experiment, tmp_path):
    """bench/serve_memory.py on the tiny experiment (six server processes, one after the other):
    the report's shape, and the weights the one server logs as held against loaded one by one."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "serve_memory.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "serve_memory.py"), "--experiment", str(experiment),
                           "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["variants"] == VARIANTS and set(result["one_server_per_variant"]) == set(VARIANTS)
    assert result["one_server"]["weights_held_mb"] < result["one_server"]["weights_one_by_one_mb"]
    assert result["one_server"]["VmRSS"] < result["sum_of_servers"]["VmRSS"]
