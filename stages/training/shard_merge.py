"""Tensor/pipeline-parallel slices joined into the single-device Hugging Face layout (PaddleNLP's
`merge_tp_params`): the work of `stages.merge_tp`, and of `stages.merge` for a sharded base.

Input: a directory written with `unified_checkpoint: false` (the pretrain stage's sharded output or
a sharded training checkpoint); its `checkpoint_index.json` lists, per tensor, the file of each
tensor-parallel slice and the `partition_dim` to join them along; pipeline stages hold disjoint
tensors. Output: config.json, safetensors weights (fp32, sharded with an index past 2 GiB), the
tokenizer, train_log.csv, its TensorBoard event files and meta.json when the input has them.
Nothing is loaded with pickle; the output appears atomically.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from stages.checkpoint.atomic import atomic_dir, write_json
from stages.checkpoint.hf import save_state_dict
from stages.checkpoint.integrity import verify, weight_records
from stages.checkpoint.store import COMPLETE, INDEX, SHARDED, StateReader, problems
from stages.checkpoint.tokenizer_files import TOKENIZER_FILES
from stages.errors import InputError
from stages.model import gpt2_layout
from stages.stage_logs import log_io
from stages.training.log import event_files

log = logging.getLogger(__name__)
_CARRIED = ("config.json", "generation_config.json", "train_log.csv", *TOKENIZER_FILES)


def merge(shards_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write the merged HF-layout model of `shards_dir` into `out_dir`; returns what was merged."""
    shards_dir, out_dir = Path(shards_dir), Path(out_dir)
    log_io("merge_tp", reads={"tensor/pipeline-parallel slices": shards_dir}, writes={"HF-layout model": out_dir},
           logger=log)
    if not (shards_dir / INDEX).is_file():
        raise FileNotFoundError(f"{shards_dir / INDEX} is missing: {shards_dir} was not written by a training "
                                "run with unified_checkpoint: false")
    reader = StateReader(shards_dir)
    # a training checkpoint has a completion marker; a stage output was swapped in whole
    found = problems(shards_dir) if (shards_dir / COMPLETE).exists() else verify(shards_dir, reader.index["files"])
    if found:
        raise InputError(f"cannot merge {shards_dir}: " + "; ".join(found))
    state = {name: reader.get(name) for name in reader.keys("model")}
    config_path = shards_dir / "config.json"
    if reader.index.get("hf_layout") != "gpt2" and config_path.exists() \
            and json.loads(config_path.read_text()).get("model_type") == "gpt2":
        state = gpt2_layout.to_hf(state)  # the slices keep our names; the HF layout has GPT-2's
    split = sorted(k for k, parts in reader.tensors.items() if len(parts) > 1 and parts[0]["file"].startswith("model"))
    summary = {"format": reader.index["format"], "tensors": len(state), "merged_tensor_parallel": len(split),
               "files": len(reader.index["files"])}
    with atomic_dir(out_dir) as tmp:
        save_state_dict(state, tmp)
        for name in _CARRIED:
            if (shards_dir / name).exists():
                shutil.copy2(shards_dir / name, tmp / name)
        for path in event_files(shards_dir):
            shutil.copy2(path, tmp / path.name)
        if (shards_dir / "meta.json").exists():
            meta = json.loads((shards_dir / "meta.json").read_text())
            meta["merged_from"] = {"path": str(shards_dir), **summary}
            meta["files"] = weight_records(tmp)  # the merged weights, which later stages verify
            write_json(tmp / "meta.json", meta)
    reader.close()
    log.info("merge_tp: %d tensors (%d joined along partition_dim) from %s -> %s", len(state), len(split),
             shards_dir, out_dir)
    if summary["format"] != SHARDED:
        log.info("merge_tp: %s was already unified; copied tensor for tensor", shards_dir)
    return summary
