"""What the debug-DAG test (tests/integration/test_workflow.py) checks of a finished run's models
served over HTTP: `python -m stages.serve`'s in-process twin answers the `openai` client, greedy,
with exactly what `stages.predict` writes for the same dev records, streamed or not, with the same
prompt token count."""

from __future__ import annotations

import json
import threading
from pathlib import Path

MAX_LENGTH = 64  # prompt + answer, for the predictor and the server alike


def served_and_predicted(exp: Path, variant: str, work: Path, num_records: int = 2) -> list[tuple[dict, dict]]:
    """[(what the server answered, what predict wrote)] for the first dev records of `exp`, on
    `exp/variant`. The records are copied outside the data dir, so both take the prompt format
    from the tokenizer (predict's --chat-template auto)."""
    import openai

    from stages import predict, serve

    lines = (exp / "data" / "sft" / "dev.json").read_text().splitlines()[:num_records]
    records = work / f"{variant.replace('/', '_')}.jsonl"
    records.write_text("".join(json.dumps({"src": json.loads(line)["src"]}) + "\n" for line in lines))
    out = records.with_suffix(".out.jsonl")
    predict.run(exp / variant, records, out, predict.PredictSettings(src_length=MAX_LENGTH - 1, max_length=MAX_LENGTH))
    predicted = [json.loads(line) for line in out.read_text().splitlines()]

    server = serve.start(exp / variant, max_length=MAX_LENGTH)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert server.server_address[0] == "127.0.0.1"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        pairs = []
        for want in predicted:
            messages = [{"role": "user", "content": want["src"]}]
            answer = client.chat.completions.create(model=server.served.model_id, messages=messages, temperature=0)
            streamed = client.chat.completions.create(model=server.served.model_id, messages=messages, temperature=0,
                                                      stream=True)
            pairs.append(({"output": answer.choices[0].message.content, "prompt_tokens": answer.usage.prompt_tokens,
                           "output_tokens": answer.usage.completion_tokens, "kind": server.served.kind,
                           "streamed": "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)},
                          want))
        return pairs
    finally:
        serve.stop(server)
        thread.join(timeout=30)
