"""BlockGaussNewton against dense references: J^T H_out J built column by column from the
Jacobian of the logits and the loss's Hessian in the logits, on a ReLU MLP (where it differs from
the exact Hessian), a block of rows, label smoothing and MSE; and equal to the exact Hessian on
softmax regression, where the logits are affine in the weights."""
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


@pytest.mark.parametrize("loss,options,rows", [
    ("cross_entropy", {}, None),
    ("cross_entropy", {"label_smoothing": 0.1}, {"1.weight": [0, 2], "1.bias": [0, 2], "3.weight": None}),
    ("mse", {}, None),
])
def test_gauss_newton_products_equal_the_dense_jacobian_form(data, loss, options, rows):
    torch.manual_seed(0)  # 4 hidden ReLUs (310 parameters): on these 24 digits units 1 and 2 are active, 0 and 3 not
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 10)).double()
    task = DenseInputTask(loss=loss, loss_options=options)
    if loss == "mse":
        data = data.take(torch.arange(len(data)))
        data.columns["y"] = torch.nn.functional.one_hot(data.columns["y"], 10).double()
    block = ParamBlock.all_parameters(model) if rows is None else ParamBlock.from_rows(model, rows)
    op = BlockGaussNewton(model, task, data, block, 0.01, batch_size=7)
    dense = _dense_ggn(model, task, data, block, 0.01)
    got = op.to_dense()
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
