"""BlockKFAC (pipeline/curvature/kfac.py) against the dense Gauss-Newton matrix and its own dense form.

  (a) where every sample gives a layer the same input, K-FAC is the Gauss-Newton matrix itself (A = a a^T
      factors out): with the class sum, every part's diagonal block equals the dense J^T M J block (a
      hidden layer's rows, its bias rows, the output layer; an in-place activation after the layer
      too), and a convolution whose kernel covers its input (one position) likewise, channels in the
      weight's row order; a strided, padded, dilated convolution over T > 1 positions has the expand
      factors of its patches (found by autograd) and its bias block is the exact one;
  (b) positions: a 1x1 convolution and a Linear layer over the same pixels (a token-style (B, T, k)
      input) give the same factors;
  (c) drawn labels estimate the class sum (3 seeds, 4,000 samples);
  (d) the damped inverse and the product agree with the dense matrix, in float64 and with factors
      decomposed in float32; a wide layer with fewer inputs than columns takes the thin basis from the
      inputs' Gram matrix, the same matrix and inverse, also when it switches to the dense factor mid
      pass; in float32 the thin basis stays orthonormal and the inverse positive definite;
  (e) a part without Kronecker factors (a LayerNorm scale) gets the scalar tr G_part / |part| from the
      batch squares, and factors beyond the memory budget, or a layer whose forward never runs
      (MultiheadAttention's out_proj), fall back to it, the reason recorded;
  (f) a loss other than cross-entropy is refused, naming it, and the trust region then solves
      unpreconditioned, saying why;
  (g) the trust region's Gauss-Newton PCG preconditioned by K-FAC converges to the unpreconditioned
      solution in fewer iterations.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import memory
from pipeline.curvature import kfac as kfac_module
from pipeline.curvature.ggn import BlockGaussNewton
from pipeline.curvature.kfac import BlockKFAC
from pipeline.data import SampleSet
from pipeline.methods.trust_region import TrustRegion, gauss_newton_trust_step
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from tests.kit import digits64

from tests.test_block_gauss_newton import TASK

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_input(x: torch.Tensor, n: int, classes: int) -> SampleSet:
    """n samples with the input x each and labels cycling through the classes."""
    return SampleSet({"x": x[None].repeat(n, *([1] * x.dim())), "y": torch.arange(n) % classes}, torch.arange(n))


def _blocks(matrix: torch.Tensor, block: ParamBlock) -> list[torch.Tensor]:
    return [matrix[o:o + p.numel, o:o + p.numel] for o, p in zip(block.offsets, block.parts)]


def _assert_parts_equal_ggn(model, data, block):
    k = BlockKFAC(model, TASK, data, block, seed=0, labels="exact", batch_size=16)
    dense = BlockGaussNewton(model, TASK, data, block, 0.0, batch_size=16).to_dense()
    for part, got, want in zip(block.parts, _blocks(k.dense(), block), _blocks(dense, block)):
        assert float(want.abs().max()) > 1e-6, part.name   # a part that carries curvature
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max())), part.name
    return k


# -- (a) exact where each layer sees one input ------------------------------------------------------
@pytest.mark.parametrize("activation", [nn.Tanh, lambda: nn.LeakyReLU(0.1, inplace=True)], ids=["tanh", "inplace"])
def test_kfac_is_the_gauss_newton_matrix_where_every_sample_gives_a_layer_the_same_input(activation):
    torch.manual_seed(0)   # an in-place activation after a layer must not change the layer's recorded output
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 7), activation(), nn.Linear(7, 10)).double()
    x = digits64()["train"].columns["x"][3]
    block = ParamBlock.from_rows(model, {"1.weight": [1, 4, 6], "1.bias": [0, 2], "3.weight": None, "3.bias": None})
    k = _assert_parts_equal_ggn(model, _same_input(x, 40, 10), block)
    assert set(k.describe()["parts"].values()) == {"kronecker"}


def test_a_convolution_over_one_position_is_exact_with_channels_in_the_weights_row_order():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 5, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(5, 4)).double()
    x = torch.randn(2, 3, 3, dtype=torch.float64)
    block = ParamBlock.from_rows(model, {"0.weight": [0, 2, 3], "0.bias": [1, 2], "3.weight": None})
    _assert_parts_equal_ggn(model, _same_input(x, 24, 4), block)


def test_a_strided_padded_dilated_convolution_has_the_expand_factors_of_its_patches_and_the_exact_bias_block():
    """T > 1 positions: A = (1/(n T)) sum a a^T with a_t the gradient of output position t of filter 0 in the
    weight (the patch, found by autograd, not by unfold), Gm = (1/n) sum_t sum_c delta delta^T on the rows."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)).double()
    x = torch.randn(6, 2, 7, 6, dtype=torch.float64)
    with torch.no_grad():
        width = nn.Flatten()(torch.tanh(conv(x))).shape[1]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(width, 5).double())
    data = SampleSet({"x": x, "y": torch.arange(6) % 5}, torch.arange(6))
    rows = [0, 2, 3]
    block = ParamBlock.from_rows(model, {"0.weight": rows, "0.bias": [1, 3]})
    k = BlockKFAC(model, TASK, data, block, seed=0, labels="exact", batch_size=4)
    a_sum, g_sum, positions = 0.0, 0.0, 0
    for i in range(len(x)):
        z = conv(x[i:i + 1])
        out, h, w = z.shape[1:]
        positions = h * w
        for t in range(positions):
            a = torch.autograd.grad(z[0, 0, t // w, t % w], conv.weight, retain_graph=True)[0][0].reshape(-1)
            a_sum = a_sum + torch.outer(a, a)
        zz = z.detach().requires_grad_(True)
        logits = model[3](model[2](model[1](zz)))[0]
        p = torch.softmax(logits, -1).detach()
        for c in range(5):
            seed = p[c].sqrt() * (torch.eye(5, dtype=p.dtype)[c] - p)
            d = torch.autograd.grad(logits, zz, seed, retain_graph=True)[0][0].reshape(out, -1)[rows]
            g_sum = g_sum + d @ d.T
    assert positions > 1
    want = torch.kron(g_sum / len(x), a_sum / (len(x) * positions))
    got, bias = _blocks(k.dense(), block)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-14)
    dense_bias = _blocks(BlockGaussNewton(model, TASK, data, block, 0.0).to_dense(), block)[1]
    assert torch.allclose(bias, dense_bias, rtol=1e-10, atol=1e-14)


# -- (b) positions: a 1x1 convolution and a Linear over pixels --------------------------------------
class _PixelLinear(nn.Module):
    """The 1x1 convolution's map as a Linear over the H*W pixel positions (B, T, C)."""

    def __init__(self, conv: nn.Conv2d, head: nn.Linear):
        super().__init__()
        self.mix = nn.Linear(conv.in_channels, conv.out_channels).double()
        with torch.no_grad():
            self.mix.weight.copy_(conv.weight[:, :, 0, 0])
            self.mix.bias.copy_(conv.bias)
        self.head = head

    def forward(self, x):
        b, c, h, w = x.shape
        z = self.mix(x.reshape(b, c, h * w).transpose(1, 2))     # (B, T, out)
        return self.head(torch.relu(z).transpose(1, 2).reshape(b, -1))


def test_a_1x1_convolution_and_a_linear_over_its_pixels_give_the_same_factors():
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 4, 1).double()
    head = nn.Linear(4 * 9, 5).double()
    as_conv = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), head)
    as_linear = _PixelLinear(conv, head)
    data = SampleSet({"x": torch.randn(30, 3, 3, 3, dtype=torch.float64), "y": torch.arange(30) % 5}, torch.arange(30))
    with torch.no_grad():
        assert torch.allclose(as_conv(data.columns["x"]), as_linear(data.columns["x"]), atol=1e-12)
    k_conv = BlockKFAC(as_conv, TASK, data, ParamBlock.from_rows(as_conv, {"0.weight": [1, 3], "0.bias": None}),
                       seed=4, labels="exact")
    k_lin = BlockKFAC(as_linear, TASK, data, ParamBlock.from_rows(as_linear, {"mix.weight": [1, 3], "mix.bias": None}),
                      seed=4, labels="exact")
    assert torch.allclose(k_conv.dense(), k_lin.dense(), rtol=1e-10, atol=1e-14)


# -- (c) drawn labels --------------------------------------------------------------------------------
def test_drawn_labels_estimate_the_class_sum():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 7), nn.Tanh(), nn.Linear(7, 10)).double()
    data = _same_input(digits64()["train"].columns["x"][3], 4000, 10)
    block = ParamBlock.from_rows(model, {"1.weight": [1, 4, 6], "3.weight": None})
    exact = BlockKFAC(model, TASK, data, block, seed=0, labels="exact", batch_size=500).dense()
    errors = [float((BlockKFAC(model, TASK, data, block, seed=s, batch_size=500).dense() - exact).norm() / exact.norm())
              for s in range(3)]
    assert max(errors) < 0.1, errors
    assert min(errors) > 0.0          # a draw, not the class sum


# -- (d) inverse and product -------------------------------------------------------------------------
@pytest.mark.parametrize("float32_above", [None, 8])
def test_the_damped_inverse_and_the_product_agree_with_the_dense_matrix(monkeypatch, float32_above):
    if float32_above is not None:
        monkeypatch.setattr(kfac_module, "_EIGH_FLOAT64_MAX", float32_above)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 10)).double()
    data = digits64()["train"].take(torch.arange(300))
    block = ParamBlock.from_rows(model, {"1.weight": None, "1.bias": [0, 5], "3.weight": [2, 3, 7]})
    k = BlockKFAC(model, TASK, data, block, seed=0)
    dense = k.dense()
    v = torch.randn(block.numel, dtype=torch.float64)
    tol = 1e-10 if float32_above is None else 1e-4
    for damping in (1e-3, 0.5):
        want = torch.linalg.solve(dense + damping * torch.eye(block.numel, dtype=torch.float64), v)
        assert float((k.solve(v, damping) - want).norm()) <= tol * float(want.norm())
    assert float((k.product(v) - dense @ v).norm()) <= tol * float((dense @ v).norm())
    with pytest.raises(ValueError, match="positive damping"):
        k.solve(v, 0.0)


def test_a_wide_layer_with_fewer_inputs_than_its_width_takes_the_thin_basis_with_the_same_matrix(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 10)).double()
    data = digits64()["train"].take(torch.arange(40))      # 40 inputs < 64 columns: A has rank <= 40
    block = ParamBlock.from_rows(model, {"1.weight": [0, 3, 4], "3.weight": None})
    full = BlockKFAC(model, TASK, data, block, seed=0)
    monkeypatch.setattr(kfac_module, "_THIN_MIN_WIDTH", 8)
    thin = BlockKFAC(model, TASK, data, block, seed=0)
    live = int((data.columns["x"].reshape(40, -1).abs().sum(0) > 0).sum())   # pixels not 0 in every image
    assert thin._parts["1.weight"].q_in.shape[1] <= 40 < full._parts["1.weight"].q_in.shape[1] == live
    assert torch.allclose(thin.dense(), full.dense(), rtol=1e-9, atol=1e-12)
    v = torch.randn(block.numel, dtype=torch.float64)
    for damping in (1e-4, 1e-2):
        want = full.solve(v, damping)
        assert float((thin.solve(v, damping) - want).norm()) <= 1e-8 * float(want.norm())


def test_the_thin_route_switching_to_the_dense_factor_mid_pass_gives_the_same_matrix(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 10)).double()
    data = digits64()["train"].take(torch.arange(300))      # rows pass the width (64) in the second batch
    block = ParamBlock.from_rows(model, {"1.weight": [0, 3, 4], "3.weight": None})
    full = BlockKFAC(model, TASK, data, block, seed=0, batch_size=50)
    monkeypatch.setattr(kfac_module, "_THIN_MIN_WIDTH", 8)
    switched = BlockKFAC(model, TASK, data, block, seed=0, batch_size=50)
    assert torch.allclose(switched.dense(), full.dense(), rtol=1e-10, atol=1e-13)


def test_a_thin_basis_decomposed_in_float32_stays_orthonormal_and_its_inverse_positive(monkeypatch):
    monkeypatch.setattr(kfac_module, "_THIN_MIN_WIDTH", 8)
    monkeypatch.setattr(kfac_module, "_EIGH_FLOAT64_MAX", 8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 10)).double()
    data = digits64()["train"].take(torch.arange(48))      # digits: a steeply decaying input spectrum
    block = ParamBlock.from_rows(model, {"1.weight": [0, 3], "3.weight": None})
    k = BlockKFAC(model, TASK, data, block, seed=0)
    q = k._parts["1.weight"].q_in
    assert q.shape[1] < 48
    assert float((q.T @ q - torch.eye(q.shape[1], dtype=q.dtype)).abs().max()) < 1e-3
    eye = torch.eye(block.numel, dtype=torch.float64)
    for damping in (1e-5, 1e-3):
        inverse = torch.stack([k.solve(e, damping) for e in eye], 1)
        assert float(torch.linalg.eigvalsh(0.5 * (inverse + inverse.T)).min()) > 0


def test_a_factor_with_dead_coordinates_gets_a_thin_basis_of_the_rest_and_survives_a_float32_eigh_failure(
        monkeypatch):
    # the identities ResNet's 1,152-wide conv factor had 768 input coordinates that are always 0; float32
    # eigh did not converge on it (LinAlgError): the zero rows are left out, and float32 falls back to float64
    monkeypatch.setattr(kfac_module, "_EIGH_FLOAT64_MAX", 8)
    torch.manual_seed(0)
    x = torch.zeros(200, 30, dtype=torch.float64)
    x[:, ::3] = torch.randn(200, 10, dtype=torch.float64)   # 20 of 30 coordinates never move
    factor = x.T @ x / 200
    real_eigh = torch.linalg.eigh
    failures = []

    def float32_fails(a, *args, **kwargs):
        if a.dtype == torch.float32:
            failures.append(a.shape)
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real_eigh(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    values, vectors = kfac_module._eigh(factor)
    assert failures == [torch.Size([10, 10])]          # only the live 10 x 10 block was decomposed
    assert vectors.shape == (30, 10) and float(vectors[1::3].abs().max()) == 0.0
    assert torch.allclose(vectors.T @ vectors, torch.eye(10, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(vectors @ torch.diag(values) @ vectors.T, factor, atol=1e-12)
    part = kfac_module.KroneckerPart(torch.eye(2, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64),
                                     vectors, values)
    dense = torch.kron(torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64)), factor)
    v = torch.randn(60, dtype=torch.float64)
    want = torch.linalg.solve(dense + 0.1 * torch.eye(60, dtype=torch.float64), v)
    assert torch.allclose(part.solve(v, 0.1), want, rtol=1e-10, atol=1e-12)
    # the thin route's Gram matrix goes through the same decomposition: 12 rows (3 of them zero) of the 30
    # columns, float32 above 8 rows, which fails: the live 9 x 9 Gram block redone in float64
    rows = torch.zeros(12, 30, dtype=torch.float64)
    rows[3:] = x[:9]
    failures.clear()
    s, q = kfac_module._thin_eigh(rows, 12)
    assert failures == [torch.Size([9, 9])] and q.shape == (30, 9)
    # (the Gram matrix itself was formed in float32: float32's rounding, not float64's)
    assert torch.allclose(q.T @ q, torch.eye(9, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(q @ torch.diag(s) @ q.T, rows.T @ rows / 12, atol=1e-5)


def test_a_layer_whose_forward_never_runs_falls_back_to_the_scalar():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = nn.Sequential(Attention(), nn.Flatten(), nn.Linear(8 * 3, 4)).double()
    data = SampleSet({"x": torch.randn(40, 3, 8, dtype=torch.float64), "y": torch.arange(40) % 4}, torch.arange(40))
    block = ParamBlock.from_rows(model, {"0.mha.out_proj.weight": None, "2.weight": None})
    k = BlockKFAC(model, TASK, data, block, seed=0)
    assert k.describe()["parts"] == {"0.mha.out_proj.weight": "scalar", "2.weight": "kronecker"}
    assert "never ran" in k.describe()["scalar_because"]["0.mha.out_proj.weight"]
    assert k._parts["0.mha.out_proj.weight"].scale > 0


# -- (e) the scalar parts ----------------------------------------------------------------------------
def test_a_part_without_kronecker_factors_gets_the_scalar_trace_estimate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 10)).double()
    data = digits64()["train"].take(torch.arange(1200))
    block = ParamBlock.from_rows(model, {"2.weight": None, "4.weight": None})
    dense = BlockGaussNewton(model, TASK, data, block, 0.0).to_dense()
    want = float(torch.diagonal(_blocks(dense, block)[0]).mean())
    estimates = []
    for seed in range(3):
        k = BlockKFAC(model, TASK, data, block, seed=seed, batch_size=8)
        assert k.describe()["parts"] == {"2.weight": "scalar", "4.weight": "kronecker"}
        assert "LayerNorm" in k.describe()["scalar_because"]["2.weight"]
        estimates.append(k._parts["2.weight"].scale)
    assert all(0.8 * want < e < 1.25 * want for e in estimates), (estimates, want)   # within 1 % here


def test_factors_beyond_the_memory_budget_fall_back_to_the_scalar():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 10)).double()
    data = digits64()["train"].take(torch.arange(64))
    block = ParamBlock.from_rows(model, {"1.weight": None, "3.weight": None})
    with memory.use_budget("200KB"):   # A of the first layer (64 x 64, with eigh's copies ~98 KB) > half of it
        k = BlockKFAC(model, TASK, data, block, seed=0)
    parts = k.describe()
    assert parts["parts"] == {"1.weight": "scalar", "3.weight": "kronecker"}
    assert "memory budget" in parts["scalar_because"]["1.weight"]


# -- (f) other losses --------------------------------------------------------------------------------
def test_a_loss_other_than_cross_entropy_is_refused_naming_it_and_the_trust_region_solves_unpreconditioned():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()
    data = digits64()["train"].take(torch.arange(64))
    with pytest.raises(ValueError, match="'mse'"):
        BlockKFAC(model, DenseInputTask(loss="mse"), data, ParamBlock.all_parameters(model), seed=0)
    task = DenseInputTask(loss="bce_multilabel")
    multi = SampleSet({"x": data.columns["x"], "y": torch.nn.functional.one_hot(data.columns["y"], 10).double()},
                      data.sample_ids)
    block = ParamBlock.all_parameters(model)
    rhs = 0.01 * torch.randn(block.numel, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    settings = TrustRegion(curvature_samples=None, probe_samples=None, min_ratio=0.0, preconditioner="kfac")
    step, record = gauss_newton_trust_step(model, task, block, multi, rhs, 0.0, 1e-3, settings, seed=7, batch_size=64)
    assert step is not None and record["preconditioner"] == "none"
    assert "bce_multilabel" in record["preconditioner_skipped"]


# -- (g) the trust region ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_problem():
    """A ReLU MLP on 400 digits, a row block across both layers and a right-hand side g_R - g_D-like."""
    from pipeline.training import fit_sgd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)).double()
    data = digits64()["train"].take(torch.arange(400))
    fit_sgd(model, TASK, data, 1e-3, epochs=5, lr=0.05, batch_size=32, momentum=0.9, seed=0)
    block = ParamBlock.from_rows(model, {"1.weight": [0, 3, 5, 9], "1.bias": [0, 3, 5, 9], "3.weight": None})
    rhs = 0.01 * torch.randn(block.numel, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return model.eval(), data, block, rhs


def test_the_kfac_preconditioned_pcg_converges_to_the_same_step_in_fewer_iterations(mlp_problem):
    model, data, block, rhs = mlp_problem
    steps, iterations = {}, {}
    for pre in ("none", "kfac"):
        settings = TrustRegion(curvature_samples=None, probe_samples=None, min_ratio=0.0, cg_rtol=1e-10,
                               cg_max_iter=2000, preconditioner=pre)
        step, record = gauss_newton_trust_step(model, TASK, block, data, rhs, 0.0, 1e-3, settings, seed=7,
                                               batch_size=400)
        assert record["accepted"] and record["trials"][0]["cg_converged"], record
        assert record["preconditioner"] == ("none" if pre == "none" else "K-FAC")
        steps[pre], iterations[pre] = step, record["trials"][0]["cg_iterations"]
    assert float((steps["kfac"] - steps["none"]).norm()) <= 1e-7 * float(steps["none"].norm())
    assert iterations["kfac"] < 0.8 * iterations["none"], iterations   # 124 against 195 here
