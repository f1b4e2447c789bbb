"""Curvature in one place: one class per curvature as a linear operator, each tested against a
dense reference, and the one PCG every solver uses.

  operators     LinearOperator, Combination, DenseOperator, CappedProducts
  pcg           pcg: the preconditioned conjugate gradient (recycling pairs, non-positive
                curvature, exact convergence)
  solve         Newton systems to a stated tolerance (dense Cholesky / CG, Levenberg-Marquardt damping)
  hessian       exact gradients and Hessian-vector products restricted to a parameter block
  linear_layer  the closed-form Hessian of a Linear layer under cross-entropy (the decision layer)
  softmax_layer the decision-layer objective's matrix-free products and preconditioners
  newton        converged inexact Newton on the decision layer (newton_minimise)
  gauss_newton  the generalised Gauss-Newton matrix of a classifier head, its EK-FAC, the head step
  ggn           matrix-free Gauss-Newton products J^T H_loss J restricted to a block of any network
  kfac          K-FAC of a block's Gauss-Newton matrix (Linear and Conv2d rows) and its damped inverse
"""
from pipeline.curvature.ggn import BlockGaussNewton
from pipeline.curvature.hessian import BlockHessian, BlockObjective, block_gradient, gradient_batch_size
from pipeline.curvature.operators import CappedProducts, Combination, DenseOperator, LinearOperator, ProductsSpent
from pipeline.curvature.pcg import PCGResult, pcg
from pipeline.curvature.solve import SolveInfo, cg_solve, check_dense_solve, solve_dense, solve_newton_system

__all__ = [
    "BlockGaussNewton", "BlockHessian", "BlockObjective", "CappedProducts", "Combination", "DenseOperator", "LinearOperator", "PCGResult",
    "ProductsSpent", "SolveInfo", "block_gradient", "cg_solve", "check_dense_solve", "gradient_batch_size", "pcg",
    "solve_dense", "solve_newton_system",
]
