"""BlockHessian's products against torch.func.hessian's dense Hessian of the same objective: one vector
(reverse-over-reverse, each conjugate-gradient product) and a block of columns (forward-over-reverse, vmapped)
are the same exact matrix, on a partial block, over uneven batches, with the weight decay."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

from pipeline.curvature import BlockHessian
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from tests.kit import digits64

LAMBDA = 0.05


@pytest.fixture(scope="module")
def data():
    return digits64()["train"].take(torch.arange(37))  # batches of 16, 16 and 5


def _dense_reference(model, task, data, block, reduction):
    """Hessian of sum_z loss(w + E_P delta, z) (/ n for "mean") + the decay's lambda I, by torch.func.hessian."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def objective(delta):
        out = functional_call(model, block.insert(params, delta), (data.columns["x"],))
        return task.per_sample_loss(out, data.columns).sum()

    h = hessian(objective)(torch.zeros(block.numel, dtype=torch.float64))
    n = len(data) if reduction == "mean" else 1
    return h / n + (LAMBDA if reduction == "mean" else LAMBDA * len(data)) * torch.eye(block.numel, dtype=torch.float64)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_vector_and_a_block_of_columns_are_the_exact_hessian(data, reduction):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10)).double()
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.from_rows(model, {"1.weight": [0, 4, 7], "3.weight": None, "3.bias": None})
    op = BlockHessian(model, task, data, block, LAMBDA, reduction=reduction, batch_size=16, columns_per_pass=8)
    dense = _dense_reference(model, task, data, block, reduction)
    v = torch.randn(block.numel, dtype=torch.float64)
    assert torch.allclose(op.matvec(v), dense @ v, rtol=1e-10, atol=1e-12)
    columns = torch.randn(block.numel, 11, dtype=torch.float64)
    assert torch.allclose(op.matmat(columns), dense @ columns, rtol=1e-10, atol=1e-12)
    # a wrong sign or a missing 1/n is far outside the tolerance
    assert not torch.allclose(op.matvec(v), dense @ v - 2 * LAMBDA * v, rtol=1e-6)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.unused = nn.Linear(64, 10), nn.Linear(3, 2)  # ``unused``: registered, never called

    def forward(self, x):
        return self.net(x)


def test_a_block_the_loss_does_not_reach_has_only_the_decay(data):
    """A parameter the forward pass never uses (its gradient is not even defined by autograd): the product is
    the weight decay's lambda v, as the vmapped columns give it."""
    torch.manual_seed(4)
    model = _WithUnused().double()
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.all_parameters(model)
    unused = [i for i, part in enumerate(block.parts) if part.name.startswith("unused")]
    assert unused
    op = BlockHessian(model, task, data, block, LAMBDA)
    v = torch.zeros(block.numel, dtype=torch.float64)
    start = block.offsets[unused[0]]
    v[start:start + 6] = torch.randn(6, dtype=torch.float64)
    assert torch.allclose(op.matvec(v), LAMBDA * v, rtol=0, atol=1e-14)
    assert torch.allclose(op.matmat(v[:, None])[:, 0], LAMBDA * v, rtol=0, atol=1e-14)
