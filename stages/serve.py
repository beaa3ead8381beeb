"""Serve models over HTTP: the OpenAI API and a chat page; one model, or several behind one server.

`python -m stages.serve (--model DIR [--model DIR ...] | --experiment results/<exp>) [--host 127.0.0.1]
 [--port 0] [--api-key KEY] [--served-model-name NAME ...] [--max-length N] [--max-batch-size 8]
 [--max-queue 16] [--chat-template auto|true|false] [--compile]`

`--model` is anything stages.predict answers with (`stages.inference.loading.load_variant`): a full
model (pretrain, sft, lora-merged, an imported base), a LoRA or prefix adapter (on its base), or a
quantized dir (quant/<variant>, on its low-bit kernels). Local files only, safetensors only,
never `trust_remote_code`.

Several models (stages/serving/variants.py): `--experiment results/<exp>` serves every variant of
the experiment (base, pretrain, sft, lora, prefix, lora-merged, quant/<variant>; each named as its
eval/<variant>.json is: `sft`, `lora`, `wint4`), `--model` may be given several times (each named
by its directory, or by the `--served-model-name` given in the same place), and both combine; two
models with one id are refused. A request's `model` field picks the model; each runs in its own
scheduler thread, and adapters of one base share one copy of its weights
(stages/serving/shared_bases.py).

Safe by default: the server listens on 127.0.0.1 (this machine only) and, with `--port 0` (the
default), on a free port; its address is printed as `serving <ids> at http://127.0.0.1:PORT`
once it accepts connections. `--host 0.0.0.0` (or any other address) opens it to the network,
with a warning; `--api-key` (or the LLM_LIFECYCLE_API_KEY environment variable) then requires
`Authorization: Bearer <key>` on every /v1 request.

API (stages/serving/http_server.py): /v1/models, /v1/chat/completions, /v1/completions, streamed
as server-sent events with `"stream": true`; the chat page at `/` (a model selector, and a compare
mode that streams one prompt to two models side by side). A greedy answer (`temperature: 0`) is
stages.predict's answer for the same record and the same max_length, whichever model answers.
Ctrl-C or SIGTERM stops it.

`--compile` runs each model's decode steps through torch.compile
(stages/inference/running_batch.py): compiled before the server starts listening (a minute or
more per model on 2 cores, less once inductor's on-disk cache holds the graphs), then a lone
stream decodes 2.3-2.4x faster (fp32 SmolLM2-135M, bench/serve.py); greedy answers may differ
from the eager steps' where two logits are near ties.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from stages.errors import InputError, run_cli
from stages.serving.http_server import ModelServer
from stages.serving.model_set import ModelSet
from stages.serving.shared_bases import load_served_models, weight_bytes
from stages.serving.variants import (
    ModelSpec,
    check_unique,
    experiment_variants,
    named_dirs,
)

log = logging.getLogger(__name__)

API_KEY_ENV = "LLM_LIFECYCLE_API_KEY"
T = TypeVar("T")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def in_a_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) in a thread that ends after it (its exception raised here): the OpenMP
    threads torch starts for it (loading copies tensors in parallel) end with that thread, so that
    the schedulers' threads are the only ones holding OpenMP teams (scheduler.py, `_warm_up_then`);
    `start_models` loads so under `compile`."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as pool:  # its thread ends on leaving
        return pool.submit(fn, *args, **kwargs).result()


def start(model_dir: str | Path, *, served_model_name: str | None = None, **options) -> ModelServer:
    """One model: `start_models` with one spec (the form tests and bench/serve.py use)."""
    return start_models(named_dirs([model_dir], [served_model_name] if served_model_name else None), **options)


def start_models(specs: Sequence[ModelSpec], *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_length: int | None = None, max_batch_size: int = 8, max_queue: int = 16,
                 chat_template: str = "auto", compile: bool = False) -> ModelServer:
    """Load the models (adapters of one base sharing its weights), start a scheduler for each and
    bind the server (not yet serving: call `serve_forever`, e.g. in a thread). `main` adds the
    signals and the printed address."""
    if max_batch_size < 1 or max_queue < 1:  # before the models load
        raise InputError(f"--max-batch-size {max_batch_size} and --max-queue {max_queue} must both be >= 1")
    check_unique(specs)  # before the models load
    # compile: loaded in a thread that ends, so that libgomp's threads spin between the compiled steps' short
    # kernels (in_a_passing_thread); eager steps gain 5-7% from it but, on a loaded machine, spinning threads
    # can cost far more than that (bench/serve.py's Direct), so eager serving keeps the main thread's team
    if compile:
        served = in_a_passing_thread(load_served_models, specs, chat_template=chat_template, max_length=max_length)
    else:
        served = load_served_models(specs, chat_template=chat_template, max_length=max_length)
    torch_models = [s.model for s in served if s.kind != "onnx"]
    if len(served) > 1 and torch_models:
        separate, together = weight_bytes(torch_models)
        log.info("%d models hold %.1f MB of weights (%.1f MB loaded one by one)", len(served), together / 1e6,
                 separate / 1e6)
    models = ModelSet.start(served, max_batch_size=max_batch_size, max_queue=max_queue, compile=compile)
    try:
        return ModelServer((host, port), models, api_key=api_key)
    except OSError as e:
        models.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port (0: a free one)") \
            from None


def stop(server: ModelServer) -> None:
    server.shutdown()
    server.server_close()
    server.models.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stages.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", default=[],
                        help="model dir: HF layout, peft adapter or quantized HF dir; give it several times to "
                             "serve several models (each named by its dir, or by --served-model-name)")
    parser.add_argument("--experiment", default=None,
                        help="results/<exp>: serve every variant in it (base, pretrain, sft, lora, prefix, "
                             "lora-merged, quant/<variant>), each named as its eval/<variant>.json (sft, lora, "
                             "wint4, ...); adapters share one copy of their base's weights")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s: this machine only; another address "
                             "opens the server to the network)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}, "
                             "else none)")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="the model id clients pass as `model` (default: the model dir's name); with several "
                             "--model, once per --model, in the same order")
    parser.add_argument("--max-length", type=int, default=None,
                        help="prompt + answer tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="requests generating together (rows of the running batch: greedy and sampling "
                             "alike, joining and leaving between steps), per model (default %(default)s)")
    parser.add_argument("--max-queue", type=int, default=16,
                        help="requests admitted at once per model, running or waiting; more get 503 "
                             "(default %(default)s)")
    parser.add_argument("--chat-template", choices=("auto", "true", "false"), default="auto",
                        help="chat prompt format: auto = the experiment's data/index.json sft_format for a model "
                             "in results/<exp>/, else the tokenizer's chat template when it has one")
    parser.add_argument("--compile", action="store_true",
                        help="decode steps through torch.compile, compiled before the server listens (a minute "
                             "or more per model on 2 cores); a lone stream decodes over 2x faster")
    return parser


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The models the command line names: the experiment's variants, then each --model."""
    if not args.model and not args.experiment:
        raise InputError("name what to serve: --model DIR (any number of times) or --experiment results/<exp>")
    if args.served_model_name and not args.model:
        raise InputError("--served-model-name names --model dirs; an --experiment's variants are named by their "
                         "directories")
    specs = experiment_variants(args.experiment) if args.experiment else []
    specs += named_dirs(args.model, args.served_model_name)
    check_unique(specs)
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    specs = model_specs(args)
    if not is_loopback(args.host):
        log.warning("listening on %s: anyone who can reach this machine can use the model%s", args.host,
                    "" if args.api_key else " (no --api-key set)")
    server = start_models(specs, host=args.host, port=args.port, api_key=args.api_key, max_length=args.max_length,
                          max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                          chat_template=args.chat_template, compile=args.compile)
    # serve_forever runs in this thread; a signal handler must not call shutdown() from it (it
    # waits for serve_forever to return), so a helper thread does.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"serving {', '.join(server.models.ids)} at {server.url} (chat page: {server.url}/, "
          f"OpenAI API: {server.url}/v1)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        server.models.close()
    print("server stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main, "serve")
