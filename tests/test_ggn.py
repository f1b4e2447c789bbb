"""BlockGaussNewton against dense references: J^T H_out J built column by column from the
Jacobian of the logits and the loss's Hessian in the logits, on a ReLU MLP (where it differs from
the exact Hessian), a block of rows, label smoothing and MSE, with its linearisation kept and
recomputed per product; equal to the exact Hessian on softmax regression, where the logits are
affine in the weights; on a CNN the kept form gives the recomputed form's products; an operator
without a double backward (which torch.func differentiates wrongly, silently) is caught on the
first product: the operator recomputes, and says so."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from pipeline.curvature import BlockHessian
from pipeline.curvature.ggn import BlockGaussNewton
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from tests.kit import digits64


@pytest.fixture(scope="module")
def data():
    """24 digits: batches of 7, 7, 7 and 3 in the operator (its products cost a pass per column)."""
    return digits64()["train"].take(torch.arange(24))


def _dense_ggn(model, task, data, block, lam):
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = data.columns["x"], data.columns["y"]

    def logits(delta):
        return functional_call(model, block.insert(params, delta), (x,))

    zero = torch.zeros(block.numel, dtype=torch.float64)
    jac = jacrev(logits)(zero)                                 # (N, K, P)
    out = logits(zero).detach()
    total = torch.zeros(block.numel, block.numel, dtype=torch.float64)
    for i in range(len(y)):
        h = hessian(lambda o: task.per_sample_loss(o[None], {"y": y[i:i + 1]}).sum())(out[i])  # (K, K)
        total += jac[i].T @ h @ jac[i]
    return total / len(y) + lam * torch.eye(block.numel, dtype=torch.float64)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("loss,options,rows", [
    ("cross_entropy", {}, None),
    ("cross_entropy", {"label_smoothing": 0.1}, {"1.weight": [0, 2], "1.bias": [0, 2], "3.weight": None}),
    ("mse", {}, None),
])
def test_gauss_newton_products_equal_the_dense_jacobian_form(data, loss, options, rows, keep):
    torch.manual_seed(0)  # 4 hidden ReLUs (310 parameters): on these 24 digits units 1 and 2 are active, 0 and 3 not
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 10)).double()
    task = DenseInputTask(loss=loss, loss_options=options)
    if loss == "mse":
        data = data.take(torch.arange(len(data)))
        data.columns["y"] = torch.nn.functional.one_hot(data.columns["y"], 10).double()
    block = ParamBlock.all_parameters(model) if rows is None else ParamBlock.from_rows(model, rows)
    op = BlockGaussNewton(model, task, data, block, 0.01, batch_size=7, keep_linearisation=keep)
    dense = _dense_ggn(model, task, data, block, 0.01)
    got = op.to_dense()
    assert op.linearisation.startswith("kept" if keep else "recomputed per product")
    assert torch.allclose(got, dense, rtol=1e-9, atol=1e-11)
    # positive semi-definite where the exact Hessian of the ReLU net is not the same matrix
    assert float(torch.linalg.eigvalsh(got - 0.01 * torch.eye(block.numel, dtype=torch.float64)).min()) > -1e-10
    exact = BlockHessian(model, task, data, block, 0.01).to_dense()
    assert float((exact - got).norm()) > 1e-6 * float(got.norm())


def test_gauss_newton_is_the_hessian_of_softmax_regression(data):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.all_parameters(model)
    got = BlockGaussNewton(model, task, data, block, 0.5, reduction="sum").to_dense()
    exact = BlockHessian(model, task, data, block, 0.5, reduction="sum").to_dense()
    assert torch.allclose(got, exact, rtol=1e-10, atol=1e-10)


def test_the_kept_linearisation_of_a_cnn_gives_the_recomputed_products(data):
    from pipeline.models.small import build_cnn

    torch.manual_seed(2)
    model = build_cnn(channels=(4, 8), pool=(2, 1), hidden=(16,), image_size=8).double().eval()
    images = data.take(torch.arange(len(data)))
    images.columns["x"] = images.columns["x"].reshape(len(data), 1, 8, 8)
    task = DenseInputTask(loss="cross_entropy")
    names = [n for n, _ in model.named_parameters()]
    block = ParamBlock.from_rows(model, {names[2]: [1, 5], names[3]: [1, 5], names[-2]: None, names[-1]: None})
    kept = BlockGaussNewton(model, task, images, block, 1e-3, batch_size=10)
    fresh = BlockGaussNewton(model, task, images, block, 1e-3, batch_size=10, keep_linearisation=False)
    v = torch.randn(block.numel, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert kept.linearisation == "kept"
    for _ in range(2):  # the second product reuses the kept graphs
        assert torch.allclose(kept.matmat(v), fresh.matmat(v), rtol=1e-10, atol=1e-12)
    assert kept.products == fresh.products == 6


class _OnceDifferentiableTanh(torch.autograd.Function):
    """tanh with a forward-mode rule and a backward that cannot itself be differentiated."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.y = output

    @staticmethod
    def jvp(ctx, t):
        return t * (1 - ctx.y * ctx.y)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class _Tanh(nn.Module):
    def forward(self, x):
        return _OnceDifferentiableTanh.apply(x)


def test_an_operator_without_a_double_backward_recomputes_and_says_so(data):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 5), _Tanh(), nn.Linear(5, 10)).double()
    reference = nn.Sequential(nn.Flatten(), nn.Linear(64, 5), nn.Tanh(), nn.Linear(5, 10)).double()
    reference.load_state_dict(model.state_dict())
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.all_parameters(model)
    op = BlockGaussNewton(model, task, data, block, 0.01, batch_size=7)
    got = op.to_dense()
    assert op.linearisation.startswith("recomputed per product (the kept linearisation's product on a random vector was")
    assert torch.allclose(got, _dense_ggn(reference, task, data, block, 0.01), rtol=1e-9, atol=1e-11)
