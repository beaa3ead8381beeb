"""stages/quant/gptq.py: GPTQ against RTN on correlated inputs, its options, g_idx, and the
layer-by-layer driver on our Llama and on transformers' Llama."""

import copy

import pytest
import torch
import transformers

from stages.model import build_model, config_for_flavour
from stages.quant import block_calibration
from stages.quant import gptq as gptq_module
from stages.quant.gptq import (
    BlockInput, GPTQConfig, GPTQHessian, capture_block_inputs, dequantize_gptq, gptq_quantize, gptq_quantize_model,
    gptq_quantize_shared, quantize_layer_sequential, sequential_groups, to_quantized_weight,
)
from stages.quant.gptq_format import dequantize_packed, pack
from stages.quant import gptq_pack
from stages.quant.gptq_pack import pack_bits, pack_gptq, unpack_bits
from stages.quant.rtn import dequantize_weight, quantize_weight


def _inputs(n: int, in_f: int, seed: int) -> torch.Tensor:
    """(n, in_f) activations like an LLM's: correlated channels (a decaying spectrum) and a few
    outlier channels ~10x larger than the rest. The same seed gives the same distribution: the
    mixing matrix depends on in_f only, the samples on `seed`."""
    mix_gen = torch.Generator().manual_seed(1234)
    basis = torch.linalg.qr(torch.randn(in_f, in_f, generator=mix_gen))[0]
    spectrum = torch.logspace(0, -2, in_f)  # singular values from 1 down to 0.01
    mix = basis * spectrum[None, :] @ basis.t()  # (in, in)
    outliers = torch.ones(in_f)
    outliers[torch.randperm(in_f, generator=mix_gen)[: max(1, in_f // 32)]] = 10.0
    z = torch.randn(n, in_f, generator=torch.Generator().manual_seed(seed))
    return (z @ mix) * outliers


def _weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.02


def _hessian(x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    h = GPTQHessian(x.shape[-1])
    for chunk in x.split(batch):
        h.add_batch(chunk)
    return h.hessian


def _out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||X W^T - X W_hat^T||_F / ||X W^T||_F."""
    return float(torch.linalg.vector_norm(x @ (w - w_hat).t()) / torch.linalg.vector_norm(x @ w.t()))


@pytest.fixture(scope="module")
def layer_data():
    """A (64, 256) weight, 2048 calibration rows and 2048 held-out rows of the same distribution."""
    in_f = 256
    x_cal, x_test = _inputs(2048, in_f, seed=1), _inputs(2048, in_f, seed=2)
    return _weight(64, in_f), _hessian(x_cal), x_test


def test_hessian_is_the_running_mean_of_2_x_xt():
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))  # (batch, seq, in)
    h = GPTQHessian(8)
    h.add_batch(x[:1])
    h.add_batch(x[1:])
    rows = x.reshape(-1, 8)
    torch.testing.assert_close(h.hessian, 2 * rows.t() @ rows / rows.shape[0])
    assert h.num_rows == 15
    with pytest.raises(ValueError, match="in_features=8"):
        h.add_batch(torch.randn(2, 7))


def test_identity_hessian_reduces_to_rtn_exactly():
    # With H = I no column's error is fed into another: GPTQ is RTN, with rtn.py's grid conventions.
    w = _weight(16, 64)
    for bits, group_size in [(4, 16), (8, -1)]:
        r = gptq_quantize(w, torch.eye(64), bits=bits, group_size=group_size, sym=False)
        q = quantize_weight(w, bits, group_size)
        assert torch.equal(r.codes, q.codes) and torch.equal(r.zeros, q.zeros) and torch.equal(r.scales, q.scales)


@pytest.mark.parametrize("group_size", [128, 32])
def test_gptq_w4_beats_rtn_on_output_error(layer_data, group_size):
    w, hessian, x = layer_data
    rtn = _out_err(x, w, dequantize_weight(quantize_weight(w, 4, group_size)))
    for sym in (False, True):
        r = gptq_quantize(w, hessian, bits=4, group_size=group_size, sym=sym)
        err = _out_err(x, w, dequantize_gptq(r))
        assert err < 0.8 * rtn, (sym, err, rtn)


def test_act_order_does_not_hurt(layer_data):
    w, hessian, x = layer_data
    plain = _out_err(x, w, dequantize_gptq(gptq_quantize(w, hessian, bits=4, group_size=128, sym=False)))
    for static_groups in (False, True):
        r = gptq_quantize(w, hessian, bits=4, group_size=128, sym=False, desc_act=True,
                          static_groups=static_groups)
        assert _out_err(x, w, dequantize_gptq(r)) <= 1.02 * plain


def _row_errors(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, norm: float) -> torch.Tensor:
    q = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 2**bits - 1)
    return ((q - zero[:, None]) * scale[:, None] - w).abs().pow(norm).sum(dim=1)


@pytest.mark.parametrize("sym", [False, True])
def test_clipping_search_finds_the_best_shrink_of_each_row(sym):
    # heavy-tailed rows (an outlier stretches the range): clipping lowers their rounding error
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((48, 64)) * 0.02
    unclipped = _row_errors(w, *gptq_module.group_params(w, 4, sym), 4, 2.4)
    scale, zero = gptq_module.clipped_group_params(w, 4, sym, 2.4)
    clipped = _row_errors(w, scale, zero, 4, 2.4)
    assert (clipped <= unclipped).all() and (clipped < 0.95 * unclipped).sum() > 10
    # as good as the reference's exhaustive scan of p = 1, 0.99, ..., 0.21, and never better than it
    lo, hi = w.amin(dim=1).clamp(max=0.0), w.amax(dim=1).clamp(min=0.0)
    best = torch.full_like(unclipped, float("inf"))
    for i in range(80):
        p = 1 - i / 100
        grid = gptq_module.symmetric_grid(p * torch.maximum(-lo, hi), 4) if sym else \
            gptq_module.asymmetric_grid(p * lo, p * hi, 4)
        best = torch.minimum(best, _row_errors(w, *grid, 4, 2.4))
    assert (clipped >= best * (1 - 1e-5)).all()
    assert float(clipped.sum()) <= 1.01 * float(best.sum())
    # the grid contract holds: float16-exact scales, zero points in [1, maxq]
    assert torch.equal(scale, scale.half().float()) and zero.min() >= 1 and zero.max() <= 15


def test_mse_option_quantizes_each_group_on_its_clipped_grid():
    # with H = I no error is fed forward: each group is rounded on clipped_group_params' grid
    torch.manual_seed(1)
    w = torch.distributions.StudentT(3.0).sample((32, 128)) * 0.02
    for options in (dict(), dict(desc_act=True, static_groups=True)):
        r = gptq_quantize(w, torch.eye(128), bits=4, group_size=32, sym=False, mse=2.4, **options)
        for g in range(4):
            cols = slice(32 * g, 32 * (g + 1))
            scale, zero = gptq_module.clipped_group_params(w[:, cols], 4, False, 2.4)
            assert torch.equal(r.scales[:, g], scale) and torch.equal(r.zeros[:, g], zero.to(torch.int32))
            assert torch.equal(r.codes[:, cols], torch.clamp(torch.round(w[:, cols] / scale[:, None]) + zero[:, None],
                                                             0, 15).to(torch.int32))
        assert (r.scales <= gptq_quantize(w, torch.eye(128), bits=4, group_size=32, sym=False).scales).all()
    with pytest.raises(ValueError, match="mse=-1"):
        GPTQConfig(mse=-1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [False, True])
def test_grid_contract_for_every_bit_width(layer_data, bits, sym):
    w, hessian, x = layer_data
    r = gptq_quantize(w, hessian, bits=bits, group_size=64, sym=sym, desc_act=True)
    maxq = 2**bits - 1
    assert r.codes.min() >= 0 and r.codes.max() <= maxq
    assert r.zeros.min() >= 1 and r.zeros.max() <= maxq  # storable as z - 1
    if sym:
        assert (r.zeros == 2 ** (bits - 1)).all()
    torch.testing.assert_close(r.scales, r.scales.half().float(), rtol=0, atol=0)  # fp16-exact
    assert torch.equal(dequantize_gptq(r), r.weight)  # s * (q - z) is what the error feedback used
    err = _out_err(x, w, r.weight)
    if bits == 8:
        assert err < 0.01
    elif bits == 2:
        assert err < 1.0


@pytest.mark.parametrize("group_size,static_groups", [(48, False), (-1, False), (32, True)])
def test_lazy_block_updates_do_not_change_the_result(group_size, static_groups):
    # Block 20 makes groups of 48 start mid-block and run past its end (the pending-update path).
    w, hessian = _weight(16, 112, seed=13), _hessian(_inputs(1024, 112, seed=14))
    runs = [gptq_quantize(w, hessian, bits=3, group_size=group_size, sym=False, desc_act=True,
                          static_groups=static_groups, block_size=b) for b in (112, 20)]
    for r in runs[1:]:
        assert torch.equal(r.codes, runs[0].codes) and torch.equal(r.scales, runs[0].scales)
        torch.testing.assert_close(r.weight, runs[0].weight)


def test_g_idx_under_act_order():
    w, x = _weight(32, 96, seed=3), _inputs(1024, 96, seed=4)
    hessian = _hessian(x)
    r = gptq_quantize(w, hessian, bits=4, group_size=32, sym=False, desc_act=True)
    order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
    assert torch.equal(r.perm, order)
    # group j // 32 of the processing order, written at the original column perm[j]
    assert torch.equal(r.g_idx[r.perm], (torch.arange(96) // 32).to(torch.int32))
    assert not torch.equal(r.g_idx, torch.sort(r.g_idx).values)  # really permuted
    assert torch.equal(dequantize_gptq(r), r.weight)
    # static groups: groups of the original column order, so g_idx is k // group_size
    s = gptq_quantize(w, hessian, bits=4, group_size=32, sym=False, desc_act=True, static_groups=True)
    assert torch.equal(s.g_idx, (torch.arange(96) // 32).to(torch.int32))
    assert torch.equal(dequantize_gptq(s), s.weight)


def test_group_size_that_does_not_divide_the_width():
    w, x = _weight(16, 200, seed=5), _inputs(1024, 200, seed=6)
    for desc_act in (False, True):
        r = gptq_quantize(w, _hessian(x), bits=4, group_size=64, sym=False, desc_act=desc_act)
        assert r.scales.shape == (16, 4)  # ceil(200 / 64) groups, the last one 8 columns wide
        assert torch.equal(torch.bincount(r.g_idx.long()), torch.tensor([64, 64, 64, 8]))
        assert torch.equal(dequantize_gptq(r), r.weight)
        assert _out_err(x, w, r.weight) < 0.2


def test_dead_columns_are_zero_and_finite():
    w, x = _weight(16, 64, seed=7), _inputs(512, 64, seed=8)
    x[:, [3, 40]] = 0.0  # these features never fire: H_ii = 0
    r = gptq_quantize(w, _hessian(x), bits=4, group_size=32, sym=False, desc_act=True)
    assert torch.isfinite(r.weight).all()
    assert (r.weight[:, [3, 40]] == 0).all()


def test_bad_arguments_name_the_option():
    w = _weight(8, 32)
    with pytest.raises(ValueError, match="bits=5"):
        gptq_quantize(w, torch.eye(32), bits=5)
    with pytest.raises(ValueError, match="damp_percent"):
        GPTQConfig(damp_percent=1.5)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(16))
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(w, torch.full((32, 32), float("nan")))


def _reference_gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, damp_percent: float = 0.01):
    """The reference loop (IST-DASLab/gptq's fasterquant, as AutoGPTQ / GPTQModel run it) in W's own
    (out, in) layout, symmetric groups, no act-order: the dequantized weights."""
    W, H = w.clone(), hessian.clone()
    maxq, in_f = 2**bits - 1, w.shape[1]
    H += damp_percent * torch.diag(H).mean() * torch.eye(in_f)
    U = torch.linalg.cholesky(torch.cholesky_solve(torch.eye(in_f), torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, in_f, group_size):  # block_size == group_size
        i2 = i1 + group_size
        W1, Err1, U1 = W[:, i1:i2].clone(), torch.zeros(W.shape[0], group_size), U[i1:i2, i1:i2]
        s, z = gptq_module.group_params(W1, bits, sym=True)
        for i in range(group_size):
            w_col = W1[:, i]
            q = s * (torch.clamp(torch.round(w_col / s) + z, 0, maxq) - z)
            Q[:, i1 + i] = q
            err = (w_col - q) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q


def test_column_loop_equals_the_reference_loop_bit_for_bit():
    # block_size == group_size, no dead column: the transposed loop computes the same floats
    w, hessian = _weight(48, 128, seed=20), _hessian(_inputs(1024, 128, seed=21))
    r = gptq_quantize(w, hessian, bits=4, group_size=32, sym=True, block_size=32)
    assert torch.equal(r.weight, _reference_gptq(w, hessian, bits=4, group_size=32))


@pytest.mark.parametrize("options", [dict(bits=4, group_size=32, sym=True),
                                     dict(bits=3, group_size=48, sym=False, desc_act=True, block_size=20),
                                     dict(bits=4, group_size=-1, sym=False, desc_act=True, static_groups=True),
                                     dict(bits=4, group_size=32, sym=False, mse=2.4)])
def test_shared_hessian_gives_each_weight_its_own_result(options):
    # q/k/v (and gate/up) see the same inputs: one GPTQ over the stacked rows is each one's GPTQ
    hessian = _hessian(_inputs(1024, 112, seed=22))
    weights = [_weight(out_f, 112, seed=23 + k) for k, out_f in enumerate((32, 16, 16))]
    shared = gptq_quantize_shared(weights, hessian, names=["q", "k", "v"], **options)
    for w, r in zip(weights, shared):
        alone = gptq_quantize(w, hessian, **options)
        for key in ("codes", "scales", "zeros", "g_idx", "weight"):
            assert torch.equal(getattr(r, key), getattr(alone, key)), key
        assert r.loss == pytest.approx(alone.loss, rel=1e-5)
        assert r.codes.shape == w.shape and r.codes.is_contiguous() and r.weight.is_contiguous()
    # each result owns its tensors (safetensors refuses shared storage)
    assert len({r.g_idx.data_ptr() for r in shared}) == 3
    with pytest.raises(ValueError, match="k: in_features=96"):
        gptq_quantize_shared([weights[0], _weight(16, 96)], hessian, names=["q", "k"])


def test_column_loop_leaves_the_thread_count_as_it_was():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gptq_quantize(_weight(8, 64), torch.eye(64), bits=4, group_size=32)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_packs_into_the_classic_layout():
    w, x = _weight(32, 128, seed=9), _inputs(512, 128, seed=10)
    hessian = _hessian(x)
    # monotonic g_idx, bits 4: the existing packer and the draft agree bit for bit
    r = gptq_quantize(w, hessian, bits=4, group_size=32, sym=True)
    old, new = pack(to_quantized_weight(r), "gptq"), pack_gptq(r)  # symmetric: "gptq" by default
    assert all(torch.equal(old[k], new[k]) for k in old)
    # act-order, 3 and 2 bits, a narrower last group: the draft packer round-trips exactly
    w = _weight(32, 96, seed=11)
    hessian = _hessian(_inputs(512, 96, seed=12))
    for bits in (2, 3, 4, 8):
        r = gptq_quantize(w, hessian, bits=bits, group_size=40, sym=False, desc_act=True)  # 40, 40, 16
        t = pack_gptq(r)  # asymmetric: "gptq_v2" by default, z stored as is
        assert t["qweight"].shape == (96 * bits // 32, 32) and t["qzeros"].shape == (3, 32 * bits // 32)
        torch.testing.assert_close(gptq_pack.dequantize_packed(t, bits, "gptq_v2"), r.weight, rtol=0, atol=0)
        assert torch.equal(t["qzeros"], pack(r, "gptq_v2", g_idx=r.g_idx)["qzeros"])
        v1 = pack_gptq(r, "gptq")  # z >= 1, so the classic layout holds it too
        torch.testing.assert_close(dequantize_packed(v1, bits, "gptq"), r.weight, rtol=0, atol=0)


def test_three_bit_words_follow_autogptq_layout():
    # AutoGPTQ packs 32 three-bit codes into 3 words: codes 0-9 in word 0, code 10 split at bit 30,
    # codes 11-20 in word 1 from bit 1, code 21 split at bit 31, codes 22-31 in word 2 from bit 2.
    codes = torch.zeros(32, 1, dtype=torch.int32)
    codes[10, 0] = 0b101
    codes[21, 0] = 0b011
    codes[31, 0] = 0b111
    words = pack_bits(codes, 3).to(torch.int64) & 0xFFFFFFFF  # (3, 1)
    assert words[0, 0].item() == 0b01 << 30
    assert words[1, 0].item() == (0b1) | (0b1 << 31)
    assert words[2, 0].item() == 0b01 | (0b111 << 29)
    assert torch.equal(unpack_bits(pack_bits(codes, 3), 3), codes)


# ---------------------------------------------------------------- layer-by-layer calibration


def _structured_llama(seed: int = 0):
    """A debug-flavour Llama whose activations look like a trained model's: embeddings with
    correlated channels and a few norm weights 8x larger (outlier features)."""
    model = build_model(config_for_flavour("debug", vocab_size=128), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        d = model.config.hidden_size
        mix = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * torch.logspace(0, -1.5, d)
        model.model.embed_tokens.weight.copy_(torch.randn(128, d, generator=g) @ mix.t())
        for layer in model.model.layers.values():
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(d, generator=g)[:3]] = 8.0
    return model


def _rtn_model(model, bits: int, group_size: int):
    rtn = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in rtn.model.layers.named_modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(dequantize_weight(quantize_weight(m.weight, bits, group_size)))
    return rtn


def _logit_err(model, reference, ids) -> float:
    with torch.no_grad():
        ref = reference(ids)
        return float(torch.linalg.vector_norm(model(ids) - ref) / torch.linalg.vector_norm(ref))


def test_sequential_driver_on_one_block_follows_true_sequential_order():
    model = _structured_llama()
    layer = model.model.layers["0"]
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    x = model.model.embed_tokens(ids).detach()
    cos, sin = model.rotary_emb(32, x.device, x.dtype)
    assert sequential_groups(layer, BlockInput(hidden=x, args=(cos, sin))) == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    outputs, results = quantize_layer_sequential(
        layer, [BlockInput(hidden=x, args=(cos, sin))], GPTQConfig(bits=4, group_size=32, sym=False))
    assert list(results) == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert torch.equal(layer.mlp.down_proj.weight, results["mlp.down_proj"].weight)
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], layer(x, cos, sin))


def test_driver_shares_the_hessian_of_layers_fed_the_same_input(monkeypatch):
    model = _structured_llama()
    layer = model.model.layers["0"]
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    x = model.model.embed_tokens(ids).detach()
    cos, sin = model.rotary_emb(32, x.device, x.dtype)
    inputs = [BlockInput(hidden=x[:2], args=(cos, sin)), BlockInput(hidden=x[2:], args=(cos, sin))]
    calls, hessians = [], []
    real_shared, real_hessian = gptq_module.gptq_quantize_shared, gptq_module.GPTQHessian

    def shared(weights, hessian, *args, names=None, **kwargs):
        calls.append([n.split(".")[-1] for n in names])
        return real_shared(weights, hessian, *args, names=names, **kwargs)

    def counted(*args, **kwargs):
        hessians.append(real_hessian(*args, **kwargs))
        return hessians[-1]

    monkeypatch.setattr(gptq_module, "gptq_quantize_shared", shared)
    monkeypatch.setattr(gptq_module, "GPTQHessian", counted)
    reference = copy.deepcopy(layer)
    config = GPTQConfig(bits=4, group_size=32, sym=False)
    _, results = quantize_layer_sequential(layer, inputs, config)
    assert calls == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert len(hessians) == 4 and all(h.num_rows == 4 * 32 for h in hessians)
    # the same as calibrating and quantizing each Linear alone: q/k/v on the float block's input
    h = real_hessian(x.shape[-1])
    for inp in inputs:
        h.add_batch(reference.input_layernorm(inp.hidden))
    for name in ("q_proj", "k_proj", "v_proj"):
        alone = gptq_quantize(getattr(reference.self_attn, name).weight, h.hessian, bits=4, group_size=32, sym=False,
                              desc_act=config.desc_act, static_groups=config.static_groups, mse=config.mse)
        assert torch.equal(results[f"self_attn.{name}"].weight, alone.weight)


def test_gptq_model_beats_rtn_on_final_logits():
    model = _structured_llama()
    gen = torch.Generator().manual_seed(1)
    calibration = [torch.randint(0, 128, (4, 64), generator=gen) for _ in range(4)]
    held_out = torch.randint(0, 128, (4, 64), generator=gen)
    config = GPTQConfig(bits=4, group_size=32, sym=False)
    quantized = copy.deepcopy(model)
    results = gptq_quantize_model(quantized, quantized.model.layers, calibration, config, prefix="model.layers")
    assert len(results) == 14 and "model.layers.1.mlp.down_proj" in results
    gptq_err = _logit_err(quantized, model, held_out)
    rtn_err = _logit_err(_rtn_model(model, 4, 32), model, held_out)
    assert gptq_err < 0.8 * rtn_err, (gptq_err, rtn_err)


def _hf_model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":  # Conv1D layers: weights stored transposed, (in, out)
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(config).eval(), "transformer.h"
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval(), "model.layers"


@pytest.mark.parametrize("family,layer,transposed", [("llama", "1.self_attn.q_proj", False),
                                                     ("gpt2", "1.attn.c_attn", True)])
def test_gptq_model_on_transformers_models(family, layer, transposed):
    model, blocks = _hf_model(family)
    calibration = [torch.randint(0, 128, (2, 32)) for _ in range(2)]
    reference = copy.deepcopy(model)
    results = gptq_quantize_model(model, model.get_submodule(blocks), calibration, GPTQConfig(bits=8, group_size=-1),
                                  prefix=blocks)
    assert len(results) == (14 if family == "llama" else 8)
    weight = model.get_submodule(f"{blocks}.{layer}").weight
    assert torch.equal(weight.t() if transposed else weight, results[f"{blocks}.{layer}"].weight)
    with torch.no_grad():
        ref, out = reference(calibration[0]).logits, model(calibration[0]).logits
    assert float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)) < 0.02


@pytest.mark.parametrize("family", ["ours", "llama", "gpt2"])
def test_reusing_finished_attention_changes_no_bit(family, monkeypatch):
    # true-sequential passes read the attention's output once o_proj is quantized instead of
    # computing it again: the same results and block outputs, bit for bit, and fewer attention calls
    if family == "ours":
        model = _structured_llama()
        first = model.model.layers["0"]
    else:
        model, blocks = _hf_model(family)
        first = model.get_submodule(blocks)[0]
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    inputs = [inp for batch in ids.split(2) for inp in capture_block_inputs(model, first, [batch])]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    outcomes = {}
    copies = []
    copy_output = block_calibration._copy
    monkeypatch.setattr(block_calibration, "_copy",  # the tensors copied (transformers' are in tuples)
                        lambda out: (isinstance(out, torch.Tensor) and copies.append(1)) or copy_output(out))
    for reuse in (False, True):
        calls.clear()
        block = copy.deepcopy(first)
        outputs, results = quantize_layer_sequential(block, inputs, GPTQConfig(bits=4, group_size=32), reuse=reuse)
        outcomes[reuse] = outputs, results, len(calls)
        assert "forward" not in vars(block.self_attn if family != "gpt2" else block.attn)  # restored
    (out0, res0, n0), (out1, res1, n1) = outcomes[False], outcomes[True]
    assert all(torch.equal(a, b) for a, b in zip(out0, out1))
    assert res0.keys() == res1.keys() and all(torch.equal(res0[k].weight, res1[k].weight) for k in res0)
    # the attention recorded in gate/up's pass, replayed in down's and the output pass; the MLP,
    # finished only before the output pass, is not recorded for nothing
    assert len(copies) == 3 * len(inputs), len(copies)
    if family != "gpt2" or n0:  # transformers' GPT-2 may not call SDPA through torch.nn.functional
        assert n1 < n0, (n0, n1)
