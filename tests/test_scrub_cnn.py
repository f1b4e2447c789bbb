"""Fisher, NTK and Mixed-Linear forgetting on a small CNN fine-tuned on Fashion-MNIST.

Pre-training: 2,000 Fashion-MNIST training images (14x14) -> w0. Fine-tuning from w0 on
D = 400 other images with L_D = mean CE + (lambda/2)||w||^2; forget 40 random samples of D;
the reference is the model retrained from w0 on D_r with the same recipe. Each method must
move forget-set accuracy toward the retrained model's while keeping retain accuracy within 2
points of it. ``pytest -s`` prints the table.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

from pipeline.data import SampleSet
from pipeline.linearized import LinearizedModel
from pipeline.methods import get_method
from pipeline.methods.base import RemovalProblem
from pipeline.methods.mixed_linear import forget_user_data, train_user_weights, user_block
from pipeline.models.small import build_small_cnn
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs, fit_sgd
from tests.scrub_helpers import fashion_subset, one_thread  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
LAMBDA = 1e-2       # weight decay of the fine-tuning objective
LAMBDA_ML = 1e-3    # weight decay of the Mixed-Linear user objective (MSE on one-hot targets)


def accuracy(predict, data: SampleSet) -> float:
    with torch.no_grad():
        return 100.0 * float((predict(data.columns).argmax(1) == data.columns["y"]).float().mean())


@pytest.fixture(scope="module")
def fashion():
    torch.manual_seed(0)
    xp, yp = fashion_subset("train", 2000, start=0)
    xd, yd = fashion_subset("train", 400, start=20000)
    xt, yt = fashion_subset("t10k", 1000)
    pre = SampleSet({"x": xp, "y": yp}, torch.arange(2000))
    d = SampleSet({"x": xd, "y": yd}, torch.arange(400))
    test = SampleSet({"x": xt, "y": yt}, torch.arange(1000))
    task = DenseInputTask(loss="cross_entropy")
    model = build_small_cnn(width=4, image_size=14)  # 5,658 parameters
    fit_sgd(model, task, pre, 5e-4, epochs=8, lr=0.05, batch_size=64, seed=0)
    model.eval()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    forget = torch.randperm(400, generator=torch.Generator().manual_seed(1))[:40]
    return model, task, w0, d, test, forget


def test_methods_move_forget_accuracy_toward_retrain(fashion):
    base, task, w0, d, test, forget = fashion
    retain, forget_set = d.without(forget), d.take(forget)
    sets = {"forget": forget_set, "retain": retain, "test": test}
    rows: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}

    def measure(name: str, predict) -> None:
        rows[name] = {k: accuracy(predict, s) for k, s in sets.items()}

    t = time.perf_counter()
    original = copy.deepcopy(base)
    fit_lbfgs(original, task, d, LAMBDA, max_steps=8, tolerance=1e-6)
    retrained = copy.deepcopy(base)
    fit_lbfgs(retrained, task, retain, LAMBDA, max_steps=8, tolerance=1e-6)
    seconds["fine-tune + retrain"] = time.perf_counter() - t
    for m in (original, retrained):
        m.eval()
    measure("original", lambda b: original(b["x"]))
    measure("retrain", lambda b: retrained(b["x"]))

    runs = {
        # Newton step with the exact Hessian of the last layer, corrected noise on it.
        "fisher": {"parameters": ["9.weight", "9.bias"], "curvature": "dense", "tradeoff": 1e-6, "sigma_h": 1.0},
        # All parameters, CE variant (identity output Hessian, softmax residual), trapezium rescaling.
        "ntk": {},
    }
    for name, settings in runs.items():
        work = copy.deepcopy(original)
        method = get_method(name)
        problem = RemovalProblem(work, task, d, forget, LAMBDA, seed=0, extras={"w0": w0})
        t = time.perf_counter()
        outcome = method.run(problem, method.Settings(**settings))
        seconds[name] = time.perf_counter() - t
        measure(name, lambda b, m=work: m(b["x"]))
        if name == "ntk":
            seconds["ntk scale"] = outcome.record["scale"]

    # Mixed-Linear: core = w0 (pre-trained), user weights = the last two Linear layers (5,322).
    t = time.perf_counter()
    lin = LinearizedModel(base, DenseInputTask(loss="mse"), user_block(base, last_modules=2))
    trained = train_user_weights(lin, d, LAMBDA_ML, rtol=1e-6).user_weights
    forgot = forget_user_data(lin, trained, retain, LAMBDA_ML, rtol=1e-6).user_weights
    seconds["mixed-linear (train + forget)"] = time.perf_counter() - t
    ml_retrained = train_user_weights(lin, retain, LAMBDA_ML, rtol=1e-6).user_weights
    measure("ML original", lambda b: lin.predict(b, trained))
    measure("ML forgotten", lambda b: lin.predict(b, forgot))
    measure("ML retrain", lambda b: lin.predict(b, ml_retrained))

    print("\n  model              forget  retain    test   (accuracy %, Fashion-MNIST 14x14, small CNN)")
    for name, r in rows.items():
        print(f"  {name:16s} {r['forget']:7.1f} {r['retain']:7.1f} {r['test']:7.1f}")
    print("  " + ", ".join(f"{k}: {v:.2f}" + ("" if k == "ntk scale" else " s") for k, v in seconds.items()))

    orig, ref = rows["original"], rows["retrain"]
    assert orig["forget"] - ref["forget"] >= 10  # the forget set is memorised: there is something to remove
    for name in runs:
        r = rows[name]
        assert abs(r["forget"] - ref["forget"]) < abs(orig["forget"] - ref["forget"]), name
        assert abs(r["retain"] - ref["retain"]) <= 2.0, name
    ml, ml_ref, ml_orig = rows["ML forgotten"], rows["ML retrain"], rows["ML original"]
    assert abs(ml["forget"] - ml_ref["forget"]) < abs(ml_orig["forget"] - ml_ref["forget"])
    assert abs(ml["retain"] - ml_ref["retain"]) <= 2.0
