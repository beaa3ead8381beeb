"""AWQ (stages/quant/awq.py): the folds leave every float block output as it was (every family our
model implements, grouped-query attention and GLM-4's fused gate_up included), the scale search is
never worse than round-to-nearest on its own criterion and much better on outlier channels, the
clip search never worse than no clip; the quantize stage's awq-w4 against wint4 and what its files
hold is in test_quantize_gptq.py, transformers and GPTQModel opening them in test_quant_interop.py."""

import pytest
import torch

from stages.model import config_for_flavour
from stages.quant.awq import (AWQConfig, block_folds, output_error, pseudo_quantize, quantize_block, search_clip,
                              search_scale)
from stages.quant.block_calibration import capture_block_inputs, run_block, sequential_groups
from stages.quant.layers import linear_weight
from test_parallel_tensor import CONFIGS, VOCAB, _built

CONFIG = AWQConfig(group_size=32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _outlier_inputs(n: int, in_f: int, seed: int) -> torch.Tensor:
    """Rows whose few channels are 30x the others, as activations after a trained model's norms."""
    x = torch.randn(n, in_f, generator=_gen(seed))
    x[:, torch.randperm(in_f, generator=_gen(seed + 1))[:4]] *= 30
    return x


def _block_and_inputs(family: str):
    cfg = config_for_flavour("debug", vocab_size=VOCAB, **CONFIGS[family])
    model = _built(cfg).eval()
    block = model.model.layers["0"]
    ids = torch.randint(0, VOCAB, (2, 16), generator=_gen(5))
    with torch.no_grad():
        inputs = capture_block_inputs(model, block, [ids])
    return model, block, inputs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "glm4"])
def test_folded_scales_leave_the_float_block_unchanged(family):
    model, block, inputs = _block_and_inputs(family)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    groups = sequential_groups(block, inputs[0])
    folds = block_folds(block, groups, model.config.model_type, heads, kv_heads)
    assert sorted(folds) == sorted(g[0] for g in groups), (groups, sorted(folds))  # every group folds somewhere
    modules = dict(block.named_modules())
    with torch.no_grad():
        before = run_block(block, inputs[0])
        for k, group in enumerate(groups):
            width = linear_weight(modules[group[0]]).shape[1]
            s = torch.exp(torch.randn(width, generator=_gen(10 + k)))  # scales from ~0.1 to ~10
            fold = folds[group[0]]
            if fold.tie is not None:
                s = fold.tie(s)
            fold.apply(s)
            for name in group:
                w = linear_weight(modules[name])
                w.copy_(w * s)
        after = run_block(block, inputs[0])
    err = float((after - before).abs().max() / before.abs().max())
    assert err < 1e-5, err


def test_gpt2_has_no_fold_and_is_clipped_and_rounded_only():
    model, block, inputs = _block_and_inputs("gpt2")
    groups = sequential_groups(block, inputs[0])
    assert block_folds(block, groups, "gpt2", 4, 4) == {}
    results = quantize_block(block, inputs, CONFIG, model_type="gpt2", heads=4, kv_heads=4, prefix="b")
    assert results and all(r.scale is None and r.error == r.rtn_error for r in results.values())


def _moment(x: torch.Tensor) -> torch.Tensor:
    return x.t() @ x / x.shape[0]


def test_the_error_from_the_second_moment_is_the_error_on_the_rows():
    w = torch.randn(24, 64, generator=_gen(6)) * 0.05
    x = _outlier_inputs(300, 64, seed=7)
    s = torch.exp(0.5 * torch.randn(64, generator=_gen(8)))
    on_rows = float((x @ w.t() - (x / s) @ pseudo_quantize(w * s, CONFIG).t()).pow(2).mean())
    assert output_error([w], _moment(x), s, CONFIG) == pytest.approx(on_rows, rel=1e-4)


def test_scale_search_is_never_worse_than_rtn_and_wins_on_outlier_channels():
    w = torch.randn(64, 128, generator=_gen(0)) * 0.05
    x = _outlier_inputs(512, 128, seed=1)
    s, r, error, rtn_error = search_scale([w], _moment(x), x.abs().mean(dim=0), CONFIG)
    assert s is not None and r is not None
    assert error == pytest.approx(output_error([w], _moment(x), s, CONFIG))
    assert error < 0.5 * rtn_error, (error, rtn_error)
    # plain activations: s = 1 stays a candidate, so the search never loses to RTN on its criterion
    x = torch.randn(512, 128, generator=_gen(2))
    _, _, error, rtn_error = search_scale([w], _moment(x), x.abs().mean(dim=0), CONFIG)
    assert error <= rtn_error


def test_clip_search_lowers_each_groups_output_error():
    w = torch.randn(48, 128, generator=_gen(3)) * 0.05
    w[torch.rand(w.shape, generator=_gen(4)) < 0.01] *= 8  # a few large weights widen their groups' grid
    x = torch.randn(256, 128, generator=_gen(5))
    max_val = search_clip(w, _moment(x), CONFIG)
    org = w.abs().reshape(48, 4, 32).amax(dim=-1)
    assert (max_val <= org).all() and (max_val >= org * (1 - CONFIG.max_shrink) - 1e-7).all()
    assert (max_val < org).any()
    bound = max_val.repeat_interleave(32, dim=1)
    clipped = pseudo_quantize(torch.maximum(torch.minimum(w, bound), -bound), CONFIG)

    def group_errors(q):  # each (row, group)'s share of the output error, on the rows themselves
        d = (w - q).reshape(48, 4, 32)
        return torch.einsum("ngk,ogk->nog", x.reshape(-1, 4, 32), d).pow(2).mean(dim=0)

    assert (group_errors(clipped) <= group_errors(pseudo_quantize(w, CONFIG)) * (1 + 1e-5) + 1e-12).all()


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"quantize\.awq\.bits=3"):
        AWQConfig(bits=3)
    with pytest.raises(ValueError, match=r"quantize\.awq\.max_shrink=1\.0"):
        AWQConfig(max_shrink=1.0)
