"""BlockHessian's products against torch.func.hessian's dense Hessian of the same objective: one vector
(reverse-over-reverse, each conjugate-gradient product) and a block of columns (forward-over-reverse, vmapped)
are the same exact matrix, on a partial block, over uneven batches, with the weight decay; where double backward
could be silently wrong or change the model, the one-vector product takes the forward-over-reverse form.
block_gradient (one reverse pass) against torch.func.grad of the same objective."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian

from pipeline.curvature import BlockHessian, block_gradient
from pipeline.param_block import ParamBlock
from pipeline.tasks import DenseInputTask
from tests.kit import digits64

LAMBDA = 0.05


@pytest.fixture(scope="module")
def data():
    return digits64()["train"].take(torch.arange(37))  # batches of 16, 16 and 5


def _curvature(model, task, data, block) -> torch.Tensor:
    """Hessian of sum_z loss(w + E_P delta, z) at delta = 0, by torch.func.hessian (no decay)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def objective(delta):
        out = functional_call(model, {**block.insert(params, delta), **buffers}, (data.columns["x"],))
        return task.per_sample_loss(out, data.columns).sum()

    return hessian(objective)(torch.zeros(block.numel, dtype=torch.float64))


def _check_products(model, task, data, block, reduction):
    op = BlockHessian(model, task, data, block, LAMBDA, reduction=reduction, batch_size=16, columns_per_pass=8)
    n = len(data) if reduction == "mean" else 1
    ridge = LAMBDA if reduction == "mean" else LAMBDA * len(data)
    eye = torch.eye(block.numel, dtype=torch.float64)
    curvature = _curvature(model, task, data, block)
    dense = curvature / n + ridge * eye
    torch.manual_seed(5)
    v = torch.randn(block.numel, dtype=torch.float64)
    product = op.matvec(v)
    assert torch.allclose(product, dense @ v, rtol=1e-10, atol=1e-12)
    columns = torch.randn(block.numel, 11, dtype=torch.float64)
    assert torch.allclose(op.matmat(columns), dense @ columns, rtol=1e-10, atol=1e-12)
    # the tolerance tells a wrong sign of the curvature, or (mean) a missing 1/n, from the product
    assert not torch.allclose(product, (-curvature / n + ridge * eye) @ v, rtol=1e-6)
    if reduction == "mean":
        assert not torch.allclose(product, (curvature + ridge * eye) @ v, rtol=1e-6)
    return op


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_vector_and_a_block_of_columns_are_the_exact_hessian(data, reduction):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10)).double()
    block = ParamBlock.from_rows(model, {"1.weight": [0, 4, 7], "3.weight": None, "3.bias": None})
    op = _check_products(model, DenseInputTask(loss="cross_entropy"), data, block, reduction)
    assert op._twice_differentiable  # the one-vector products took the double backward


def test_a_convolution_with_batch_norm_in_eval_mode(data):
    """Rows of a convolution and the batch norm's scale, in eval mode: the running statistics are read, never
    updated by the products."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(144, 10)).double()
    with torch.no_grad():  # statistics that are not the initial 0 / 1
        model[2].running_mean.uniform_(-0.5, 0.5)
        model[2].running_var.uniform_(0.5, 2.0)
    model.eval()
    before = {n: b.clone() for n, b in model.named_buffers()}
    block = ParamBlock.from_rows(model, {"1.weight": [1, 3], "2.weight": None, "5.weight": [0, 9]})
    _check_products(model, DenseInputTask(loss="cross_entropy"), data, block, "mean")
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_block_gradient_is_the_functional_gradient_on_rows_with_a_frozen_layer(data, reduction):
    """block_gradient against torch.func.grad of sum_z loss(w + E_P delta, z) at delta = 0 plus the decay: rows of a
    convolution, the batch norm's scale (eval mode) and a whole bias, beside a frozen layer, over uneven batches. The
    tolerance tells a missing decay term, a missing 1/n or rows out of order; nothing of the model is written."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(144, 10)).double()
    with torch.no_grad():
        model[2].running_mean.uniform_(-0.5, 0.5)
        model[2].running_var.uniform_(0.5, 2.0)
    model[1].bias.requires_grad_(False)  # a frozen parameter in front of the block's
    model.eval()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.from_rows(model, {"1.weight": [3, 0], "2.weight": None, "5.bias": None})
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def objective(delta):
        out = functional_call(model, {**block.insert(params, delta), **buffers}, (data.columns["x"],))
        return task.per_sample_loss(out, data.columns).sum()

    loss_part = grad(objective)(torch.zeros(block.numel, dtype=torch.float64))
    decay = len(data) * LAMBDA * block.gather(params)
    scale = 1.0 / len(data) if reduction == "mean" else 1.0
    got = block_gradient(model, task, data, block, LAMBDA, reduction=reduction, batch_size=16)
    assert torch.allclose(got, scale * (loss_part + decay), rtol=1e-12, atol=1e-14)
    assert not torch.allclose(got, scale * loss_part, rtol=1e-6)  # the decay is there
    assert not torch.allclose(got, scale * (loss_part.flip(0) + decay), rtol=1e-6)  # in the block's order
    if reduction == "mean":
        assert not torch.allclose(got, loss_part + decay, rtol=1e-6)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_module_in_training_mode_with_buffers_takes_the_forward_over_reverse_form(data):
    """Batch normalisation in training mode updates its running statistics in the forward pass: never run by
    plain autograd on the model's own buffers."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 10)).double()
    model.train()
    op = BlockHessian(model, DenseInputTask(loss="cross_entropy"), data, ParamBlock.all_parameters(model), LAMBDA)
    assert op._twice_differentiable is False


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.unused = nn.Linear(64, 10), nn.Linear(3, 2)  # ``unused``: registered, never called

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("rows", [{"unused.weight": None, "unused.bias": None},
                                  {"net.bias": None, "unused.weight": [1]}])
def test_parameters_the_loss_does_not_reach_have_only_the_decay(data, rows):
    """A block of parameters the forward pass never uses, alone or beside used ones: their rows of the product
    are the weight decay's lambda v, in both forms."""
    torch.manual_seed(4)
    model = _WithUnused().double()
    task = DenseInputTask(loss="cross_entropy")
    block = ParamBlock.from_rows(model, rows)
    op = BlockHessian(model, task, data, block, LAMBDA)
    unused = torch.zeros(block.numel, dtype=torch.bool)
    for offset, part in zip(block.offsets, block.parts):
        unused[offset:offset + part.numel] = part.name.startswith("unused")
    v = torch.randn(block.numel, dtype=torch.float64) * unused
    assert torch.allclose(op.matvec(v), LAMBDA * v, rtol=0, atol=1e-14)
    assert torch.allclose(op.matmat(v[:, None])[:, 0], LAMBDA * v, rtol=0, atol=1e-14)


class _Cube(torch.autograd.Function):
    """x^3 with a backward marked once-differentiable and no forward-mode rule."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * grad_out


class _CubeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(64, 5), nn.Linear(5, 10)

    def forward(self, x):
        return self.last(_Cube.apply(self.first(x)))


def test_a_custom_function_is_never_differentiated_twice(data):
    """A custom autograd.Function in the graph: the one-vector product takes the forward-over-reverse form,
    which refuses a Function without a forward-mode rule (an error, never a silently wrong product)."""
    torch.manual_seed(7)
    model = _CubeNet().double()
    op = BlockHessian(model, DenseInputTask(loss="cross_entropy"), data, ParamBlock.all_parameters(model), LAMBDA)
    with pytest.raises(RuntimeError):
        op.matvec(torch.randn(op.dim, dtype=torch.float64))
    assert op._twice_differentiable is False


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "both infinities"])
def test_a_gradient_with_a_non_finite_entry_is_refused_and_an_overflowing_sum_is_not(data, bad):
    """check_finite reads the sum first (a finite sum proves every entry finite): a NaN, an infinity, and +inf beside
    -inf (whose sum is NaN) are refused by name; finite entries whose sum overflows pass, and a non-finite gradient
    pass raises before anything is returned."""
    from pipeline.curvature.solve import check_finite
    from pipeline.errors import NonFiniteGradientError

    t = torch.ones(1000, dtype=torch.float64)
    if bad == "both infinities":
        t[3], t[700] = float("inf"), -float("inf")
    else:
        t[500] = bad
    with pytest.raises(NonFiniteGradientError, match="the gradient contains NaN or infinite"):
        check_finite(t, "gradient")
    huge = torch.full((4,), 1.0e308, dtype=torch.float64)
    assert not torch.isfinite(huge.sum()) and check_finite(huge, "gradient") is huge

    model = nn.Sequential(nn.Linear(data.columns["x"].shape[1], 10)).double()
    with torch.no_grad():
        model[0].weight[2, 5] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        block_gradient(model, DenseInputTask(loss="cross_entropy"), data, ParamBlock.all_parameters(model), 0.0)
