"""stages/inference/running_batch.py and the scheduler's continuous batching
(stages/serving/scheduler.py): rows that join a running batch at step boundaries, with different
prompt lengths, budgets, eos and stop strings, get exactly the tokens `DecodeEngine.generate`
gives each alone (today's answer for a lone request), on every family the engine runs, LoRA and
prefix-tuning adapters and wint8 / wint4 weights; a removed row leaves the others unchanged; a
seeded sampling row draws the same tokens alone and in a mixed batch; the cache grows past its
reserve and is trimmed when the longest row leaves. Then the scheduler: a cancelled request leaves
its batch, a failed step answers its rows with an error and the next request is served. The server
through HTTP: tests/unit/test_serve.py (a request joining a running stream)."""

from __future__ import annotations

import threading

import peft
import pytest
import torch
from checkpoint_fixtures import save_checkpoint, variant_dirs
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from stages.inference import running_batch
from stages.inference.engine import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    DecodeEngine,
    Sampling,
)
from stages.inference.loading import load_variant
from stages.inference.running_batch import Row, RunningBatch, unsupported
from stages.serving.scheduler import Completion, Scheduler
from stages.serving.scheduler import Sampling as RequestSampling
from stages.serving.text_stream import TextStream

NEW_TOKENS = 10
PAD = 0
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "glm", "glm4", "gpt2")  # test_decode_engine's
KINDS = [(family, "full") for family in FAMILIES] + [("llama", kind) for kind in ("lora", "prefix", "wint8", "wint4")]


def _prompts(vocab: int = 300) -> list[list[int]]:
    """Four prompts of different lengths (ids neither pad nor eos), so the batch is left-padded."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 11, 2, 8)]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    """`get(family, kind)` -> directory, built on first use (checkpoint_fixtures.variant_dirs); weights
    15x wider than the default initializer_range (0.02): sharp attention, so that a wrong mask or
    position id changes tokens (at 0.02 attention is near uniform, GPT-2 repeats one token)."""
    return variant_dirs(tmp_path_factory.mktemp("running_batch"), tokenizer, initializer_range=0.3)


def _alone(model, prompts, budget=NEW_TOKENS, eos=None, **kwargs) -> list[list[int]]:
    """Each prompt's tokens from `DecodeEngine.generate` on it alone: a lone request's answer."""
    engine = DecodeEngine(model, eos_token_id=eos, pad_token_id=PAD)
    return [engine.generate([p], budget, **kwargs)[0].tokens for p in prompts]


def _run_out(batch: RunningBatch, sizes: list[int] | None = None) -> None:
    while len(batch):
        if sizes is not None:
            sizes.append(len(batch))
        batch.step()


@pytest.mark.parametrize(("family", "kind"), KINDS)
def test_rows_joining_a_running_batch_get_their_tokens_alone(model_dirs, family, kind):
    model, _, _ = load_variant(model_dirs(family, kind))
    prompts = _prompts()
    expected = _alone(model, prompts)
    batch = RunningBatch(model, eos_token_id=None, pad_token_id=PAD)
    rows = [Row(p, NEW_TOKENS) for p in prompts]
    sizes: list[int] = []
    batch.add(rows[:1])  # the 6-token prompt alone for two steps
    for _ in range(2):
        sizes.append(len(batch))
        batch.step()
    batch.add(rows[1:3])  # a longer and a shorter one join together: every cache is left-padded
    sizes.append(len(batch))
    batch.step()
    batch.add(rows[3:])
    _run_out(batch, sizes)
    assert [r.tokens for r in rows] == expected, f"{family} {kind}"
    assert all(r.finish_reason == FINISH_LENGTH for r in rows)
    assert sizes[:4] == [1, 1, 3, 4] and max(sizes) == 4  # the rows did share steps
    # three prefills, then one step per token of the longest-lived row: fewer forwards than alone
    assert batch.forward_calls == 3 + len(sizes) == 3 + 3 + NEW_TOKENS - 1
    if kind in ("lora", "prefix"):  # the adapter is in the path: the base alone answers otherwise
        base, _, _ = load_variant(model_dirs(family, "full"))
        assert _alone(base, prompts) != expected


def test_budgets_eos_and_stop_strings_end_rows_and_the_others_go_on(model_dirs, tokenizer):
    model, _, _ = load_variant(model_dirs("gpt2", "full"))
    prompts = _prompts()
    free = _alone(model, prompts)
    eos = free[0][3]  # a token row 0 generates at its 4th step: as eos it must end row 0 there
    with_eos = _alone(model, prompts, eos=eos)
    assert with_eos[0] == free[0][:4] and len(with_eos[1]) == NEW_TOKENS
    # text row 1 produces at two of its later tokens, and not before (byte-level pieces repeat)
    stop = next(t for k in range(3, NEW_TOKENS - 1) if (t := tokenizer.decode(with_eos[1][k:k + 2])).strip()
                and t not in tokenizer.decode(with_eos[1][:k + 1]))
    batch = RunningBatch(model, eos_token_id=eos, pad_token_id=PAD, tokenizer=tokenizer)
    rows = [Row(prompts[0], NEW_TOKENS), Row(prompts[1], NEW_TOKENS, stop_strings=[stop]),
            Row(prompts[2], 3), Row(prompts[3], 1)]
    assert batch.add(rows[:3]) == []
    batch.step()
    assert batch.add(rows[3:]) == [rows[3]]  # a budget of one: done at its prefill, never joins
    assert len(batch) == 3
    _run_out(batch)
    end = next(n for n in range(1, NEW_TOKENS + 1) if stop in tokenizer.decode(with_eos[1][:n]))
    assert rows[0].tokens == with_eos[0] and rows[0].finish_reason == FINISH_EOS
    assert rows[1].tokens == with_eos[1][:end] and rows[1].finish_reason == FINISH_STOP
    assert rows[2].tokens == with_eos[2][:3] and rows[2].finish_reason == FINISH_LENGTH
    assert rows[3].tokens == with_eos[3][:1] and rows[3].finish_reason == FINISH_LENGTH


def test_a_removed_row_leaves_and_the_others_are_unchanged(model_dirs):
    model, _, _ = load_variant(model_dirs("llama", "full"))
    prompts = _prompts()
    expected = _alone(model, prompts)
    batch = RunningBatch(model, eos_token_id=None, pad_token_id=PAD)
    rows = [Row(p, NEW_TOKENS) for p in prompts]
    batch.add(rows)
    batch.step()
    batch.step()
    length = batch.length
    batch.remove([rows[1]])  # the longest prompt: the leading positions only it used are trimmed
    assert batch.rows == [rows[0], rows[2], rows[3]] and batch.length < length
    rows[3].on_token = lambda token: True  # e.g. its client went away: it ends at its next token
    batch.step()
    assert batch.rows == [rows[0], rows[2]] and rows[3].finish_reason == FINISH_STOP
    _run_out(batch)
    assert rows[1].tokens == expected[1][:3] and rows[1].finish_reason is None
    assert rows[3].tokens == expected[3][:4]
    assert [rows[0].tokens, rows[2].tokens] == [expected[0], expected[2]]


@pytest.mark.parametrize("kind", ["full", "prefix"])
def test_a_seeded_sampling_row_draws_the_same_alone_and_in_a_mixed_batch(model_dirs, kind):
    model, _, _ = load_variant(model_dirs("llama", kind))
    prompts = _prompts()
    greedy = _alone(model, prompts)
    sampling = [Sampling(temperature=0.8, top_p=0.9, seed=3), Sampling(seed=4)]
    alone = [_alone(model, [prompts[1]], sampling=s)[0] for s in sampling]
    assert alone[0] != greedy[1] and alone[1] != greedy[1]  # they do sample (a random model is nearly flat)
    batch = RunningBatch(model, eos_token_id=None, pad_token_id=PAD)
    rows = [Row(prompts[0], NEW_TOKENS), Row(prompts[1], NEW_TOKENS, sampling=sampling[0]),
            Row(prompts[2], NEW_TOKENS), Row(prompts[1], NEW_TOKENS, sampling=sampling[1])]
    batch.add(rows[:2])
    batch.step()
    batch.add(rows[2:])
    _run_out(batch)
    assert [rows[1].tokens, rows[3].tokens] == alone
    assert [rows[0].tokens, rows[2].tokens] == [greedy[0], greedy[2]]
    other = RunningBatch(model, eos_token_id=None, pad_token_id=PAD)
    row = Row(prompts[1], NEW_TOKENS, sampling=Sampling(temperature=0.8, top_p=0.9, seed=5))
    other.add([row])
    _run_out(other)
    assert row.tokens != alone[0]  # another seed, other draws


@pytest.mark.slow  # torch.compile: two graphs per model, about 20 s each on 2 cores
@pytest.mark.parametrize("kind", ["full", "prefix"])
def test_a_compiled_running_batch_compiles_two_graphs_and_gives_the_eager_tokens(model_dirs, kind):
    """compile=True: warm_up compiles a lone row's graph and a batch's; then rows joining and
    leaving, at every batch size and length, run without compiling again, and their tokens equal
    each prompt's alone here (fused sums differ in the last bits, which can flip a near tie on
    other weights: the compiled steps are the server's option, not its default)."""
    from torch._dynamo.utils import counters

    model, _, _ = load_variant(model_dirs("llama", kind))
    prompts = _prompts()
    expected = _alone(model, prompts)
    assert RunningBatch(model, eos_token_id=None, pad_token_id=PAD).warm_up() == 0.0  # nothing to compile
    batch = RunningBatch(model, eos_token_id=None, pad_token_id=PAD, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    assert batch.warm_up() > 0 and len(batch) == 0
    assert counters["stats"]["unique_graphs"] == graphs + 2
    rows = [Row(p, NEW_TOKENS) for p in prompts]
    batch.add(rows[:1])
    batch.step()
    batch.step()
    batch.add(rows[1:3])  # 1 row -> 3, every cache left-padded
    batch.step()
    with pytest.raises(RuntimeError, match="empty running batch"):
        batch.warm_up()
    batch.add(rows[3:])
    _run_out(batch)  # 4 rows -> 3 -> ... -> 1 as they end, the cache trimmed
    lone = Row(prompts[2], NEW_TOKENS)
    batch.add([lone])
    _run_out(batch)
    assert [r.tokens for r in rows] == expected and lone.tokens == expected[2]
    assert counters["stats"]["unique_graphs"] == graphs + 2  # no batch size or length compiled again


def test_a_failed_warm_up_is_raised_where_the_scheduler_is_made(model_dirs, monkeypatch):
    """compile=True warms up in the scheduler's own thread; what fails there is raised to its maker."""
    model, _, _ = load_variant(model_dirs("llama", "full"))

    def fail(self):
        assert threading.current_thread().name == "generate"  # the thread that will run the steps
        raise RuntimeError("no C++ compiler")

    def workers() -> int:
        return sum(t.name == "generate" for t in threading.enumerate())

    monkeypatch.setattr(RunningBatch, "warm_up", fail)
    before = workers()
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        Scheduler(model, eos_token_id=None, pad_token_id=PAD, compile=True)
    assert workers() == before  # its worker ended


def test_the_cache_grows_past_its_reserve(model_dirs, monkeypatch):
    monkeypatch.setattr(running_batch, "CAPACITY_STEP", 3)  # room for 3 steps: this run grows it 3 times
    model, _, _ = load_variant(model_dirs("llama", "full"))
    prompts = _prompts()
    expected = _alone(model, prompts)
    batch = RunningBatch(model, eos_token_id=None, pad_token_id=PAD)
    rows = [Row(p, NEW_TOKENS) for p in prompts]
    batch.add(rows[:2])
    capacities = set()
    while len(batch):
        capacities.add(batch._cache.capacity)
        if len(batch) == 2 and len(rows[0].tokens) == 4:
            batch.add(rows[2:])
        batch.step()
    assert [r.tokens for r in rows] == expected
    assert len(capacities) >= 3


def test_what_the_running_batch_does_not_run(model_dirs, tmp_path, tokenizer):
    model, _, _ = load_variant(model_dirs("llama", "full"))
    assert unsupported(model) is None
    prompt_tuning = peft.get_peft_model(model, peft.PromptTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM"))
    assert "PROMPT_TUNING" in unsupported(prompt_tuning)
    windowed = AutoModelForCausalLM.from_pretrained(
        save_checkpoint(tmp_path / "mistral", tokenizer, "mistral", sliding_window=6), dtype=torch.float32)
    assert "sliding window of 6" in unsupported(windowed)
    with pytest.raises(ValueError, match="cannot run"):
        RunningBatch(windowed, eos_token_id=None, pad_token_id=PAD)
    # the scheduler batches such a model statically, on the engine's DynamicCache path
    scheduler = Scheduler(windowed, eos_token_id=None, pad_token_id=PAD)
    try:
        assert scheduler.running_batch is None and scheduler.engine is not None
        done = scheduler.submit(Completion(prompt=_prompts()[0], max_tokens=4, stream=TextStream(tokenizer)))
        assert _events(done)[-1] == ("done", "length") and len(done.stream.tokens) == 4
    finally:
        scheduler.close()


# -- the scheduler ----------------------------------------------------------------------------------
class Pause:
    """A forward pre-hook on the model the scheduler runs: records each forward's input shape and,
    when asked, holds the worker thread at the next forward pass until released, so a test knows
    where the worker is (which step boundary requests join at)."""

    def __init__(self, module: torch.nn.Module):
        self.shapes: list[tuple[int, int]] = []  # (rows, positions) of each forward
        self._hold, self._held, self._go = threading.Event(), threading.Event(), threading.Event()
        self.hook = module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        if self._hold.is_set():
            self._hold.clear()
            self._held.set()
            self._go.wait(60)
            self._go.clear()

    def hold_next(self) -> None:
        self._hold.set()

    def wait_held(self) -> None:
        assert self._held.wait(60), "the worker never reached a forward pass"
        self._held.clear()

    def release(self, hold_next: bool = False) -> None:
        if hold_next:
            self._hold.set()
        self._go.set()

    def remove(self) -> None:
        self._hold.clear()
        self._go.set()
        self.hook.remove()


def _events(completion: Completion) -> list[tuple[str, str]]:
    out = [completion.events.get(timeout=60)]
    while out[-1][0] == "delta":
        out.append(completion.events.get(timeout=60))
    return out


def _completion(tokenizer, prompt, max_tokens=NEW_TOKENS, sampling=None) -> Completion:
    return Completion(prompt=prompt, max_tokens=max_tokens, stream=TextStream(tokenizer), sampling=sampling)


def test_the_scheduler_joins_requests_at_step_boundaries_and_drops_a_cancelled_one(model_dirs, tokenizer):
    model, _, _ = load_variant(model_dirs("llama", "full"))
    prompts = _prompts()
    expected = _alone(model, prompts)
    seeded = RequestSampling(temperature=0.9, top_p=0.95, seed=11)
    sampled = _alone(model, [prompts[2]], sampling=Sampling(temperature=0.9, top_p=0.95, seed=11))[0]
    scheduler = Scheduler(model, eos_token_id=None, pad_token_id=PAD, max_batch_size=3, max_queue=8)
    pause = Pause(scheduler.running_batch.engine.runner)
    try:
        pause.hold_next()
        first = scheduler.submit(_completion(tokenizer, prompts[0]))
        pause.wait_held()  # first's prefill
        leaving = scheduler.submit(_completion(tokenizer, prompts[1]))
        sampling = scheduler.submit(_completion(tokenizer, prompts[2], sampling=seeded))
        last = scheduler.submit(_completion(tokenizer, prompts[3]))  # waits: max_batch_size is 3
        pause.release(hold_next=True)
        pause.wait_held()  # first's first step
        assert scheduler.current == [first] and scheduler.admitted == 4
        pause.release(hold_next=True)
        pause.wait_held()  # leaving and sampling join at the step boundary: their prefill
        assert scheduler.current == [first, leaving, sampling]
        pause.release(hold_next=True)
        pause.wait_held()  # the first step of the three
        leaving.cancelled.set()  # its client went away: it ends at this step, `last` takes its place
        pause.release()
        for c in (first, sampling, last):
            assert _events(c)[-1] == ("done", "length")
        assert _events(leaving)[-1] == ("done", "cancelled") and leaving.stream.tokens == expected[1][:1]
        assert first.stream.tokens == expected[0] and last.stream.tokens == expected[3]
        assert sampling.stream.tokens == sampled
        assert scheduler.admitted == 0 and dict(scheduler.finished) == {"length": 3, "cancelled": 1}
        assert scheduler.batches == 3  # first; leaving and sampling; last
        assert pause.shapes[:5] == [(1, 6), (1, 1), (2, 11), (3, 1), (1, 8)]  # last joins after the cancel
        assert pause.shapes[5] == (3, 1)
    finally:
        pause.remove()
        scheduler.close()


def test_a_failed_step_answers_its_rows_and_the_next_request_is_served(model_dirs, tokenizer, monkeypatch):
    model, _, _ = load_variant(model_dirs("llama", "full"))
    prompts = _prompts()
    expected = _alone(model, prompts)
    scheduler = Scheduler(model, eos_token_id=None, pad_token_id=PAD, max_batch_size=4, max_queue=4)
    engine = scheduler.running_batch.engine
    forward = engine._forward

    def broken(ids, *args, **kwargs):
        if tuple(ids.shape) == (2, 1):  # a decode step of two rows
            raise RuntimeError("out of memory, say")
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", broken)
    pause = Pause(engine.runner)
    try:
        pause.hold_next()
        rows = [scheduler.submit(_completion(tokenizer, prompts[0]))]
        pause.wait_held()
        rows.append(scheduler.submit(_completion(tokenizer, prompts[1])))
        pause.release()  # the second joins the first; their first shared step fails
        for c in rows:
            kind, message = _events(c)[-1]
            assert kind == "error" and "RuntimeError: out of memory, say" in message
        after = scheduler.submit(_completion(tokenizer, prompts[2]))
        assert _events(after)[-1] == ("done", "length") and after.stream.tokens == expected[2]
        assert scheduler.admitted == 0 and dict(scheduler.finished) == {"error": 2, "length": 1}
    finally:
        pause.remove()
        scheduler.close()
