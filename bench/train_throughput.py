"""Training throughput and memory of our pretrain step against Hugging Face's Trainer.

Part 1, one process: tokens/s and MFU of our pretrain step (our Llama, torch AdamW, bf16 autocast,
gradient clipping, LR scheduler, optionally torch.compile) and of `transformers.Trainer` on
`transformers.LlamaForCausalLM` with the same config, the same initial weights, the same random
tokens, the same optimizer and schedule, and the same warmup/measured steps. Steps are timed from
just before the forward to just after zero_grad (a TrainerCallback's on_step_begin/on_step_end for
the Trainer), so data loading and setup are excluded the same way for both. The machine's peak
bf16 matmul FLOP/s is measured in the same run. With `--profile`, a few more steps of the stage
step as the default run trains and of the Trainer run under torch.profiler: time per step by kind
of operator (matmul, attention, loss, the rest) and the ceiling that matmul and attention alone
put on the ratio to the Trainer.

Part 1c, the default run's layout (`--dag-layout`, on by default): the stage step as the default
pretraining runs it, two torchrun ranks of one thread each, DeepSpeed ZeRO as config/config.yaml
sets it (stage1), with the stage's per-step collectives (the global batch's learned tokens, the
step loss), against the Trainer in the same two ranks (DistributedDataParallel, gloo) with the
same per-rank batch; rounds alternate the two, and MFU is against the node's peak.

Part 2, two processes (torchrun, gloo): per-rank peak RSS and bytes of parameters, gradients,
fp32 master copies and optimizer state for DDP (sharding none) and DeepSpeed ZeRO-1/2/3 built
with the pretrain stage's own `deepspeed_config`.

    .venv/bin/python bench/train_throughput.py            # defaults: tiny, batch 8 x 256, compile
    .venv/bin/python bench/train_throughput.py --help

Prints a table and writes JSON (default bench/out/train_throughput.json). Timings on a shared
machine are noisy: compare ratios measured in the same run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import finish, machine_info  # noqa: E402
from stages.config import check_config  # noqa: E402
from stages.training.flops import cpu_matmul_width, flops_per_token, peak_matmul_flops  # noqa: E402
from stages.model import build_model, config_for_flavour  # noqa: E402
from stages.model.config import LlamaConfig  # noqa: E402
from stages.training.allocator import keep_freed_host_memory  # noqa: E402
from stages.training.deepspeed_engine import adamw, deepspeed_config  # noqa: E402
from stages.training.distributed import (  # noqa: E402
    WORLD_VARIABLES,
    finish_distributed,
    init_distributed,
    without_world,
)
from stages.training.step import train_step as engine_train_step  # noqa: E402
from stages.training.schedule import build_scheduler  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "train_throughput.json"
DEFAULT_CONFIG = ROOT / "config" / "config.yaml"  # the embedded default run, whose layout part 1c times
# Shapes beside the flavours: `135m` is SmolLM2-135M's (vocab 49152, tied embeddings), a 135M-class
# model for MFU at a size where matmuls dominate more than in tiny.
SHAPES = {"135m": dict(base="tiny", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)}


def model_config(name: str, vocab_size: int) -> LlamaConfig:
    """A flavour's config with `vocab_size`, or one of SHAPES (its own vocabulary)."""
    if name in SHAPES:
        shape = dict(SHAPES[name])
        return config_for_flavour(shape.pop("base"), **shape)
    return config_for_flavour(name, vocab_size=vocab_size)
SHARDINGS = ("none", "stage1", "stage2", "stage3")


# -- machine and model arithmetic --------------------------------------------------------------


def peak_bf16_matmul_flops(device: torch.device = torch.device("cpu")) -> float:
    """2048-wide products where they take 0.1 s or less; narrower where bf16 is emulated (a CPU
    without AVX512-BF16 or AMX: one 2048-wide product took 56 s on one thread of a 2-core AMD EPYC, and
    a measurement takes 41 of them). On a GPU, 8192-wide products (~1.4 ms each on an H100 or H200)."""
    if device.type == "cuda":
        return peak_matmul_flops(torch.bfloat16, device=device, n=8192, iters=20)
    return peak_matmul_flops(torch.bfloat16, n=cpu_matmul_width(torch.bfloat16, widest=2048))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: a GPU runs it asynchronously, so a host clock read
    without this would time the launches, not the step. Nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pretrain_section(**overrides: Any) -> dict[str, Any]:
    """The validated `pretrain` section (schema defaults) with `overrides`."""
    return check_config({"experiments": {"bench": {"pretrain": overrides}}})["experiments"]["bench"]["pretrain"]


def random_tokens(num_rows: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """(num_rows, seq_len) int64 uniform token ids."""
    return torch.randint(0, vocab_size, (num_rows, seq_len), generator=torch.Generator().manual_seed(seed))


# -- part 1: single-process throughput ---------------------------------------------------------

class OurStep:
    """Our pretrain step: forward(batch, labels=batch) under bf16 autocast, backward, gradient
    clipping, AdamW, LR scheduler, zero_grad; `step()` runs and times one."""

    def __init__(self, config: LlamaConfig, state: dict[str, torch.Tensor], data: torch.Tensor,
                 section: dict[str, Any], compile_model: bool, device: torch.device = torch.device("cpu")):
        self.model = build_model(config)
        self.model.load_state_dict(state)
        self.model.to(device).train()
        self.device = device
        self.forward = torch.compile(self.model) if compile_model else self.model
        self.optimizer = adamw(self.model.parameters(), section)
        self.scheduler = build_scheduler(self.optimizer, section)
        self.data, self.section = data, section
        self.count = 0
        self.losses: list[float] = []

    def step(self) -> float:
        B, clip = self.section["per_device_train_batch_size"], self.section["max_grad_norm"]
        start = (self.count * B) % len(self.data)
        t0 = time.perf_counter()
        batch = self.data[start:start + B].to(self.device)  # copied inside the step, as the Trainer's batches are
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.section["bf16"]):
            _, loss = self.forward(batch, labels=batch)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        elapsed = time.perf_counter() - t0
        self.count += 1
        self.losses.append(loss.item())
        return elapsed


def stage_engine(config: LlamaConfig, state: dict[str, torch.Tensor], section: dict[str, Any], world: int,
                 compile_layers: bool):
    """The pretrain stage's DeepSpeed engine from `state`: `deepspeed_config(section, world)`, and
    `torch_compile` as the stage applies it (each decoder layer compiled in place), in train mode."""
    import deepspeed

    model = build_model(config)
    model.load_state_dict(state)
    if compile_layers:
        for layer in model.model.layers.values():
            layer.compile()
    optimizer = adamw(model.parameters(), section)
    scheduler = build_scheduler(optimizer, section)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(section, world))
    engine.train()
    return engine


class EngineStep:
    """The pretrain stage's own step (`stages.training.step.train_step`): a DeepSpeed engine in a
    world of one (ZeRO off), DeepSpeed bf16 (bf16 weights, fp32 master copy in the optimizer),
    DeepSpeed's gradient clipping, and `torch_compile` as the stage applies it (each decoder layer
    compiled in place). Same `step()` interface as OurStep."""

    def __init__(self, config: LlamaConfig, state: dict[str, torch.Tensor], data: torch.Tensor,
                 section: dict[str, Any], compile_layers: bool):
        init_distributed()
        self.engine = stage_engine(config, state, {**section, "sharding": "none"}, 1, compile_layers)
        self.data, self.section = data, section
        self.count = 0
        self.losses: list[float] = []

    def step(self) -> float:
        B = self.section["per_device_train_batch_size"]
        start = (self.count * B) % len(self.data)
        batch = self.data[start:start + B]
        t0 = time.perf_counter()
        loss, _ = engine_train_step(self.engine, None, [(batch, batch)], num_tokens=batch[:, 1:].numel(), dp=1,
                                    clip=None)
        synchronize(self.engine.device)
        elapsed = time.perf_counter() - t0
        self.count += 1
        self.losses.append(float(loss))
        return elapsed


class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids as the Trainer's examples, each its own labels."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def hf_trainer(config: LlamaConfig, state: dict[str, torch.Tensor], data: torch.Tensor, section: dict[str, Any],
               batch_size: int, max_steps: int, output_dir: str, callback, use_cpu: bool = True, **arguments: Any):
    """transformers.Trainer on transformers.LlamaForCausalLM (sdpa) from `state`, on `data`'s rows,
    with our optimizer and schedule, no logging, saving or workers; `arguments` adds TrainingArguments."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    model = LlamaForCausalLM(HFLlamaConfig(**config.to_hf_dict(), attn_implementation="sdpa"))
    model.load_state_dict(state, strict=False)  # same names; HF's rotary buffer is not persistent
    optimizer = adamw(model.parameters(), section)
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=use_cpu, bf16=section["bf16"], per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1, max_steps=max_steps, max_grad_norm=section["max_grad_norm"],
        logging_steps=10**6, report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        seed=section["seed"], **arguments)
    return Trainer(model=model, args=args, train_dataset=TokenRows(data),
                   optimizers=(optimizer, build_scheduler(optimizer, section)), callbacks=[callback])


@contextlib.contextmanager
def single_process_env():
    """The launcher variables that `init_distributed` set for our engine's world of one, hidden
    while the Trainer is built and trains: accelerate reads LOCAL_RANK as a multi-process CPU run
    and would wrap the Trainer's model in DistributedDataParallel (a world of one, but DDP's
    gradient buckets and hooks still cost every step)."""
    saved = {name: os.environ.pop(name) for name in WORLD_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def bench_hf(config: LlamaConfig, state: dict[str, torch.Tensor], data: torch.Tensor, section: dict[str, Any],
             warmup: int, steps: int, compile_model: bool, partners: list[OurStep],
             profiler: StepProfiler | None = None,
             device: torch.device = torch.device("cpu")) -> tuple[dict, list[list[float]]]:
    """transformers.Trainer on transformers.LlamaForCausalLM from the same weights and tokens.

    After each measured Trainer step, each of `partners` runs and times one step, so the two
    alternate step by step and load from other processes on a shared machine hits both alike.
    With `profiler`, the measured steps run under it (pass no partners then).
    Returns the Trainer's summary and the partners' measured step times.
    """
    from transformers import TrainerCallback

    partner_times: list[list[float]] = [[] for _ in partners]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if profiler is not None and state.global_step == warmup:  # global_step: steps finished
                profiler.start()
            synchronize(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter() - self.t0)
            if profiler is not None and state.global_step == warmup + steps:
                profiler.stop()
            if state.global_step > warmup:  # global_step counts the step just finished
                for times, partner in zip(partner_times, partners):
                    times.append(partner.step())

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp, single_process_env():
        trainer = hf_trainer(config, state, data, section, section["per_device_train_batch_size"], warmup + steps,
                             tmp, timer, use_cpu=device.type == "cpu", torch_compile=compile_model)
        result = trainer.train()
    summary = _summary(timer.times[0], sum(timer.times[:warmup]), timer.times[warmup:])
    summary["train_loss"] = result.training_loss
    summary["trained_module"] = type(trainer.model_wrapped).__name__  # LlamaForCausalLM: no DDP wrapper
    summary["param_dtype"] = str(next(trainer.model.parameters()).dtype)  # fp32 master weights under autocast
    return summary, partner_times


def _summary(first_step_s: float, warmup_s: float, measured: list[float], **extra: Any) -> dict[str, Any]:
    return {"first_step_s": first_step_s, "warmup_s": warmup_s, "step_times_s": measured,
            "median_step_s": statistics.median(measured), "min_step_s": min(measured), **extra}


# -- part 1b: where a step's time goes (--profile) ----------------------------------------------

# Operator kinds by aten name, on self time (an operator's own time, its children's excluded), so
# nothing is counted twice. Everything else (elementwise, copies, norms, the optimizer's arithmetic,
# DeepSpeed's and the Trainer's own operators) is "other".
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
OP_KINDS = {"attention": ("scaled_dot_product", "flash_attention", "efficient_attention"),
            "loss": ("log_softmax", "nll_loss", "cross_entropy")}


def op_kind(name: str) -> str:
    if name in MATMUL_OPS:
        return "matmul"
    return next((kind for kind, needles in OP_KINDS.items() if any(n in name for n in needles)), "other")


class StepProfiler:
    """torch.profiler (CPU) between start() and stop(); summary(steps) gives per-step milliseconds
    by operator kind, the wall time between start and stop, and the heaviest operators."""

    def __init__(self) -> None:
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.wall_s = 0.0

    def start(self) -> None:
        self.prof.start()
        self.wall_s = -time.perf_counter()

    def stop(self) -> None:
        self.wall_s += time.perf_counter()
        self.prof.stop()

    def summary(self, steps: int) -> dict[str, Any]:
        kinds = dict.fromkeys(("matmul", "attention", "loss", "other"), 0.0)
        optimizer_us, ops = 0.0, []
        for event in self.prof.key_averages():
            kinds[op_kind(event.key)] += event.self_cpu_time_total
            ops.append((event.self_cpu_time_total, event.key))
            if event.key.startswith("Optimizer.step#"):  # torch's region around optimizer.step()
                optimizer_us += event.cpu_time_total

        def per_step(us: float) -> float:
            return us / 1e3 / steps
        return {"steps": steps, "ms_per_step": {k: per_step(v) for k, v in kinds.items()},
                "ops_ms_per_step": per_step(sum(kinds.values())), "wall_ms_per_step": self.wall_s * 1e3 / steps,
                "optimizer_step_ms_per_step": per_step(optimizer_us),
                "top_ops_ms_per_step": {name: per_step(us) for us, name in sorted(ops, reverse=True)[:12]}}


def profile_steps(stepper: OurStep | EngineStep, steps: int) -> dict[str, Any]:
    profiler = StepProfiler()
    profiler.start()
    for _ in range(steps):
        stepper.step()
    profiler.stop()
    return profiler.summary(steps)


def bench_profile(name: str, stepper: EngineStep, config: LlamaConfig, state: dict[str, torch.Tensor],
                  data: torch.Tensor, section: dict[str, Any], steps: int, hf_median_ms: float) -> dict[str, Any]:
    """Profiles `steps` more steps of `stepper` (warm) and of a fresh Trainer (after one warmup
    step). The ceiling is the Trainer's unprofiled median step time (`hf_median_ms`, part 1) over
    our matmul + attention time: the ratio our step would reach if everything else in it cost
    nothing, the kernels staying what they are. The Trainer's profiled wall would overstate it: the
    profiler's cost per operator inflates it (`ceiling_profiled_wall`, for comparison)."""
    profiler = StepProfiler()
    bench_hf(config, state, data, section, 1, steps, False, [], profiler=profiler)
    runs = {name: profile_steps(stepper, steps), "hf trainer (eager)": profiler.summary(steps)}
    kernels = runs[name]["ms_per_step"]["matmul"] + runs[name]["ms_per_step"]["attention"]
    hf_wall = runs["hf trainer (eager)"]["wall_ms_per_step"]
    return {"runs": runs, "ours": name, "ratio_profiled": hf_wall / runs[name]["wall_ms_per_step"],
            "ceiling_matmul_attention": hf_median_ms / kernels, "ceiling_profiled_wall": hf_wall / kernels}


# -- part 1c: the default run's layout (two ranks) ---------------------------------------------

def dag_pretrain_section(**overrides: Any) -> dict[str, Any]:
    """The default run's `pretrain` section (config/config.yaml's one experiment, schema defaults
    filled, bf16 auto decided for this machine) with `overrides`."""
    from stages.config import load_yaml
    from stages.training.capabilities import resolved_bf16

    config = check_config(load_yaml(DEFAULT_CONFIG))
    (name,) = config["experiments"]  # the embedded default has one experiment
    return resolved_bf16({**config["experiments"][name]["pretrain"], **overrides})


class RankRows:
    """Global batch `index`'s rows of this rank: B rows per rank, ranks side by side."""

    def __init__(self, data: torch.Tensor, batch_size: int, rank: int, world: int):
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world

    def __call__(self, index: int) -> torch.Tensor:
        start = (index * self.world + self.rank) * self.batch_size
        return self.data[start:start + self.batch_size]


def layout_stage_steps(config: LlamaConfig, state: dict[str, torch.Tensor], rows: RankRows,
                       section: dict[str, Any], total: int) -> tuple[list[float], list[float]]:
    """This rank's step times and step losses of the pretrain stage's step in its layout
    (`stages.training.engine.step` without the data source: the global batch's learned tokens,
    `train_step`, the step loss summed over the ranks)."""
    import torch.distributed as dist

    from stages.training.step import learned_tokens

    world = dist.get_world_size()
    engine = stage_engine(config, state, section, world, section["torch_compile"])
    times, losses = [], []
    for index in range(total):
        batches = [(rows(index), rows(index))]
        t0 = time.perf_counter()
        num_tokens = learned_tokens(batches, dist.group.WORLD)
        share, _ = engine_train_step(engine, None, batches, num_tokens, dp=world, clip=None)
        dist.all_reduce(share)
        losses.append(share.item())
        times.append(time.perf_counter() - t0)
    return times, losses


def layout_trainer_steps(config: LlamaConfig, state: dict[str, torch.Tensor], rows: RankRows,
                         section: dict[str, Any], total: int) -> tuple[list[float], list[float], str]:
    """This rank's step times of transformers.Trainer in the same ranks: accelerate reads the
    launcher's variables and wraps the model in DistributedDataParallel (gloo on a CPU)."""
    from transformers import TrainerCallback

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:  # all ranks' rows: the Trainer's sampler deals them out
        trainer = hf_trainer(config, state, rows.data, section, rows.batch_size, total, tmp, StepTimer(),
                             ddp_backend="gloo")
        result = trainer.train()
        wrapped = type(trainer.model_wrapped).__name__
    return times, [result.training_loss], wrapped


def layout_worker(args: argparse.Namespace) -> None:
    """One rank under torchrun for part 1c: `--layout-worker stage|hf`; rank 0 writes its times."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # the stage's ranks: stages.launch gives each its share of the job's threads
    if args.keep_freed_memory:
        keep_freed_host_memory()
    total = args.warmup_steps + args.steps
    config = model_config(args.flavour, args.vocab_size)
    section = dag_pretrain_section(per_device_train_batch_size=args.batch_size, max_length=args.seq_len,
                                   max_steps=total, warmup_steps=args.warmup_steps,
                                   **({"sharding": args.layout_sharding} if args.layout_sharding else {}))
    state = build_model(config, seed=section["seed"]).state_dict()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    rows = RankRows(random_tokens(total * world * args.batch_size, args.seq_len, config.vocab_size, seed=1),
                    args.batch_size, rank, world)
    if args.layout_worker == "stage":
        init_distributed()
        times, losses = layout_stage_steps(config, state, rows, section, total)
        wrapped = "DeepSpeedEngine"
    else:
        times, losses, wrapped = layout_trainer_steps(config, state, rows, section, total)
    if rank == 0:
        record = {"side": args.layout_worker, "world_size": world, "threads": torch.get_num_threads(),
                  "sharding": section["sharding"] if args.layout_worker == "stage" else "ddp",
                  "bf16": section["bf16"], "torch_compile": section["torch_compile"] and args.layout_worker == "stage",
                  "step_times_s": times, "losses": losses, "trained_module": wrapped}
        Path(args.layout_dir, f"{args.layout_worker}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()
        finish_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the memory workers: no interpreter finalization after the record is written


def bench_dag_layout(args: argparse.Namespace, tokens_per_rank_step: int) -> dict[str, Any]:
    """`--layout-rounds` rounds of (stage, Trainer), each a fresh 2-rank torchrun; per side the
    median over all rounds' measured steps of rank 0 (the ranks meet in every step's collectives)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = without_world(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    world = dag_pretrain_section()["world_size"]
    sides: dict[str, list[dict[str, Any]]] = {"stage": [], "hf": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.layout_rounds):
            for side in sides:
                cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(world), str(Path(__file__).resolve()),
                       "--layout-worker", side, "--layout-dir", tmp, "--flavour", args.flavour,
                       "--vocab-size", str(args.vocab_size), "--batch-size", str(args.batch_size),
                       "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                       "--warmup-steps", str(args.warmup_steps),
                       "--keep-freed-memory" if args.keep_freed_memory else "--no-keep-freed-memory"]
                if args.layout_sharding:
                    cmd += ["--layout-sharding", args.layout_sharding]
                proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, timeout=1200)
                if proc.returncode != 0:
                    raise RuntimeError(f"layout worker {side} failed:\n{proc.stderr[-4000:]}")
                sides[side].append(json.loads(Path(tmp, f"{side}.json").read_text()))
    runs = {}
    for side, records in sides.items():
        measured = [t for r in records for t in r["step_times_s"][args.warmup_steps:]]
        first = records[0]
        name = (f"stage, {first['world_size']} ranks {first['sharding']}" if side == "stage"
                else f"hf trainer, {first['world_size']} ranks ddp")
        runs[name] = _summary(statistics.median(r["step_times_s"][0] for r in records),
                              statistics.median(sum(r["step_times_s"][:args.warmup_steps]) for r in records),
                              measured, rounds=len(records), world_size=first["world_size"],
                              threads_per_rank=first["threads"], sharding=first["sharding"], bf16=first["bf16"],
                              torch_compile=first["torch_compile"], trained_module=first["trained_module"],
                              tokens_per_step=tokens_per_rank_step * first["world_size"],
                              losses=[r["losses"] for r in records])
    return runs


# -- part 2: per-rank memory under DeepSpeed ---------------------------------------------------

def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    s = t.untyped_storage()
    return None if s.nbytes() == 0 else (s.data_ptr(), s.nbytes())


def _walk_tensors(obj: Any, depth: int, seen: set[int]):
    """(tensor, is_a_grad) reachable from a DeepSpeed object through attributes, lists and dicts."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj, False
        if obj.grad is not None:
            yield obj.grad, True
    elif isinstance(obj, (list, tuple, set)):
        for x in obj:
            yield from _walk_tensors(x, depth - 1, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _walk_tensors(x, depth - 1, seen)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _walk_tensors(x, depth - 1, seen)


def held_bytes(engine) -> dict[str, int]:
    """Bytes of distinct tensor storages this rank holds, by role.

    params: the module's parameters (ZeRO-3: the local shards `p.ds_tensor`; the module's own
    `p.data` is then an empty placeholder). grads: `p.grad` plus every ZeRO buffer whose attribute
    name says grad (stage 2's reduced partitions, stage 3's flat grad-partition buffer).
    optimizer_state: the tensors in the torch optimizer's `state` (exp_avg, exp_avg_sq, step).
    master_params: ZeRO's fp32 partitions that the torch optimizer updates (`single_partition_of_fp32_groups`,
    `fp32_partitioned_groups_flat`), a copy even when the model itself is fp32. buffers: any
    remaining tensor found by walking the ZeRO optimizer, in practice communication buckets; these
    are allocated with torch.empty and only the pages written become resident (ZeRO-3's default
    reduce_bucket_size of 5e8 elements is a 2 GB fp32 bucket that RSS barely sees).
    Storages are counted once (views of one flat buffer share it).
    """
    counted: set[tuple[int, int]] = set()
    out = {"params": 0, "grads": 0, "master_params": 0, "optimizer_state": 0, "buffers": 0}

    def add(role: str, t: torch.Tensor | None) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        key = _storage_key(t)
        if key is not None and key not in counted:
            counted.add(key)
            out[role] += key[1]

    module, zero = engine.module, engine.optimizer
    inner = getattr(zero, "optimizer", zero)  # ZeRO wraps the torch optimizer; DDP/stage 0 may not
    for p in module.parameters():
        add("params", getattr(p, "ds_tensor", None))
        add("params", p.data)
    for state in inner.state.values():
        for t in state.values():
            add("optimizer_state", t)
    for p in module.parameters():
        add("grads", p.grad)
    if zero is not inner:
        for name, value in vars(zero).items():
            role = "master_params" if "fp32" in name else "grads" if "grad" in name else None
            if role is not None:
                for t, is_grad in _walk_tensors(value, 3, set()):
                    add("grads" if is_grad else role, t)
        for t, is_grad in _walk_tensors(zero, 4, set()):
            add("grads" if is_grad else "buffers", t)
    out["total"] = sum(out.values())
    out["total_without_buffers"] = out["total"] - out["buffers"]
    return out


def memory_worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: DeepSpeed engine from the stage's config, a few steps, report."""
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.keep_freed_memory:  # as the stage's ranks do
        keep_freed_host_memory()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    section = pretrain_section(sharding=args.memory_worker, world_size=world, bf16=args.memory_bf16,
                               per_device_train_batch_size=args.batch_size, max_length=args.seq_len,
                               max_steps=args.memory_steps, warmup_steps=0)
    config = config_for_flavour(args.memory_flavour, vocab_size=args.vocab_size)
    model = build_model(config, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = adamw(model.parameters(), section)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(section, world))
    data = random_tokens(args.memory_steps * args.batch_size, args.seq_len, args.vocab_size, seed=100 + rank)
    engine.train()
    held = None
    for step in range(args.memory_steps):
        batch = data[step * args.batch_size:(step + 1) * args.batch_size]
        _, loss = engine(batch, labels=batch)
        engine.backward(loss)
        if step == args.memory_steps - 1:
            held = held_bytes(engine)  # gradients are live and the optimizer state exists since step 1
        engine.step()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {"sharding": args.memory_worker, "rank": rank, "world_size": world, "num_parameters": n_params,
              "peak_rss_bytes": peak_rss, "baseline_rss_bytes": baseline_rss, "held": held,
              "zero_optimizer": type(engine.optimizer).__name__}
    Path(args.memory_dir, f"{args.memory_worker}_rank{rank}.json").write_text(json.dumps(record))
    del engine, optimizer, model  # ZeRO-3's gather handles go while their process group exists
    finish_distributed()
    # Skip interpreter finalization: once in CI a stage-3 worker aborted there ("terminate called
    # without an active exception", SIGABRT) after its record was written, failing the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def bench_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One 2-rank torchrun per sharding (ru_maxrss is a per-process high-water mark, so each
    setting needs fresh processes). The launches run side by side: most of their time is imports
    and rendezvous, and a process's peak RSS does not depend on its neighbours."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for sharding in args.shardings:
            cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(Path(__file__).resolve()),
                   "--memory-worker", sharding, "--memory-dir", tmp, "--memory-flavour", args.memory_flavour,
                   "--memory-steps", str(args.memory_steps), "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size),
                   "--keep-freed-memory" if args.keep_freed_memory else "--no-keep-freed-memory"]
            if args.memory_bf16:
                cmd.append("--memory-bf16")
            procs[sharding] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True)
        for sharding, proc in procs.items():
            _, stderr = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"memory worker for sharding={sharding} failed:\n{stderr[-4000:]}")
            rows += [json.loads(Path(tmp, f"{sharding}_rank{rank}.json").read_text()) for rank in range(2)]
    return rows


# -- report ------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def format_report(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    gpu = f" | GPU {m['gpu']}" if m.get("gpu") else ""
    lines = [f"machine: {m['cpu']} | {m['cores']} cores, {m['torch_threads']} torch threads | torch {m['torch']}"
             + gpu,
             f"settings: flavour={s['flavour']} vocab={s['vocab_size']} batch={s['batch_size']} seq_len={s['seq_len']} "
             f"warmup={s['warmup_steps']} steps={s['steps']} bf16 autocast, AdamW, clip {s['max_grad_norm']}, "
             f"freed host memory kept: {s['keep_freed_host_memory']}",
             f"FLOPs/token = 6*{result['flops_per_token']['n_matmul_params']:,} + attention "
             f"{result['flops_per_token']['attention']:,} = {result['flops_per_token']['total']:,}",
             f"peak bf16 matmul: {result['peak_flops'] / 1e9:.1f} GFLOP/s (best of before/after: "
             f"{', '.join(f'{x / 1e9:.1f}' for x in result['peak_flops_samples'])})", ""]
    lines.append(f"{'run':<30}{'median ms/step':>15}{'min ms/step':>13}{'tokens/s':>11}{'MFU %':>8}"
                 f"{'first step s':>14}")
    for name, r in result["runs"].items():
        lines.append(f"{name:<30}{r['median_step_s'] * 1e3:>15.1f}{r['min_step_s'] * 1e3:>13.1f}"
                     f"{r['tokens_per_s']:>11.0f}{r['mfu'] * 100:>8.2f}{r['first_step_s']:>14.1f}")
    for name, v in result["ratios"].items():
        lines.append(f"ratio {name}: {v:.2f}x")
    if result.get("profile"):
        prof = result["profile"]
        lines += ["", f"profile, ms per step over {s['profile_steps']} more steps each (torch.profiler self time "
                      "by operator kind; wall includes the profiler's overhead):",
                  f"{'run':<27}{'matmul':>8}{'attention':>10}{'loss':>7}{'other':>8}{'ops':>8}{'wall':>8}"
                  f"{'optimizer.step':>16}"]
        for name, r in prof["runs"].items():
            k = r["ms_per_step"]
            lines.append(f"{name:<27}{k['matmul']:>8.1f}{k['attention']:>10.1f}{k['loss']:>7.1f}{k['other']:>8.1f}"
                         f"{r['ops_ms_per_step']:>8.1f}{r['wall_ms_per_step']:>8.1f}"
                         f"{r['optimizer_step_ms_per_step']:>16.1f}")
        lines.append(f"ratio profiled hf / {prof['ours']} (wall): {prof['ratio_profiled']:.2f}x; ceiling if only "
                     "matmul and attention cost (hf median step, unprofiled / our matmul + attention): "
                     f"{prof['ceiling_matmul_attention']:.2f}x (hf's profiled wall: {prof['ceiling_profiled_wall']:.2f}x)")
    if result.get("memory"):
        lines += ["", f"memory per rank (2 ranks, flavour={result['memory_settings']['flavour']}, "
                      f"{result['memory_settings']['num_parameters']:,} params, bf16={result['memory_settings']['bf16']}), MiB:",
                  f"{'sharding':<9}{'rank':>5}{'params':>9}{'grads':>9}{'master':>9}{'optim':>9}{'buffers':>9}"
                  f"{'p+g+m+o':>9}{'peak RSS':>10}{'RSS-base':>10}"]
        for r in result["memory"]:
            h = r["held"]
            lines.append(f"{r['sharding']:<9}{r['rank']:>5}{_mib(h['params'])} {_mib(h['grads'])} {_mib(h['master_params'])}"
                         f" {_mib(h['optimizer_state'])} {_mib(h['buffers'])} {_mib(h['total_without_buffers'])}  {_mib(r['peak_rss_bytes'])}"
                         f"  {_mib(r['peak_rss_bytes'] - r['baseline_rss_bytes'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # as every training job does (stages.training.engine.setup); for the whole process, so the
    # Trainer's steps run on the same allocator as ours
    kept = keep_freed_host_memory() if args.keep_freed_memory else False
    torch.manual_seed(0)
    config = model_config(args.flavour, args.vocab_size)
    section = pretrain_section(per_device_train_batch_size=args.batch_size, max_length=args.seq_len, bf16=True,
                               max_steps=args.warmup_steps + args.steps, warmup_steps=args.warmup_steps, world_size=1)
    state = {k: v.clone() for k, v in build_model(config, seed=section["seed"]).state_dict().items()}
    data = random_tokens((args.warmup_steps + args.steps) * args.batch_size, args.seq_len, config.vocab_size, seed=1)
    fpt = flops_per_token(config, args.seq_len)
    tokens_per_step = args.batch_size * args.seq_len

    device = torch.device(args.device)
    peaks = [peak_bf16_matmul_flops(device)]
    # part 1c first, while this process holds no model: the memory part 1 frees stays with the
    # process (keep_freed_host_memory); at 135m, run after part 1, the stage's two ranks took
    # 7.97 s per step, run first 6.70 s (the Trainer's 6.97 and 6.87 s)
    layout_runs = bench_dag_layout(args, tokens_per_step) if args.dag_layout else {}
    ours_runs = {"ours (compile)": True, "ours (eager)": False} if args.compile else {"ours (eager)": False}
    steppers = {name: OurStep(config, state, data, section, c, device) for name, c in ours_runs.items()}
    stage_name = f"stage step{' (compile)' if args.compile else ''}"
    steppers[stage_name] = EngineStep(config, state, data, section, args.compile)
    # the step as the default run trains: the schema's torch_compile (off; its description says why)
    dag_compile = pretrain_section()["torch_compile"]
    dag_name = "stage step (DAG defaults)"
    if dag_compile != args.compile:
        steppers[dag_name] = EngineStep(config, state, data, section, dag_compile)
    warm = {}
    for name, stepper in steppers.items():  # warm up (and compile) before the paired steps
        times = [stepper.step() for _ in range(args.warmup_steps)]
        warm[name] = (times[0], sum(times))
    runs: dict[str, dict[str, Any]] = {}
    runs["hf trainer (eager)"], paired = bench_hf(config, state, data, section, args.warmup_steps, args.steps,
                                                  False, list(steppers.values()), device=device)
    for (name, stepper), times in zip(steppers.items(), paired):
        runs[name] = _summary(*warm[name], times, first_loss=stepper.losses[0], last_loss=stepper.losses[-1])
    first = next(iter(steppers))
    if args.hf_compile:  # a second pairing: compiled Trainer against our compiled (or eager) step
        runs["hf trainer (compile)"], (times,) = bench_hf(config, state, data, section, args.warmup_steps,
                                                          args.steps, True, [steppers[first]], device=device)
        runs[f"{first}, paired with hf compile"] = _summary(0.0, 0.0, times)
    runs.update(layout_runs)
    profile = None
    if args.profile:
        name = dag_name if dag_name in steppers else stage_name
        profile = bench_profile(name, steppers[name], config, state, data, section, args.profile_steps,
                                hf_median_ms=runs["hf trainer (eager)"]["median_step_s"] * 1e3)
    peaks.append(peak_bf16_matmul_flops(device))
    peak = max(peaks)
    for r in runs.values():
        r["tokens_per_s"] = r.get("tokens_per_step", tokens_per_step) / r["median_step_s"]
        r["mfu"] = r["tokens_per_s"] * fpt["total"] / peak
    ours = runs["ours (compile)" if args.compile else "ours (eager)"]
    hf = runs["hf trainer (eager)"]
    ratios = {"ours/hf (tokens/s)": ours["tokens_per_s"] / hf["tokens_per_s"],
              "ours/hf (min step time)": hf["min_step_s"] / ours["min_step_s"]}
    ratios["stage step/hf (tokens/s)"] = runs[stage_name]["tokens_per_s"] / hf["tokens_per_s"]
    dag = runs.get(dag_name, runs[stage_name])
    ratios["stage step with the DAG's defaults/hf (tokens/s)"] = dag["tokens_per_s"] / hf["tokens_per_s"]
    if args.compile:
        ratios["ours eager/hf eager"] = runs["ours (eager)"]["tokens_per_s"] / runs["hf trainer (eager)"]["tokens_per_s"]
    if layout_runs:  # part 1c: (stage, Trainer) in the default run's ranks; and the stage there against
        stage, trainer = layout_runs.values()  # the Trainer's faster layout of the two
        ratios["stage in the DAG's layout/hf in the same layout (tokens/s)"] = (stage["tokens_per_s"]
                                                                                / trainer["tokens_per_s"])
        ratios["stage in the DAG's layout/hf's faster layout (tokens/s)"] = stage["tokens_per_s"] / max(
            trainer["tokens_per_s"], hf["tokens_per_s"])
    if args.hf_compile:
        ratios["ours/hf, both compiled"] = (runs[f"{first}, paired with hf compile"]["tokens_per_s"]
                                            / runs["hf trainer (compile)"]["tokens_per_s"])

    result: dict[str, Any] = {
        "machine": machine_info(device=args.device,
                                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None),
        "settings": {"device": args.device, "flavour": args.flavour, "vocab_size": config.vocab_size,
                     "batch_size": args.batch_size,
                     "seq_len": args.seq_len, "steps": args.steps, "warmup_steps": args.warmup_steps,
                     "compile": args.compile, "hf_compile": args.hf_compile, "bf16": True,
                     "max_grad_norm": section["max_grad_norm"], "num_parameters": config.num_parameters(),
                     "tokens_per_step": tokens_per_step, "profile_steps": args.profile_steps if args.profile else 0,
                     "keep_freed_host_memory": kept,
                     "dag_layout_rounds": args.layout_rounds if args.dag_layout else 0},
        "flops_per_token": fpt,
        "mfu_formula": "tokens_per_s * (6 * n_matmul_params + 12 * L * H * head_dim * seq_len) / peak_flops",
        "peak_flops": peak, "peak_flops_samples": peaks,
        "runs": runs,
        "ours": {"tokens_per_s": ours["tokens_per_s"], "mfu": ours["mfu"]},
        "hf": {"tokens_per_s": runs["hf trainer (eager)"]["tokens_per_s"], "mfu": runs["hf trainer (eager)"]["mfu"]},
        "ratio": ratios["ours/hf (tokens/s)"], "ratios": ratios,
        "memory": [], "memory_settings": None, "profile": profile,
    }
    if not args.skip_memory:
        result["memory"] = bench_memory(args)
        result["memory_settings"] = {"flavour": args.memory_flavour, "bf16": args.memory_bf16,
                                     "steps": args.memory_steps, "world_size": 2,
                                     "num_parameters": result["memory"][0]["num_parameters"]}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/train_throughput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", default="tiny", help="model flavour of the throughput runs (default tiny), or 135m "
                   "(SmolLM2-135M's shape and vocabulary)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary (default 4096, the default experiment's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (per_device_train_batch_size)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (pretrain.max_length)")
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps per run")
    p.add_argument("--warmup-steps", type=int, default=3, help="unmeasured steps before them (>= 1; the first compiles)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile our model (the proposed pretrain key torch_compile); eager is run as well")
    p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=False,
                   help="also run the Trainer with TrainingArguments(torch_compile=True)")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="malloc keeps freed memory for the next step, as training jobs do "
                   "(stages.training.allocator), for both sides; --no-keep-freed-memory: glibc's defaults")
    p.add_argument("--profile", action="store_true", help="also profile the stage step with the DAG's defaults and "
                   "the Trainer: ms per step by operator kind (matmul, attention, loss, other)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per run with --profile")
    p.add_argument("--dag-layout", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the stage step in the default run's layout (config/config.yaml: two ranks, "
                   "ZeRO stage1) against the Trainer in the same ranks (DDP)")
    p.add_argument("--layout-rounds", type=int, default=2, help="alternating (stage, Trainer) rounds of --dag-layout")
    p.add_argument("--layout-sharding", choices=SHARDINGS, help="the stage's ZeRO setting in --dag-layout instead of "
                   "config/config.yaml's (stage1)")
    p.add_argument("--skip-memory", action="store_true", help="skip the 2-rank DeepSpeed memory part")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where part 1 trains (cuda: one GPU, bf16 autocast / DeepSpeed bf16 there, peak from "
                   "8192-wide products; parts 1c and 2 are CPU layouts and are skipped, --profile is CPU-only)")
    p.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=SHARDINGS,
                   help="ZeRO settings of the memory part (default: all)")
    p.add_argument("--memory-flavour", default="tiny", help="model flavour of the memory part (default tiny)")
    p.add_argument("--memory-steps", type=int, default=3, help="engine steps per memory run (>= 2)")
    p.add_argument("--memory-bf16", action="store_true", help="DeepSpeed bf16 in the memory part (pretrain.bf16)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--memory-worker", choices=SHARDINGS, help=argparse.SUPPRESS)  # internal: one torchrun rank
    p.add_argument("--memory-dir", help=argparse.SUPPRESS)
    p.add_argument("--layout-worker", choices=("stage", "hf"), help=argparse.SUPPRESS)  # internal: one rank
    p.add_argument("--layout-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.steps, args.warmup_steps, args.profile_steps, args.layout_rounds) < 1 or args.memory_steps < 2:
        p.error(f"--steps={args.steps}, --warmup-steps={args.warmup_steps}, --profile-steps={args.profile_steps} "
                f"and --layout-rounds={args.layout_rounds} must be >= 1, --memory-steps={args.memory_steps} >= 2")
    if args.device == "cuda":
        if args.profile:
            p.error("--profile sums CPU self time by operator: CPU only")
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no GPU")
        args.dag_layout, args.skip_memory = False, True  # gloo ranks on the CPU's cores: not a GPU layout
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_worker:
        memory_worker(args)
        return 0
    if args.layout_worker:
        layout_worker(args)
        return 0
    return finish(args.out, run(args), format_report)


if __name__ == "__main__":
    sys.exit(main())
