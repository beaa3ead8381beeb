"""Run a function on a few gloo processes and collect what each rank returns (for the parallel tests).

`run_gloo(fn, world_size, *args)` spawns `world_size` processes (torch.multiprocessing, spawn
start method), initialises a gloo group on a free localhost port in each, calls
`fn(rank, world_size, *args)` and returns the list of the ranks' return values. `fn` must be a
module-level function; an exception in any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # a shared 2-core machine: one thread per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args) -> list:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=True)
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)]
