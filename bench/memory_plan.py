"""Measured peak training memory against the memory planner's estimate
(`stages.planning.memory.estimate_memory`), per layout, for the small flavours on CPU (and, with
`--device cuda`, for the `1b` flavour on one GPU).

Each case is a few real optimizer steps of the training engine (`stages.training.engine`:
`parallelize`, `build_engine` with the stage's own DeepSpeed config, `train_step`). On CPU: 2 gloo
processes, for sharding none / stage1 / stage2 / stage3 (2 data-parallel ranks), tensor
parallelism 2 (also with sequence parallelism), context parallelism 2 (both modes), pipeline
parallelism 2 (1F1B), activation recompute, bf16 (DeepSpeed's mixed-precision paths, as a GPU runs
them) and LoRA / prefix tuning on a frozen base. All cases of
a run share one pair of processes (importing torch and DeepSpeed takes ~45 s per process on this
machine), one case after the other, those with ZeRO-3 last (it replaces
`torch.nn.functional.linear` for the rest of the process). The estimate is asked for `device="cpu"`, how this machine
runs them.

How memory is measured on CPU: the peak of **live tensor bytes** on each rank, from the
allocator's own records. `torch.profiler` with `profile_memory=True` logs every CPU allocation and
free with its size and address (what `torch.cuda.max_memory_allocated` counts on a GPU, here for
the CPU allocator); summed in time order they give the bytes held by live tensors at every moment.
The profiler starts before the model is built, so every tensor of the case is seen from its birth;
the peak is taken over the training steps (setup, when each rank still holds the whole model
before tensor or pipeline parallelism slices it, is reported apart). The profiler records an event
only on the thread that runs it: a buffer whose last reference a gloo worker thread drops is freed
unseen, which would inflate the timeline; `live_timeline` puts such frees back (see there). RSS
was not used: it also holds the interpreter, the libraries and gloo's buffers (~400 MiB per
process, more than the small models), and it does not see a buffer allocated with `torch.empty`
until its pages are written, so DeepSpeed's 5e8-element gradient bucket (2 GB in fp32, real on a
GPU) would be invisible.

Because that bucket dwarfs the small models, every row is reported twice: whole, and without the
buckets (`--` columns: the measured timeline without the allocations of exactly the bucket's size,
against the estimate with `reduce_bucket_size=0`); the 20% target must hold on both. Beside the
peak, a census of what each rank holds just before its last optimizer step (distinct tensor
storages by role) is compared with the estimate's parameters, gradients and optimizer state at
the step.

With `--device cuda` (one GPU) each case runs in a fresh process as a world of one (DeepSpeed
still partitions, over one rank), the peak read from `torch.cuda.max_memory_allocated` over the
training steps, against the estimate for `device="cuda"`.

    .venv/bin/python bench/memory_plan.py                      # tiny + debug, 13 cases each, ~1.5-4 min
    .venv/bin/python bench/memory_plan.py --cases tp2 tp2_sp tp2_sp_recompute   # sequence parallelism
    .venv/bin/python bench/memory_plan.py --flavours tiny@4k --cases none cp2 cp2_ulysses cp2_ring --steps 2  # 4k
    .venv/bin/python bench/memory_plan.py --flavours debug --cases stage1 stage3 --steps 2
    .venv/bin/python bench/memory_plan.py --device cuda        # 1b on one GPU, ~6 min
    .venv/bin/python bench/memory_plan.py --help

Prints a table and writes JSON (default bench/out/memory_plan.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from stages.model import counted_tokens  # noqa: E402
from stages.planning.memory import REDUCE_BUCKET_SIZE, MiB, bucket_bytes, estimate_phases  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "memory_plan.json"
WORLD_SIZE = {"cpu": 2, "cuda": 1}  # ranks per case

# The layouts measured: what trains ("full": the pretrain section; "lora", "prefix": the finetune
# section of that method, base frozen) and the section's overrides on top of the flavour's batch.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("full", dict(sharding="none")),
    "stage1": ("full", dict(sharding="stage1")),
    "stage2": ("full", dict(sharding="stage2")),
    "stage3": ("full", dict(sharding="stage3")),
    "tp2": ("full", dict(sharding="none", tensor_parallel_degree=2)),
    "tp2_sp": ("full", dict(sharding="none", tensor_parallel_degree=2, sequence_parallel=True)),
    "tp2_sp_recompute": ("full", dict(sharding="none", tensor_parallel_degree=2, sequence_parallel=True,
                                      recompute=True)),
    "cp2": ("full", dict(sharding="none", context_parallel_degree=2)),
    "cp2_recompute": ("full", dict(sharding="none", context_parallel_degree=2, recompute=True)),
    "cp2_ulysses": ("full", dict(sharding="none", context_parallel_degree=2, context_parallel_mode="ulysses")),
    "cp2_ring": ("full", dict(sharding="none", context_parallel_degree=2, context_parallel_mode="ring")),
    "pp2": ("full", dict(sharding="none", pipeline_parallel_degree=2)),
    # a mixture of experts' experts split over the 2 ranks (moe-* flavours only)
    "ep2": ("full", dict(sharding="none", expert_parallel_degree=2)),
    "ep2_stage1": ("full", dict(sharding="stage1", expert_parallel_degree=2)),
    "stage1_recompute": ("full", dict(sharding="stage1", recompute=True)),
    # mixed precision: the DeepSpeed paths a GPU run takes (bf16 weights, fp32 masters)
    "none_bf16": ("full", dict(sharding="none", bf16=True)),
    "stage1_bf16": ("full", dict(sharding="stage1", bf16=True)),
    "stage2_bf16": ("full", dict(sharding="stage2", bf16=True)),
    "stage3_bf16": ("full", dict(sharding="stage3", bf16=True)),
    "stage1_bf16_recompute": ("full", dict(sharding="stage1", bf16=True, recompute=True)),
    "stage2_bf16_offload": ("full", dict(sharding="stage2", bf16=True, sharding_offload=True)),
    # adapters on a frozen base (finetune.lora / .prefix defaults: rank 16 on every projection,
    # 16 prefix tokens)
    "lora_stage1": ("lora", dict(sharding="stage1")),
    "lora_bf16": ("lora", dict(sharding="none", bf16=True)),
    # LoRA on a mixture of experts' routed experts too (moe-* flavours only)
    "lora_experts_stage1": ("lora", dict(sharding="stage1", target_parameters=["gate_up_proj", "down_proj"])),
    "prefix_tp2": ("prefix", dict(sharding="none", tensor_parallel_degree=2)),
    "prefix_stage3": ("prefix", dict(sharding="stage3")),
}
DEFAULT_CASES = {
    "cpu": ["none", "stage1", "stage2", "stage3", "tp2", "tp2_sp", "cp2", "pp2", "stage1_recompute", "none_bf16",
            "stage2_bf16", "lora_stage1", "prefix_tp2", "prefix_stage3"],
    "cuda": ["none", "none_bf16", "stage1_bf16", "stage2_bf16", "stage3_bf16", "stage1_bf16_recompute",
             "stage2_bf16_offload", "lora_bf16"],
}
# Per flavour: the vocabulary and the batch of every case (micro-batch x accumulation x tokens);
# "<flavour>@<tokens>" is that model flavour at another length (`model_flavour`).
FLAVOURS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=4096, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=256),
    # long rows, for context parallelism's activations against one rank's (`--cases none cp2`)
    "tiny@4k": dict(vocab_size=4096, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_length=4096),
    "debug": dict(vocab_size=512, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=64),
    "moe-tiny": dict(vocab_size=4096, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=256),
    "1b": dict(vocab_size=32000, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=1024),
}
DEFAULT_FLAVOURS = {"cpu": ["tiny", "debug"], "cuda": ["1b"]}
TARGET = 0.20  # |estimate / measured - 1| at most this, for every case


def model_flavour(flavour: str) -> str:
    """The model flavour of a FLAVOURS entry: "tiny@4k" is the tiny model."""
    return flavour.split("@")[0]


def training_section(flavour: str, case: str, steps: int, device: str = "cpu") -> dict[str, Any]:
    """The validated training section of `case` for `flavour` (schema defaults otherwise): the
    pretrain section, or the finetune section of the case's adapter method."""
    from stages.config import check_config

    trained, overrides = CASES[case]
    settings = {k: v for k, v in FLAVOURS[flavour].items() if k != "vocab_size"}
    section = dict(world_size=WORLD_SIZE[device], max_steps=steps, warmup_steps=0, **{**settings, **overrides})
    model = {"flavour": model_flavour(flavour)}  # checked against the model's shape (expert parallelism: a mixture)
    if trained == "full":
        return check_config({"experiments": {"bench": {"model": model, "pretrain": section}}})[
            "experiments"]["bench"]["pretrain"]
    section["src_length"] = section["max_length"] // 2  # below max_length, as fine-tuning requires
    config = check_config({"experiments": {"bench": {"model": model, "finetune": {trained: section}}}})
    return config["experiments"]["bench"]["finetune"][trained]


# -- what a rank holds ------------------------------------------------------------------------------

def _storage(t) -> tuple[int, int] | None:
    """(data pointer, bytes) of a tensor's storage; None for empty and meta tensors (no memory)."""
    s = t.untyped_storage()
    return None if s.nbytes() == 0 or t.device.type == "meta" else (s.data_ptr(), s.nbytes())


def _tensors_in(obj: Any, depth: int, seen: set[int]):
    """Every tensor (and its .grad) reachable from `obj` through DeepSpeed attributes, lists and dicts."""
    import torch

    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, (list, tuple, set)):
        for x in obj:
            yield from _tensors_in(x, depth - 1, seen)
    elif isinstance(obj, dict):
        for x in list(obj.keys()) + list(obj.values()):
            yield from _tensors_in(x, depth - 1, seen)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _tensors_in(x, depth - 1, seen)


def census(engine) -> dict[str, int]:
    """Bytes of distinct tensor storages this rank holds, by role: `parameters` (the module's
    parameters; ZeRO-3: their `ds_tensor` shards and the small parameters kept whole), `gradients`
    (`p.grad` and every ZeRO buffer whose attribute name says grad), `optimizer` (the torch
    optimizer's state and ZeRO's fp32 master partitions), `other` (anything else reachable from
    the optimizer wrapper: communication buckets). A storage shared by several views counts once."""
    counted: set[tuple[int, int]] = set()
    out = {"parameters": 0, "gradients": 0, "optimizer": 0, "other": 0}

    def add(role: str, t) -> None:
        key = _storage(t) if t is not None else None
        if key is not None and key not in counted:
            counted.add(key)
            out[role] += key[1]

    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    for p in engine.module.parameters():
        add("parameters", getattr(p, "ds_tensor", None))
        add("parameters", p.data)
    for p in engine.module.parameters():
        add("gradients", p.grad)
    for state in inner.state.values():
        for t in state.values():
            add("optimizer", t)
    for group in inner.param_groups:  # what the torch optimizer updates: ZeRO's fp32 masters
        for p in group["params"]:
            add("optimizer", p)
            add("gradients", p.grad)
    if zero is not inner:
        for name, value in vars(zero).items():
            role = "gradients" if "grad" in name else "optimizer" if "fp32" in name else None
            if role is not None:
                for t in _tensors_in(value, 4, set()):
                    add(role, t)
        for t in _tensors_in(zero, 5, set()):
            add("other", t)
    return out


def live_pointers() -> set[int]:
    """Data pointers of every storage a Python-visible tensor holds now."""
    import torch

    pointers = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                key = _storage(obj)
            except (RuntimeError, NotImplementedError):  # tensors without a storage of their own
                continue
            if key is not None:
                pointers.add(key[0])
    return pointers


AUTOGRAD_NODE = "autograd::engine::evaluate_function"  # the profiler's span of one backward node


def memory_events(prof) -> tuple[list[tuple[float, int, int]], dict[str, list[tuple[float, float]]]]:
    """The profiler's allocations and frees as (time, bytes (+ alloc, - free), address) in time
    order, and the (start, end) times of the spans of each name: our `record_function` spans
    (`phase:*`, `call:*`) and autograd's backward nodes (under AUTOGRAD_NODE). Read from the Chrome
    trace: its memory events carry the address, which matches a free to its allocation."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    allocs = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in events if e.get("name") == "[memory]")
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith(("phase:", "call:", AUTOGRAD_NODE)):
            key = AUTOGRAD_NODE if name.startswith(AUTOGRAD_NODE) else name
            spans.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"]))
    return allocs, spans


def live_timeline(allocs, spans, alive: set[int], skip_sizes: frozenset[int] = frozenset()):
    """(time, +/- bytes) of every allocation and free of this rank's training thread, in order.

    The profiler records an allocator event only on the thread that runs it, so a tensor whose
    last reference is dropped by a gloo worker thread (a buffer handed to a synchronous collective,
    which the worker lets go of just after the caller has moved on) is freed without a record.
    Such a missed free shows up as an address allocated again before its free, or as an
    allocation never freed whose address no live tensor holds at the end. It is put at the end of
    the innermost span that allocated it (a backward node, or an engine call: backward, all-reduce,
    step, pipeline schedule), when its collective has completed, or at the reuse if that comes
    first. Frees of memory allocated before profiling are ignored; allocations of a size in
    `skip_sizes` (communication buckets) are left out. Returns the timeline and the bytes repaired."""
    calls = sorted(iv for name, ivs in spans.items() if name.startswith(("call:", AUTOGRAD_NODE)) for iv in ivs)
    end = allocs[-1][0] if allocs else 0.0

    def call_end(ts: float) -> float:
        inside = [b for a, b in calls if a <= ts <= b]
        return min(inside) if inside else ts

    open_: dict[int, tuple[float, int]] = {}
    timeline, repaired = [], 0
    for ts, size, addr in allocs:
        if size > 0:
            if size in skip_sizes:
                continue
            if addr in open_:  # the previous occupant was freed unseen
                at, old = open_.pop(addr)
                timeline.append((min(call_end(at), ts), -old))
                repaired += old
            open_[addr] = (ts, size)
            timeline.append((ts, size))
        elif addr in open_ and open_[addr][1] == -size:
            open_.pop(addr)
            timeline.append((ts, size))
    for addr, (at, size) in open_.items():
        if addr not in alive:
            timeline.append((min(call_end(at), end), -size))
            repaired += size
    timeline.sort()
    return timeline, repaired


def peaks(timeline: list[tuple[float, int]], start: float) -> dict[str, int]:
    """Peak live bytes before `start` (setup) and from `start` on (training), live bytes at `start`
    and at the end."""
    live = setup = train = at_start = 0
    started = False
    for ts, size in timeline:
        if not started and ts >= start:
            started, at_start, train = True, live, live
        live += size
        if started:
            train = max(train, live)
        else:
            setup = max(setup, live)
    return {"setup_peak": setup, "train_peak": train, "live_at_first_step": at_start, "live_at_end": live}


def _traced(obj, name: str) -> None:
    """Wrap method `name` of `obj` (on the instance) in a `call:<name>` profiler span."""
    from torch.profiler import record_function

    method = getattr(obj, name)

    def traced(*args, **kwargs):
        with record_function(f"call:{name}"):
            return method(*args, **kwargs)

    setattr(obj, name, traced)


# -- running one case on one rank -------------------------------------------------------------------

def build(flavour: str, case: str, section: dict[str, Any], topology):
    """The model of `flavour` (with the case's adapter), parallelised and wrapped by DeepSpeed
    exactly as the training stages do; returns (engine, pipeline runner or None, clip)."""
    from stages.model import build_model, config_for_flavour
    from stages.training.deepspeed_engine import build_engine
    from stages.training.parallelize import parallelize

    model = build_model(config_for_flavour(model_flavour(flavour), vocab_size=FLAVOURS[flavour]["vocab_size"]),
                        seed=0)
    if CASES[case][0] != "full":
        from stages.adapters import attach_adapter

        attach_adapter(model, CASES[case][0], section)  # freezes the base, in place
    module, runner = parallelize(model, section, topology)
    del model  # a pipeline rank keeps only its chunks
    engine, _, _, clip = build_engine(module, section, topology, pipeline=runner is not None)
    return engine, runner, clip


def random_batches(flavour: str, section: dict[str, Any], topology, steps: int, seed: int) -> list:
    """Per step, this rank's micro-batches of random token ids (every token learned)."""
    import torch

    micro, accum, seq = (section["per_device_train_batch_size"], section["gradient_accumulation_steps"],
                         section["max_length"])
    generator = torch.Generator().manual_seed(seed + topology.get_batch_rank())  # context ranks: the same rows
    vocab = FLAVOURS[flavour]["vocab_size"]
    return [[(ids, ids) for ids in (torch.randint(0, vocab, (micro, seq), generator=generator) for _ in range(accum))]
            for _ in range(steps)]


def count_before_last_step(engine, steps: int) -> dict[str, dict[str, int]]:
    """Make `engine.step` take the census just before the last optimizer step (gradients and the
    optimizer state both live); the census lands in the returned dict under "held"."""
    held: dict[str, dict[str, int]] = {}
    real_step = engine.step

    def step_and_count() -> None:
        if engine.is_gradient_accumulation_boundary() and engine.global_steps == steps - 1:
            held["held"] = census(engine)
        real_step()

    engine.step = step_and_count
    return held


def train(engine, runner, clip, batches: list, topology, section: dict[str, Any]) -> None:
    """The training steps, each in a `phase:step<i>` profiler span."""
    from torch.profiler import record_function

    from stages.training.step import learned_tokens, train_step

    dp = topology.get_data_parallel_world_size()
    tp_group = topology.tp_group if section["tensor_parallel_degree"] > 1 and section["tensor_parallel_output"] \
        else None
    engine.train()
    for index, step_batches in enumerate(batches):
        with record_function(f"phase:step{index}"):
            if engine.device.type == "cpu":
                tokens = learned_tokens(step_batches, topology.get_data_parallel_group(),
                                        copies=topology.get_context_parallel_world_size())
            else:  # NCCL takes no CPU tensor for learned_tokens' all-reduce; a world of one counts alone
                tokens = sum(int(counted_tokens(labels)) for _, labels in step_batches)
            train_step(engine, runner, step_batches, tokens, dp, clip, tp_group)


def measure_case(flavour: str, case: str, steps: int, device: str, seed: int = 1) -> dict[str, Any]:
    """Build, parallelise and train `case` for `steps` optimizer steps on this rank; returns the
    rank's peaks (CPU: from the profiler's timeline, whole and without buckets; CUDA: from the
    allocator's statistics), the census before the last step and the time taken."""
    from stages.parallel import Topology
    from stages.training.parallelize import parallel_degrees

    section = training_section(flavour, case, steps, device)
    topology = Topology(parallel_degrees(section))
    batches = random_batches(flavour, section, topology, steps, seed)
    gc.collect()
    started = time.perf_counter()
    run = _measure_cuda if device == "cuda" else _measure_cpu
    measured, without, held = run(flavour, case, section, topology, batches)
    return {"case": case, "flavour": flavour, "rank": topology.rank, "seconds": round(time.perf_counter() - started, 2),
            "measured": measured, "measured_without_buckets": without, "held": held}


def _measure_cpu(flavour: str, case: str, section: dict[str, Any], topology, batches: list):
    """The CPU measurement: everything from the model's build on under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine, runner, clip = build(flavour, case, section, topology)
        held = count_before_last_step(engine, len(batches))
        for name in ("backward", "allreduce_gradients", "step"):
            _traced(engine, name)
        if runner is not None:
            _traced(runner, "train_step")
        train(engine, runner, clip, batches, topology, section)
    alive = live_pointers()
    allocs, spans = memory_events(prof)
    first = spans["phase:step0"][0][0]
    whole, repaired = live_timeline(allocs, spans, alive)
    without, _ = live_timeline(allocs, spans, alive, frozenset(bucket_bytes(section)))
    del engine, runner, prof
    gc.collect()
    return {**peaks(whole, first), "repaired_frees_bytes": repaired}, peaks(without, first), held.get("held")


def _measure_cuda(flavour: str, case: str, section: dict[str, Any], topology, batches: list):
    """The GPU measurement: the allocator's peak over the training steps (setup's apart)."""
    import torch

    base = torch.cuda.memory_allocated()
    engine, runner, clip = build(flavour, case, section, topology)
    held = count_before_last_step(engine, len(batches))
    torch.cuda.synchronize()
    setup_peak, at_start = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    train(engine, runner, clip, batches, topology, section)
    torch.cuda.synchronize()
    measured = {"setup_peak": setup_peak, "train_peak": torch.cuda.max_memory_allocated() - base,
                "live_at_first_step": at_start, "live_at_end": torch.cuda.memory_allocated() - base}
    return measured, None, held.get("held")


def worker(rank: int, world: int, port: int, plan: list[tuple[str, str]], steps: int, device: str,
           out_dir: str) -> None:
    """One rank: every (flavour, case) of `plan` in turn, each result written as JSON to `out_dir`."""
    import torch

    torch.set_num_threads(1 if device == "cpu" else max(1, (os.cpu_count() or 2) // 2))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from stages.training.distributed import finish_distributed, init_distributed

    init_distributed()
    for flavour, case in plan:
        result = measure_case(flavour, case, steps, device)
        Path(out_dir, f"{flavour}-{case}-{rank}.json").write_text(json.dumps(result))
    finish_distributed()


def _spawn(plan: list[tuple[str, str]], steps: int, device: str, out_dir: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = WORLD_SIZE[device]
    mp.spawn(worker, args=(world, port, plan, steps, device, out_dir), nprocs=world, join=True)


def measure(plan: list[tuple[str, str]], steps: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Run `plan` and return the per-rank results. CPU: all cases in one pair of spawned gloo
    processes. CUDA: one fresh process per case, so that nothing a case leaves behind counts in the
    next one's allocator statistics."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        for part in ([plan] if device == "cpu" else [[item] for item in plan]):
            _spawn(part, steps, device, tmp)
        return [json.loads(Path(tmp, f"{f}-{c}-{r}.json").read_text())
                for f, c in plan for r in range(WORLD_SIZE[device])]


# -- estimate against measurement ---------------------------------------------------------------------

def estimates(flavour: str, case: str, steps: int, device: str, rank: int | None = None,
              bucket: bool = True) -> dict[str, Any]:
    """The estimate's phases for `case` on `device`, for pipeline rank `rank` or the worst rank;
    without DeepSpeed's bucket when `bucket` is False."""
    from stages.config import architecture

    section, trained = training_section(flavour, case, steps, device), CASES[case][0]
    return estimate_phases(architecture({"flavour": model_flavour(flavour)}), section,
                           vocab_size=FLAVOURS[flavour]["vocab_size"],
                           trained=trained, lora_rank=section.get("lora_rank"),
                           num_prefix_tokens=section.get("num_prefix_tokens"), device=device, pipeline_rank=rank,
                           reduce_bucket_size=REDUCE_BUCKET_SIZE if bucket else 0)


def compare(rows: list[dict[str, Any]], steps: int, device: str = "cpu") -> list[dict[str, Any]]:
    """One record per (flavour, case): the estimate's peak (worst rank) against the highest
    measured peak of the ranks, whole and (CPU) without buckets, and per rank the estimate's
    model states at the step against the census."""
    out = []
    for flavour, case in dict.fromkeys((r["flavour"], r["case"]) for r in rows):
        ranks = [r for r in rows if (r["flavour"], r["case"]) == (flavour, case)]
        pp = training_section(flavour, case, steps, device)["pipeline_parallel_degree"]
        whole = max(estimates(flavour, case, steps, device).values(), key=lambda e: e.total)
        measured = max(r["measured"]["train_peak"] for r in ranks)
        record = {"flavour": flavour, "case": case, "device": device, "estimate": whole.as_dict(),
                  "estimate_bytes": whole.total, "measured_bytes": measured, "ratio": whole.total / measured,
                  "estimate_without_buckets_bytes": None, "measured_without_buckets_bytes": None,
                  "ratio_without_buckets": None}
        errors = [abs(record["ratio"] - 1)]
        if device == "cpu":
            peak = max(estimates(flavour, case, steps, device, bucket=False).values(), key=lambda e: e.total)
            bare = peak.total
            measured_bare = max(r["measured_without_buckets"]["train_peak"] for r in ranks)
            record.update(estimate_without_buckets_bytes=bare, measured_without_buckets_bytes=measured_bare,
                          ratio_without_buckets=bare / measured_bare)
            errors.append(abs(record["ratio_without_buckets"] - 1))
            # the activations at the peak: the measured peak less what the estimate holds beside them
            # (the model states, which the census below checks)
            record.update(estimate_activation_bytes=peak.activations,
                          measured_activation_bytes=measured_bare - (bare - peak.activations))
        states = []
        for r in ranks:
            step = estimates(flavour, case, steps, device, rank=r["rank"] if pp > 1 else None)["step"]
            states.append({"rank": r["rank"], "held": r["held"],
                           "estimate": {k: getattr(step, k) for k in ("parameters", "gradients", "optimizer")}})
        out.append({**record, "within_target": max(errors) <= TARGET, "model_states": states, "ranks": ranks})
    return out


def format_report(records: list[dict[str, Any]]) -> str:
    """The table: per case the estimate's peak and its phase, the measured peak and their ratio,
    whole and without buckets (MiB)."""
    head = (f"{'flavour':<10}{'case':<22}{'est MiB':>10}{'meas MiB':>10}{'ratio':>7}{'-- est':>9}{'-- meas':>9}"
            f"{'-- ratio':>9}  {'phase':<9}{'within 20%':>11}")
    lines = [head, "-" * len(head)]

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / MiB:.1f}"

    for r in records:
        bare = "-" if r["ratio_without_buckets"] is None else f"{r['ratio_without_buckets']:.3f}"
        lines.append(f"{r['flavour']:<10}{r['case']:<22}{mib(r['estimate_bytes']):>10}{mib(r['measured_bytes']):>10}"
                     f"{r['ratio']:>7.3f}{mib(r['estimate_without_buckets_bytes']):>9}"
                     f"{mib(r['measured_without_buckets_bytes']):>9}{bare:>9}  "
                     f"{r['estimate']['phase']:<9}{'yes' if r['within_target'] else 'NO':>11}")
    lines.append("(-- : without DeepSpeed's 5e8-element gradient bucket, on both sides; ratio = estimate / measured)")
    lines += [f"{flavour}: {ratio}" for flavour, ratio in activation_ratios(records).items()]
    return "\n".join(lines)


def activation_ratios(records: list[dict[str, Any]], case: str = "cp2", against: str = "none") -> dict[str, str]:
    """Per flavour measured with both: the activations per rank of `case` over those of `against`,
    estimated and measured (CPU records, without buckets)."""
    by = {(r["flavour"], r["case"]): r for r in records if r.get("measured_activation_bytes") is not None}
    out = {}
    for flavour in dict.fromkeys(f for f, _ in by):
        if (flavour, case) in by and (flavour, against) in by:
            one, other = by[(flavour, case)], by[(flavour, against)]
            est = one["estimate_activation_bytes"] / other["estimate_activation_bytes"]
            meas = one["measured_activation_bytes"] / other["measured_activation_bytes"]
            out[flavour] = (f"activations per rank {case} / {against}: estimated {est:.3f}, measured {meas:.3f} "
                            f"({one['measured_activation_bytes'] / MiB:.1f} / "
                            f"{other['measured_activation_bytes'] / MiB:.1f} MiB)")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 gloo ranks per case; cuda: one GPU, a world of one (default: %(default)s)")
    parser.add_argument("--flavours", nargs="+", choices=list(FLAVOURS),
                        help=f"model flavours to measure (default: {DEFAULT_FLAVOURS})")
    parser.add_argument("--cases", nargs="+", choices=list(CASES),
                        help="layouts to measure (default: the device's list, DEFAULT_CASES)")
    parser.add_argument("--steps", type=int, default=3,
                        help="optimizer steps per case; the optimizer state exists from the second "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the optimizer state is created by the first step")
    args.flavours = args.flavours or DEFAULT_FLAVOURS[args.device]
    args.cases = args.cases or DEFAULT_CASES[args.device]
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.common import machine_info
    from stages.checkpoint.atomic import write_json

    args = parse_args(argv)
    plan = [(flavour, case) for flavour in args.flavours for case in args.cases]
    # ZeRO-3 replaces torch.nn.functional.linear for the rest of the process (DeepSpeed's
    # memory-efficient linear, which saves every input): its cases go last
    plan.sort(key=lambda item: CASES[item[1]][1].get("sharding") == "stage3")
    started = time.perf_counter()
    records = compare(measure(plan, args.steps, args.device), args.steps, args.device)
    print(format_report(records))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"machine": machine_info(),
                          "settings": {"device": args.device, "world_size": WORLD_SIZE[args.device],
                                       "steps": args.steps, "flavours": {f: FLAVOURS[f] for f in args.flavours},
                                       "cases": {c: CASES[c] for c in args.cases}, "target": TARGET},
                          "seconds": round(time.perf_counter() - started, 1), "records": records})
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
