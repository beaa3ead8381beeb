"""stages/serve.py through the official `openai` client (and raw HTTP for what a client library
hides): a greedy answer is stages.predict's answer for the same record, on a full model saved by
transformers, LoRA and prefix-tuning adapters on it and its wint4 quantization on low-bit
kernels; streamed deltas join to the same text; max_tokens, stop strings, usage, system messages,
the completions endpoint, seeded sampling; each error status; two concurrent streams; requests
joining a running stream (continuous batching); a full queue; a client that leaves."""

from __future__ import annotations

import http.client
import json
import os
import resource
import threading
from pathlib import Path

import pytest
import torch

from checkpoint_fixtures import chat_tokenizer, save_checkpoint
from stages import predict, serve
from stages.serving.http_server import POLL_S
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer
from stages.checkpoint.meta import write_meta

openai = pytest.importorskip("openai")

MAX_LENGTH = 96  # prompt + answer, for the server and the predictor alike
RECORDS = [{"src": "what colour is the apple?"}, {"src": "one two three four"}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_tokenizer_dir):
    """{name: dir}: a Llama saved by transformers with a ChatML tokenizer (eos <|im_end|>), a LoRA
    adapter on it (B != 0), a prefix-tuning adapter and its wint4 quantization."""
    import peft
    from transformers import AutoModelForCausalLM

    from stages import quantize

    root = tmp_path_factory.mktemp("serve")
    full = save_checkpoint(root / "full", chat_tokenizer(tiny_tokenizer_dir), seed=3)
    torch.manual_seed(0)
    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"))
    with atomic_dir(root / "lora") as d:
        lora.save_pretrained(d)
        copy_tokenizer(full, d)
        write_meta(d, stage="finetune", config={}, parent=full, seed=0, metrics={})
    prefix = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32),
                                 peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    with atomic_dir(root / "prefix") as d:
        prefix.save_pretrained(d)
        copy_tokenizer(full, d)
        write_meta(d, stage="finetune", config={}, parent=full, seed=0, metrics={})
    quantize.run(full, root / "wint4", "wint4", 32)
    return {"full": full, "lora": root / "lora", "prefix": root / "prefix", "wint4": root / "wint4"}


class Running:
    """A server on a free loopback port, serving in a thread."""

    def __init__(self, model_dir: Path, **options):
        self.server = serve.start(model_dir, **options)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = self.server.url
        self.model = self.server.served.model_id

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             timeout=120, **kwargs)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
        host, port = self.server.server_address[:2]
        conn = http.client.HTTPConnection(host, port, timeout=60)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        status, payload = response.status, json.loads(response.read() or b"{}")
        conn.close()
        return status, payload

    def close(self):
        serve.stop(self.server)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def full_server(model_dirs):
    running = Running(model_dirs["full"], max_length=MAX_LENGTH)
    yield running
    running.close()


def _predicted(model_dir: Path, tmp_path: Path) -> list[dict]:
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    settings = predict.PredictSettings(batch_size=1, src_length=MAX_LENGTH - 1, max_length=MAX_LENGTH)
    predict.run(model_dir, records, tmp_path / "out.jsonl", settings)
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def _chat(client, model, text, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          temperature=0, **kwargs)


@pytest.mark.parametrize("name", ["full", "lora", "prefix", "wint4"])
def test_greedy_chat_is_the_predictors_answer_streamed_or_not(model_dirs, name, tmp_path):
    expected = _predicted(model_dirs[name], tmp_path)
    running = Running(model_dirs[name], max_length=MAX_LENGTH)
    try:
        assert running.server.server_address[0] == "127.0.0.1"
        client = running.client()
        for record, want in zip(RECORDS, expected):
            answer = _chat(client, running.model, record["src"])
            assert answer.choices[0].message.content == want["output"], name
            assert answer.usage.prompt_tokens == want["prompt_tokens"]
            assert answer.usage.completion_tokens == want["output_tokens"]
            assert answer.choices[0].finish_reason in ("stop", "length")
            chunks = list(_chat(client, running.model, record["src"], stream=True,
                                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == want["output"]
            assert chunks[-1].usage.completion_tokens == want["output_tokens"]
    finally:
        running.close()
    kinds = {"full": "hf", "lora": "adapter", "prefix": "adapter", "wint4": "quantized"}
    assert running.server.served.kind == kinds[name]


@pytest.mark.slow  # torch.compile: two graphs, about 20 s each on 2 cores
def test_a_compiled_server_answers_as_the_predictor(model_dirs, tmp_path):
    """--compile: the decode steps are compiled before the server listens; greedy answers are the
    predictor's here too, alone and as two concurrent streams (one batch of rows)."""
    expected = _predicted(model_dirs["full"], tmp_path)
    running = Running(model_dirs["full"], max_length=MAX_LENGTH, compile=True)
    try:
        assert running.server.models.route(running.model).scheduler.running_batch.compiled
        client = running.client()
        for record, want in zip(RECORDS, expected):
            assert _chat(client, running.model, record["src"]).choices[0].message.content == want["output"]
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            answers[i] = _chat(client, running.model, RECORDS[i]["src"]).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(RECORDS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [answers.get(i) for i in range(len(RECORDS))] == [w["output"] for w in expected]
    finally:
        running.close()


def test_models_load_in_a_thread_that_ends():
    """stages.serve loads its models in a thread of their own (its OpenMP threads end with it); its
    result and its errors come back to the caller."""
    name = serve.in_a_passing_thread(lambda: threading.current_thread().name)
    assert name.startswith("load") and not any(t.name == name for t in threading.enumerate())  # it ended
    with pytest.raises(ValueError, match="bad"):
        serve.in_a_passing_thread(int, "bad")


def test_the_model_list_and_an_unknown_model(full_server):
    client = full_server.client()
    assert [m.id for m in client.models.list().data] == ["full"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        _chat(client, "gpt-4", "hello")


def test_max_tokens_ends_with_length_and_usage_counts_the_tokenizers_tokens(full_server):
    tokenizer = full_server.server.served.tokenizer
    messages = [{"role": "system", "content": "you answer briefly"}, {"role": "user", "content": "one two"},
                {"role": "assistant", "content": "three"}, {"role": "user", "content": "four five"}]
    answer = full_server.client().chat.completions.create(model="full", messages=messages, max_tokens=3,
                                                          temperature=0)
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer.usage.prompt_tokens == len(tokenizer(expected_prompt, add_special_tokens=False)["input_ids"])
    if answer.choices[0].finish_reason == "length":  # a random model may say eos within 3 tokens
        assert answer.usage.completion_tokens == 3
    one = full_server.client().chat.completions.create(model="full", messages=messages, max_tokens=1,
                                                       temperature=0)
    assert one.usage.completion_tokens == 1


def test_stop_strings_stop_and_are_not_returned(full_server):
    client = full_server.client()
    free = client.completions.create(model="full", prompt="the colour of", temperature=0, max_tokens=20)
    text = free.choices[0].text
    assert len(text) >= 4, text
    stop = text[2:4]  # a string the greedy answer is known to contain
    cut = client.completions.create(model="full", prompt="the colour of", temperature=0, max_tokens=20, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="full", prompt="the colour of", temperature=0, max_tokens=20,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_the_same_seed_samples_the_same_answer(full_server):
    client = full_server.client()
    sampled = [client.chat.completions.create(model="full", messages=[{"role": "user", "content": "one two"}],
                                              max_tokens=12, temperature=1.0, seed=s).choices[0].message.content
               for s in (7, 7)]
    assert sampled[0] == sampled[1]
    greedy = _chat(client, "full", "one two", max_tokens=12).choices[0].message.content
    assert sampled[0] != greedy  # it did sample (the random model's distribution is nearly flat)


def test_each_bad_request_gets_its_status(full_server):
    client = full_server.client()
    assert full_server.post("/v1/chat/completions", b"{not json")[0] == 400
    status, body = full_server.post("/v1/chat/completions", {"model": "full", "messages": "hi"})
    assert status == 422 and body["error"]["param"] == "messages"
    status, body = full_server.post("/v1/chat/completions", {"model": "full", "temperature": "hot",
                                                             "messages": [{"role": "user", "content": "x"}]})
    assert status == 422 and "temperature" in body["error"]["message"]
    status, body = full_server.post("/v1/chat/completions", {"model": "full", "n": 2,
                                                             "messages": [{"role": "user", "content": "x"}]})
    assert status == 422 and body["error"]["param"] == "n"
    assert full_server.post("/v1/nothing", {})[0] == 404
    with pytest.raises(openai.BadRequestError, match="context is 96 tokens"):
        _chat(client, "full", " ".join(["one"] * 200))
    with pytest.raises(openai.BadRequestError, match="max_tokens=200"):
        _chat(client, "full", "one", max_tokens=200)
    assert _chat(client, "full", "still here", max_tokens=2).choices[0].message.content is not None


def test_two_concurrent_streams_both_complete(full_server):
    client = full_server.client()
    results = {}

    def run(i):
        stream = _chat(client, "full", ["one two", "the colour of the apple"][i], stream=True, max_tokens=16)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    alone = [_chat(client, "full", t, max_tokens=16).choices[0].message.content
             for t in ["one two", "the colour of the apple"]]
    assert results == {0: alone[0], 1: alone[1]}


def test_requests_sent_during_a_stream_join_its_batch_and_answer_as_alone(model_dirs):
    """Continuous batching through HTTP: a greedy and a seeded sampling request sent while a
    stream generates join its running batch at a step boundary (decode steps of three rows) and
    answer exactly what each answers alone; the stream's text is unchanged."""
    import time

    running = Running(model_dirs["full"], max_length=MAX_LENGTH, max_batch_size=4)
    scheduler, model = running.server.scheduler, running.server.served.model
    client = running.client()
    requests = {"stream": {"text": "one two three", "max_tokens": 40},
                "greedy": {"text": "the colour of the apple", "max_tokens": 12},
                "sampled": {"text": "one two", "max_tokens": 12, "temperature": 1.0, "seed": 7}}

    def ask(name, stream=False):
        r = dict(requests[name])
        answer = client.chat.completions.create(model=running.model, stream=stream, max_tokens=r["max_tokens"],
                                                temperature=r.get("temperature", 0), seed=r.get("seed"),
                                                messages=[{"role": "user", "content": r["text"]}])
        return "".join(c.choices[0].delta.content or "" for c in answer) if stream else answer

    shapes, holding, hook = [], threading.Event(), None

    def hold_the_third_forward(module, args, kwargs):  # the stream's second decode step waits for the others
        shapes.append(tuple(kwargs["input_ids"].shape))
        if len(shapes) == 3:
            holding.set()
            for _ in range(1200):
                if scheduler.admitted == 3:
                    return
                time.sleep(0.05)

    try:
        alone = {name: ask(name) for name in requests}
        assert alone["stream"].usage.completion_tokens > 10  # still generating when the others arrive
        hook = model.register_forward_pre_hook(hold_the_third_forward, with_kwargs=True)
        results = {}
        threads = {"stream": threading.Thread(target=lambda: results.update(stream=ask("stream", stream=True)))}
        threads["stream"].start()
        assert holding.wait(60)
        threads["greedy"] = threading.Thread(target=lambda: results.update(greedy=ask("greedy")))
        threads["sampled"] = threading.Thread(target=lambda: results.update(sampled=ask("sampled", stream=True)))
        for name in ("greedy", "sampled"):
            threads[name].start()
        for t in threads.values():
            t.join(timeout=120)
        assert results["stream"] == alone["stream"].choices[0].message.content
        assert results["greedy"].choices[0].message.content == alone["greedy"].choices[0].message.content
        assert results["sampled"] == alone["sampled"].choices[0].message.content
        assert (3, 1) in shapes  # a decode step of all three: they joined the running stream
        assert scheduler.admitted == 0 and _health(running)["waiting_or_running"] == 0
    finally:
        if hook is not None:
            hook.remove()
        running.close()


class Gate:
    """Holds every forward pass of `model` until opened (a forward pre-hook), so a test controls
    what is running and what waits."""

    def __init__(self, model):
        self.event = threading.Event()
        self.hook = model.register_forward_pre_hook(self._wait)

    def _wait(self, module, args):
        self.event.wait(60)  # returns None: the forward's inputs stay as they are

    def open(self):
        self.event.set()

    def remove(self):
        self.event.set()
        self.hook.remove()


def _health(running) -> dict:
    conn = http.client.HTTPConnection(*running.server.server_address[:2], timeout=30)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body


def test_a_full_queue_answers_503_and_a_client_that_leaves_is_cancelled(model_dirs):
    running = Running(model_dirs["full"], max_length=MAX_LENGTH, max_queue=1, max_batch_size=1)
    gate = Gate(running.server.served.model)  # the first request holds the only place
    try:
        client = running.client()
        stream = _chat(client, running.model, "one", stream=True, max_tokens=30)
        next(iter(stream))  # the role chunk: the request is admitted (its prefill waits at the gate)
        with pytest.raises(openai.InternalServerError) as error:
            _chat(client, running.model, "two", max_tokens=2)
        assert error.value.status_code == 503 and "--max-queue" in str(error.value)
        stream.close()  # the client leaves; the server notices while it waits and cancels the row
        scheduler = running.server.scheduler
        assert _health(running)["waiting_or_running"] == 1
        for _ in range(100):
            if scheduler.current and scheduler.current[0].cancelled.is_set():
                break
            threading.Event().wait(0.1)
        else:
            pytest.fail("the server did not notice that its client left")
        gate.open()
        for _ in range(100):
            if scheduler.finished["cancelled"] == 1:
                break
            threading.Event().wait(0.1)
        assert dict(scheduler.finished) == {"cancelled": 1} and _health(running)["finished"] == {"cancelled": 1}
        assert _chat(client, running.model, "two", max_tokens=2).usage.completion_tokens <= 2  # free again
    finally:
        gate.remove()
        running.close()


def test_an_api_key_is_required_when_set(model_dirs):
    running = Running(model_dirs["full"], max_length=MAX_LENGTH, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").models.list()
        assert running.client(api_key="s3cret").models.list().data[0].id == "full"
        assert running.post("/v1/completions", {"model": "full", "prompt": "x"})[0] == 401
    finally:
        running.close()


def test_the_command_prints_its_loopback_address_and_warns_for_another_host(model_dirs):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "stages.serve", "--model", str(model_dirs["full"]),
                             "--max-length", str(MAX_LENGTH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving full at http://127.0.0.1:"), line
        url = line.split()[3]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "full"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("::1") and not serve.is_loopback("0.0.0.0")


@pytest.mark.parametrize("page", ["README.md", "docs/serving.md"])
def test_the_calls_the_docs_print_work_as_printed(model_dirs, page):
    """The page's Python snippet (the openai client) and curl commands, run as printed against a
    live server (PORT replaced by its port; the model named lora-merged as the docs' example is)."""
    import re
    import shlex
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[2] / page).read_text()
    snippets = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "OpenAI(base_url" in b]
    curls = [c.replace("\\\n", " ") for c in re.findall(r"^(curl .*?)(?=\ncurl |\n```)", text, re.S | re.M)]
    assert len(snippets) == 1 and curls
    running = Running(model_dirs["full"], served_model_name="lora-merged", max_length=256)
    try:
        port = str(running.server.server_address[1])
        proc = subprocess.run([sys.executable, "-c", snippets[0].replace("PORT", port)], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout, proc.stderr[-3000:]
        for curl in curls:
            out = subprocess.run(shlex.split(curl.replace("PORT", port)), capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            if '"stream": true' in curl:
                events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]" and "error" not in json.loads(events[0][6:]), out.stdout
            else:
                assert json.loads(out.stdout).get("object") == "chat.completion", out.stdout
    finally:
        running.close()


def test_a_request_cancelled_while_waiting_never_runs(full_server):
    from stages.serving.scheduler import Completion, Scheduler
    from stages.serving.text_stream import TextStream

    served = full_server.server.served
    gate = Gate(served.model)
    scheduler = Scheduler(served.model, eos_token_id=served.eos_token_id, pad_token_id=served.pad_token_id,
                          max_batch_size=1, max_queue=4)
    try:
        def completion():
            return Completion(prompt=[5, 6, 7], max_tokens=4, stream=TextStream(served.tokenizer, (), None))

        running, left, after = (scheduler.submit(completion()) for _ in range(3))
        left.cancelled.set()  # its client went away while it waited
        gate.open()
        for c in (running, after):
            while c.events.get(timeout=60)[0] != "done":
                pass
        assert left.events.get(timeout=5) == ("done", "cancelled") and left.stream.tokens == []
        for _ in range(100):  # the worker counts a batch's requests once it has answered them
            if scheduler.admitted == 0:
                break
            threading.Event().wait(0.05)
        assert scheduler.batches == 2 and dict(scheduler.finished) == {"length": 2, "cancelled": 1}
    finally:
        gate.remove()
        scheduler.close()


def test_a_model_inside_an_experiment_takes_the_experiments_prompt_format(model_dirs, tmp_path):
    """results/<exp>/<variant> is prompted as its experiment's data was rendered (index.json's
    sft_format), not by whether the tokenizer has a chat template; elsewhere by the template."""
    import shutil

    from stages.data.tokenizer import tokenizer_fingerprint
    from stages.serving.served_model import load_served_model

    outside = load_served_model(model_dirs["full"])
    assert outside.chat  # the ChatML tokenizer's template
    exp = tmp_path / "exp"
    shutil.copytree(model_dirs["full"], exp / "sft")
    (exp / "data").mkdir()
    index = {"sft_format": "plain", "tokenizer_fingerprint": tokenizer_fingerprint(outside.tokenizer)}
    (exp / "data" / "index.json").write_text(json.dumps(index))
    assert not load_served_model(exp / "sft").chat
    assert load_served_model(exp / "sft", chat_template="true").chat


def test_a_failure_before_generation_is_answered_with_500_not_a_dropped_connection(full_server, monkeypatch):
    from stages.data.sft import SftDataError

    def broken_template(request):
        raise SftDataError("the tokenizer's chat template renders a conversation prefix that is not a prefix")

    monkeypatch.setattr(full_server.server.served, "prompt_ids", broken_template)
    status, body = full_server.post("/v1/chat/completions", {"model": "full",
                                                             "messages": [{"role": "user", "content": "x"}]})
    assert status == 500 and "SftDataError" in body["error"]["message"]
    monkeypatch.undo()
    assert _chat(full_server.client(), "full", "one", max_tokens=2).usage.completion_tokens <= 2


def test_a_connection_numbered_above_1024_waits_for_its_answer(full_server):
    """A long-lived process (a pytest worker, a server that ran for days) hands out socket numbers
    above select()'s FD_SETSIZE (1024); the check for a client that left must still work there, or
    the server drops the connection without an answer while the request waits for its tokens."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files ({hard}) keeps sockets below 1024")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the next socket is numbered above 1024
    gate = Gate(full_server.server.served.model)  # the request waits > POLL_S: the server checks its client
    try:
        threading.Timer(4 * POLL_S, gate.open).start()
        answer = _chat(full_server.client(), "full", "one", max_tokens=2)
        assert answer.usage.completion_tokens <= 2 and answer.choices[0].finish_reason in ("stop", "length")
    finally:
        gate.remove()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
