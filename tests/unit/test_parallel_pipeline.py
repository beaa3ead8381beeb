"""Pipeline parallelism: the layer split, the stage modules' names, and loss/gradient parity of
pp2 (1F1B) and pp2 x vpp2 (interleaved 1F1B) with the single-process run (2 gloo ranks on CPU)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stages.model import IGNORE_INDEX, build_model, config_for_flavour
from stages.parallel.pipeline import PipelineRunner, build_stage_module, split_layers

VOCAB, BATCH, SEQ, STEPS, SEED = 96, 8, 16, 10, 1234
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# -- split_layers ------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, pp, vpp, expected", [
    (4, 2, 1, [[0, 1], [2, 3]]),
    (4, 2, 2, [[0], [1], [2], [3]]),
    (10, 4, 1, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),  # remainder on the first chunks
    (7, 1, 1, [[0, 1, 2, 3, 4, 5, 6]]),
    (8, 2, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_split_layers_balanced_contiguous(layers, pp, vpp, expected):
    chunks = split_layers(layers, pp, vpp)
    assert chunks == expected
    assert [i for c in chunks for i in c] == list(range(layers))


def test_split_layers_counts_embedding_and_head_weight():
    # 7 layers on 4 chunks, lm_head worth one layer: the last chunk gets the single layer
    assert [len(c) for c in split_layers(7, 4, head_weight=1.0)] == [2, 2, 2, 1]
    assert [len(c) for c in split_layers(6, 2, embedding_weight=2.0)] == [2, 4]
    # every chunk keeps at least one layer however heavy the head is
    assert [len(c) for c in split_layers(4, 4, head_weight=10.0)] == [1, 1, 1, 1]


def test_split_layers_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"num_layers=3 .*pipeline_parallel_degree=2 x virtual_pp_degree=2 = 4"):
        split_layers(3, 2, 2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_degree=0"):
        split_layers(4, 0)
    with pytest.raises(ValueError, match=r"virtual_pp_degree=0"):
        split_layers(4, 2, 0)


# -- stage modules -----------------------------------------------------------------------------
@pytest.mark.parametrize("pp, vpp", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_stage_parameter_names_partition_the_model(pp, vpp):
    model = build_model(config_for_flavour("debug", vocab_size=VOCAB, num_hidden_layers=4), seed=SEED)
    full = dict(model.named_parameters())
    chunks = split_layers(4, pp, vpp)
    seen: list[str] = []
    for c, ids in enumerate(chunks):
        stage = build_stage_module(model, ids, is_first=c == 0, is_last=c == len(chunks) - 1)
        for name, p in stage.named_parameters():
            assert p is full[name], name  # same name, same tensor
            seen.append(name)
        assert set(stage.state_dict()) <= set(model.state_dict())
    assert sorted(seen) == sorted(full)  # disjoint and complete


def test_stages_chained_equal_full_forward():
    model = build_model(config_for_flavour("debug", vocab_size=VOCAB, num_hidden_layers=4), seed=SEED)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    chunks = split_layers(4, 2, 2)
    x = ids
    for c, layer_ids in enumerate(chunks):
        x = build_stage_module(model, layer_ids, is_first=c == 0, is_last=c == len(chunks) - 1)(x)
    torch.testing.assert_close(x, model(ids), rtol=0, atol=0)


def test_build_stage_module_rejects_unknown_layers():
    model = build_model(config_for_flavour("debug", vocab_size=VOCAB), seed=SEED)  # 2 layers
    with pytest.raises(ValueError, match=r"\[2\] are not in the model, which has 2 layers"):
        build_stage_module(model, [1, 2], is_first=False, is_last=True)


# -- parity with the single-process run --------------------------------------------------------
def _config():
    return config_for_flavour("debug", vocab_size=VOCAB, num_hidden_layers=4)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded batches; some label positions are IGNORE_INDEX, unevenly across micro-batches, so
    that a mean of micro-batch means would differ from the full-batch token mean."""
    g = torch.Generator().manual_seed(SEED + 1)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : SEQ // 2] = IGNORE_INDEX
        labels[step % BATCH, -3:] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _single_process_run():
    torch.manual_seed(0)
    model = build_model(_config(), seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, grads = [], {}
    for step, (ids, labels) in enumerate(_batches()):
        opt.zero_grad(set_to_none=True)
        _, loss = model(ids, labels)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pp_worker(rank: int, world: int, port: int, vpp: int, n_microbatches: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = build_model(_config(), seed=SEED)
        runner = PipelineRunner(model, pipeline_parallel_degree=world, virtual_pp_degree=vpp,
                                n_microbatches=n_microbatches)
        del model
        opt = torch.optim.AdamW(runner.parameters(), **ADAMW)
        losses, grads = [], {}
        for step, (ids, labels) in enumerate(_batches()):
            opt.zero_grad(set_to_none=True)
            loss = runner.train_step(ids, labels)
            if step == 0:
                grads = {n: p.grad.detach().clone() for n, p in runner.named_parameters()}
            opt.step()
            losses.append(loss.item())
        torch.save({"losses": losses, "grads": grads, "split": runner.split}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single_process():
    return _single_process_run()


@pytest.mark.multiproc
@pytest.mark.parametrize("vpp, n_microbatches", [(1, 4), (2, 4)], ids=["pp2-1f1b", "pp2-vpp2-interleaved"])
def test_pipeline_matches_single_process(tmp_path, single_process, vpp, n_microbatches):
    ref_losses, ref_grads = single_process
    world = 2
    mp.spawn(_pp_worker, args=(world, _free_port(), vpp, n_microbatches, str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    # every pp rank reports the same (broadcast) loss, equal to the single-process loss
    for res in results:
        rel = [abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses)]
        assert max(rel) < 1e-5, (res["losses"], ref_losses)

    # gradients after step 1: each stage's parameters, by name; together they cover the model
    names = [n for res in results for n in res["grads"]]
    assert sorted(names) == sorted(ref_grads)
    for res in results:
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=name)
