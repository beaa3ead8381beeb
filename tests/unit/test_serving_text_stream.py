"""stages/serving/text_stream.py and openai_api.py: deltas that join to the decoded text, stop strings
split across tokens never sent, multi-byte characters held until complete; request checks."""

import pytest
from transformers import PreTrainedTokenizerFast

from stages.serving.openai_api import RequestError, parse_body, parse_request
from stages.serving.text_stream import TextStream, held_back


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)


def _stream_all(tokenizer, ids, stops=()):
    stream = TextStream(tokenizer, stops, tokenizer.eos_token_id)
    deltas = [stream.push(i) for i in ids]
    if not stream.stopped:
        deltas.append(stream.flush())
    return deltas, stream


def test_held_back_is_the_longest_tail_that_may_start_a_stop_string():
    assert held_back("the end of", ["of the", "xyz"]) == 2  # "of" may become "of the"
    assert held_back("the end of ", ["of the"]) == 3
    assert held_back("the end", ["of the"]) == 0
    assert held_back("caf\ufffd", []) == 1  # half a character


def test_deltas_join_to_the_decoded_text(tokenizer):
    ids = tokenizer("the colour of the apple is red, é ü ☃", add_special_tokens=False)["input_ids"]
    deltas, stream = _stream_all(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == stream.text
    assert all("\ufffd" not in d for d in deltas)  # byte-level pieces of é are sent once whole


def test_a_stop_string_across_tokens_is_never_sent(tokenizer):
    text = "one two three four five"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas, stream = _stream_all(tokenizer, ids, stops=["ee fo"])
    assert stream.stopped and stream.text == "one two thr"
    assert "".join(deltas) == "one two thr"
    assert len(stream.tokens) < len(ids)  # the tokens after the stop string were not taken


def test_eos_counts_as_a_token_and_adds_no_text(tokenizer):
    ids = tokenizer("red", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, stream = _stream_all(tokenizer, ids)
    assert "".join(deltas) == "red" and len(stream.tokens) == len(ids)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
])
def test_a_bad_field_is_named_with_422(body, param):
    with pytest.raises(RequestError) as error:
        parse_request(body, "chat")
    assert error.value.status == 422 and error.value.param == param


def test_a_good_request_keeps_what_it_asked_for():
    request = parse_request({"model": "m", "temperature": 0, "stop": "\n", "max_completion_tokens": 5,
                             "presence_penalty": 0, "user": "u", "stream": True,
                             "stream_options": {"include_usage": True},
                             "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
                                 {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, "chat")
    assert request.greedy and request.stops == ("\n",) and request.max_tokens == 5 and request.include_usage
    assert request.messages == (("system", "s"), ("user", "ab"))
    assert parse_request({"model": "m", "prompt": ["p"]}, "completions").prompt == "p"
    with pytest.raises(RequestError) as error:
        parse_body(b"[1, 2]")
    assert error.value.status == 400
