"""Host memory of building a training rank's model: whole-then-sliced against lazy (meta device,
only this rank's slice filled; `stages.training.materialize`), measured in the same run.

For each layout (default tp2 and pp2 over 2 gloo processes) and each way of building, two fresh
processes build the flavour's model from a seed exactly as the engine does before DeepSpeed takes
it: `eager` builds the whole fp32 model (`build_model`) and lets `stages.training.parallelize` slice it;
`lazy` builds it on the meta device, slices it there and materializes this rank's slice. Each rank
reports its peak resident set (`ru_maxrss`) above what it held before building (the interpreter
and libraries), the bytes of the parameters it keeps, and the build time. Every filled tensor is
written, so RSS sees all of it. The two ways hold bit-identical weights (tests/unit/test_materialize.py).

    .venv/bin/python bench/lazy_build.py                       # 1b (untied), tp2 and pp2, ~2 min
    .venv/bin/python bench/lazy_build.py --flavour tiny --layouts tp2

Prints a table and writes JSON (default bench/out/lazy_build.json).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import machine_info  # noqa: E402
from stages.checkpoint.atomic import write_json  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "lazy_build.json"
LAYOUTS = {"tp2": {"tensor_parallel_degree": 2}, "pp2": {"pipeline_parallel_degree": 2}}
GB = 1e9


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rank(rank: int, world: int, port: int, out_dir: str, flavour: str, layout: str, mode: str) -> None:
    import torch.distributed as dist

    from stages.model import build_model, config_for_flavour
    from stages.parallel.topology import Topology
    from stages.training.parallelize import parallel_degrees, parallelize
    from stages.training.materialize import lazy_model, materialize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    section = {"world_size": world, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
               "virtual_pp_degree": 1, "sharding": "none", "tensor_parallel_output": False, "recompute": False,
               "torch_compile": False, "gradient_accumulation_steps": 2, **LAYOUTS[layout]}
    topology = Topology(parallel_degrees(section))
    config = config_for_flavour(flavour, vocab_size=32000, tie_word_embeddings=False)
    before, start = _rss_bytes(), time.perf_counter()
    if mode == "eager":
        module, _ = parallelize(build_model(config, seed=1), section, topology)
    else:
        model = lazy_model(config, seed=1)
        source = model.weight_source
        module, runner = parallelize(model, section, topology)
        materialize(module, source, module.full_names() if runner is not None else {},
                    topology.coordinates["tensor"], section["tensor_parallel_degree"])
    seconds = time.perf_counter() - start
    kept = sum(p.numel() * p.element_size() for p in module.parameters())
    torch.save({"peak_above_start": _rss_bytes() - before, "kept": kept, "seconds": seconds},
               Path(out_dir) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def measure(flavour: str, layout: str, mode: str) -> dict:
    from stages.model import build_model, config_for_flavour

    with tempfile.TemporaryDirectory() as out_dir:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, out_dir, flavour, layout, mode), nprocs=2, join=True)
        ranks = [torch.load(Path(out_dir) / f"{r}.pt", weights_only=True) for r in range(2)]
    config = config_for_flavour(flavour, vocab_size=32000, tie_word_embeddings=False)
    whole = 4 * sum(p.numel() for p in build_model(config, device="meta").parameters())
    return {"flavour": flavour, "layout": layout, "mode": mode, "whole_model_bytes": whole,
            "peak_above_start_bytes": max(r["peak_above_start"] for r in ranks),
            "kept_bytes": max(r["kept"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", default="1b")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for layout in args.layouts:
        for mode in ("eager", "lazy"):
            rows.append(measure(args.flavour, layout, mode))
            r = rows[-1]
            print(f"measured {layout} {mode}: peak {r['peak_above_start_bytes'] / GB:.2f} GB, {r['seconds']:.1f} s",
                  flush=True)
    print(f"\n{args.flavour} (untied, vocabulary 32000): whole fp32 model {rows[0]['whole_model_bytes'] / GB:.2f} GB; "
          "per rank, the larger of the 2 ranks")
    print(f"{'layout':<8}{'eager peak GB':>15}{'lazy peak GB':>14}{'lazy/eager':>12}{'kept GB':>10}"
          f"{'eager s':>10}{'lazy s':>9}")
    summary = []
    for layout in args.layouts:
        eager, lazy = (next(r for r in rows if r["layout"] == layout and r["mode"] == m) for m in ("eager", "lazy"))
        ratio = lazy["peak_above_start_bytes"] / eager["peak_above_start_bytes"]
        summary.append({"layout": layout, "lazy_over_eager_peak": ratio})
        print(f"{layout:<8}{eager['peak_above_start_bytes'] / GB:>15.2f}{lazy['peak_above_start_bytes'] / GB:>14.2f}"
              f"{ratio:>12.2f}{lazy['kept_bytes'] / GB:>10.2f}{eager['seconds']:>10.1f}{lazy['seconds']:>9.1f}")
    write_json(args.out, {"machine": machine_info(), "rows": rows, "summary": summary})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
