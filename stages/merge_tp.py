"""Merge tensor/pipeline-parallel slices into the single-device Hugging Face layout (PaddleNLP's
`merge_tp_params`).

Input: a directory written with `unified_checkpoint: false` — the pretrain stage's sharded output
(`results/<experiment>/pretrain_shards`) or a sharded training checkpoint (`checkpoint-<step>`).
Its `checkpoint_index.json` lists, per tensor, the file of each tensor-parallel slice and the
`partition_dim` to join them along; pipeline stages hold disjoint tensors. Output: config.json,
safetensors weights (fp32, sharded with an index past 2 GiB), the tokenizer, train_log.csv, its
TensorBoard event files and meta.json when the input has them. Nothing is loaded with pickle; the
output appears atomically.

    python -m stages.merge_tp --shards results/llama/pretrain_shards --out results/llama/pretrain
"""

from __future__ import annotations

import argparse

from stages.errors import run_cli
from stages.stage_logs import configure_logging
from stages.training.shard_merge import merge

__all__ = ["main", "merge"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.merge_tp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True, help="directory written with unified_checkpoint: false")
    parser.add_argument("--out", required=True, help="output directory of the HF-layout model")
    args = parser.parse_args(argv)
    configure_logging()
    merge(args.shards, args.out)
    return 0


if __name__ == "__main__":
    run_cli(main, "merge_tp")
