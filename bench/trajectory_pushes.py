"""How far trajectory-refit's pushes are from the run's own: the recipe replayed step for step, a random forget
set's exact pushes read along it, against the checkpoint estimates the method uses.

    python -m bench.trajectory_pushes --threads 1     # the identities ResNet (configs/models/reid-identities.yaml)
    python -m bench.trajectory_pushes --model-dir runs/models/reid-identities --fraction 0.01
    python -m bench.trajectory_pushes --quick         # the same on fewer identities and epochs

Heavy-ball SGD moves the weights by w_K - w_0 = - sum_k c_k g_k (``pipeline.trajectory``), so U's own pushes are
    P_U = sum_k c_k (1 / B) sum_{z in U and in batch k} grad loss(w_k, z),
read here exactly: the recipe is replayed from its recorded first checkpoint by ``pipeline.training.fit_sgd`` itself
(the replay must end on the saved weights to the bit; the file says whether it did), each step's gradient of U's
members kept (under the batch's statistics, as training computed it). The method's estimate
(``pipeline.target.recorded_pushes.forget_pushes``) is the trapezium over the recorded checkpoints,
(1 / n) sum_e C_e (G_U(c_e) + G_U(c_{e+1})) / 2; the midpoint rule at each epoch's c_k-weighted mean iterate is
measured beside it. For all of D the exact pushes are known without a replay: (w_0 - w_K) less the weight decay's
share lambda sum_k c_k w_k. Each estimate is then added back without a refit at a few scales, and the mean loss on U
and on a probe of D \\ U read. Writes bench/results/trajectory_pushes[_quick].json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from bench.common import RESULTS_DIR, machine_info, write_json
from pipeline.curvature.hessian import block_gradient
from pipeline.data import SampleSet
from pipeline.param_block import ParamBlock
from pipeline.recipe import init_of, initial_model, recipe_of
from pipeline.target.recorded_pushes import forget_pushes
from pipeline.target.replay import ReplaySchedule
from pipeline.trajectory import Trajectory, load_checkpoint, stretch_rates
from pipeline.training import fit_sgd, mean_loss

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "models" / "reid-identities.yaml"
PROFILES: dict[str, dict[str, Any]] = {
    "full": {"data": {}, "recipe": {}, "fraction": 0.1, "probe": 1024, "scales": [0.1, 0.3, 1.0]},
    "quick": {"data": {"ids": 32, "per_id_train": 16, "per_id_test": 4}, "recipe": {"epochs": 6},
              "fraction": 0.1, "probe": 256, "scales": [0.1, 0.3, 1.0]},
    "smoke": {"data": {"ids": 8, "per_id_train": 8, "per_id_test": 2, "height": 16, "width": 8},
              "model": {"num_classes": 8, "image_size": 16, "width": 4, "layers": [1, 1, 1, 1]},
              "recipe": {"epochs": 2, "batch_size": 16}, "fraction": 0.25, "probe": 32, "scales": [0.3]},
}
U_SEED = 11  # the random forget set's seed


def flat(params: list[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in params])


def exact_pushes(model: nn.Module, task: Any, data: SampleSet, recipe: Any, forget: Tensor
                 ) -> tuple[Tensor, list[Tensor], Tensor]:
    """Replay ``recipe`` on ``data`` from the weights ``model`` holds (its recorded first checkpoint) by
    ``fit_sgd``: (U's exact pushes sum_k c_k (1/B) sum_{U in batch k} grad loss(w_k, z), each epoch's c_k-weighted
    mean iterate, lambda sum_k c_k w_k); U = ``forget`` (positions in ``data``). ``model`` ends where the run ends."""
    params = [p for p in model.parameters() if p.requires_grad]
    schedule = ReplaySchedule(recipe.epochs, recipe.lr, recipe.momentum, recipe.batch_size, recipe.weight_decay)
    c = stretch_rates(schedule.step_rates(len(data)), schedule.momentum, 1)  # c_k, stretches of one step
    per_epoch = len(c) // recipe.epochs
    in_forget = torch.zeros(len(data), dtype=torch.bool)
    in_forget[forget] = True
    pushes = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    decay = torch.zeros_like(pushes)
    sums = [torch.zeros_like(pushes) for _ in range(recipe.epochs)]
    weights = [0.0] * recipe.epochs

    def on_batch(step: int, positions: Tensor, per_sample: Tensor) -> None:
        w = flat(params)
        sums[step // per_epoch] += c[step] * w
        weights[step // per_epoch] += c[step]
        decay.add_(c[step] * recipe.weight_decay * w)
        mask = in_forget[positions.cpu()].to(per_sample.device)
        if bool(mask.any()):
            grads = torch.autograd.grad(per_sample[mask].sum() / len(positions), params, retain_graph=True)
            pushes.add_(c[step] * flat(list(grads)))

    fit_sgd(model, task, data, recipe.weight_decay, epochs=recipe.epochs, lr=recipe.lr, batch_size=recipe.batch_size,
            momentum=recipe.momentum, seed=recipe.seed, report_samples=recipe.report_samples, on_batch=on_batch)
    return pushes, [s / w for s, w in zip(sums, weights)], decay


def midpoint_pushes(model: nn.Module, trajectory: Trajectory, means: list[Tensor],
                    gradient: Callable[[], Tensor]) -> Tensor:
    """(1 / n) sum_e C_e G_U(mean iterate of e), each mean loaded with the end-of-stretch checkpoint's buffers."""
    params = [p for p in model.parameters() if p.requires_grad]
    kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    try:
        for e, mean in enumerate(means):
            load_checkpoint(model, trajectory.checkpoints[e + 1])
            with torch.no_grad():
                for p, value in zip(params, torch.split(mean, [p.numel() for p in params])):
                    p.copy_(value.view_as(p).to(p.dtype))
            total += trajectory.rates[e] * gradient()
    finally:
        model.load_state_dict(kept)
    return total / trajectory.n


def compare(estimate: Tensor, exact: Tensor) -> dict[str, float]:
    return {"norm": float(estimate.norm()), "relative_error": float((estimate - exact).norm() / exact.norm()),
            "cosine": float(estimate @ exact / (estimate.norm() * exact.norm()))}


def train_model(profile: dict[str, Any], out: Path) -> None:
    """``unlearn train`` of configs/models/reid-identities.yaml with the profile's changes, into ``out``."""
    import yaml

    from pipeline.trainer import TrainConfig, run_training

    raw = yaml.safe_load(CONFIG.read_text())
    raw["data"]["options"].update(profile["data"])
    raw["model"]["options"].update(profile.get("model", {}))
    raw["recipe"].update(profile["recipe"])
    if "num_classes" not in profile.get("model", {}) and "ids" in profile["data"]:
        raw["model"]["options"]["num_classes"] = profile["data"]["ids"]
    raw["output"] = str(out)
    run_training(TrainConfig.model_validate(raw), out)


def run(model_dir: Path, profile: dict[str, Any], seed: int = U_SEED) -> dict[str, Any]:
    from pipeline.removal import load_trained

    started = time.perf_counter()
    trained = load_trained(model_dir)
    model, task, data, trajectory = trained.model, trained.task, trained.train, trained.trajectory
    if trajectory is None:
        raise SystemExit(f"--model-dir: {model_dir} holds no recorded trajectory (train it with an SGD recipe)")
    recipe = recipe_of(trained.card)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n = len(data)
    m = max(1, round(profile["fraction"] * n))
    forget = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:m].sort().values
    start, _, _ = initial_model(trained.card.preset, trained.card.options, seed=recipe.seed, init=init_of(trained.card))
    replay = start.to(next(model.parameters()).dtype)
    t0 = time.perf_counter()
    exact_u, means, decay = exact_pushes(replay, task, data, recipe, forget)
    replay_seconds = time.perf_counter() - t0
    replayed = replay.state_dict()
    bitwise = all(torch.equal(replayed[k], final[k]) for k in final if final[k].is_floating_point())
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    first, last = (torch.cat([ck[k].reshape(-1).double() for k in names])
                   for ck in (trajectory.checkpoints[0], trajectory.checkpoints[-1]))
    data_pushes = first - last - decay  # exact: w_0 - w_K = sum_k c_k (data gradient + lambda w_k)
    model.eval()
    block = ParamBlock.all_parameters(model)
    u_set, retain = data.take(forget), data.without(forget)
    probe = retain.take(torch.arange(min(profile["probe"], len(retain))))

    def gradient(samples: SampleSet) -> Callable[[], Tensor]:
        return lambda: block_gradient(model, task, samples, block, 0.0, reduction="sum", batch_size=512)

    t0 = time.perf_counter()
    trapezium_d = forget_pushes(model, trajectory, gradient(data))
    trapezium_seconds = time.perf_counter() - t0
    trapezium_u = forget_pushes(model, trajectory, gradient(u_set))
    midpoint_u = midpoint_pushes(model, trajectory, means, gradient(u_set))
    kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses: dict[str, list[dict[str, float]]] = {}
    with torch.no_grad():
        original = {"forget": float(mean_loss(model, task, u_set, 512)), "retained_probe": float(
            mean_loss(model, task, probe, 512))}
        for label, vector in (("exact", exact_u), ("midpoint", midpoint_u), ("trapezium", trapezium_u)):
            losses[label] = []
            for scale in profile["scales"]:
                block.add_to_model(model, scale * vector)
                losses[label].append({"scale": scale, "forget": float(mean_loss(model, task, u_set, 512)),
                                      "retained_probe": float(mean_loss(model, task, probe, 512))})
                model.load_state_dict(kept)
    return {
        "benchmark": "trajectory_pushes", "model_dir": str(model_dir), "n": n, "m": m, "forget_seed": seed,
        "parameters": block.numel, "checkpoints": len(trajectory.checkpoints), "recipe": recipe.model_dump(),
        "replay": {"bitwise_equal_to_the_saved_model": bitwise, "seconds": replay_seconds},
        "all_of_D": {"exact_norm": float(data_pushes.norm()), "trapezium": compare(trapezium_d, data_pushes),
                     "trapezium_seconds": trapezium_seconds},
        "forget_set": {"exact_norm": float(exact_u.norm()), "trapezium": compare(trapezium_u, exact_u),
                       "midpoint": compare(midpoint_u, exact_u)},
        "added_back_without_refit": {"original": original, **losses},
        "wall_seconds": time.perf_counter() - started, "environment": machine_info(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer identities and epochs")
    mode.add_argument("--smoke", action="store_true", help="tiny (tests)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a model trained by `unlearn train` with its trajectory (default: train one)")
    parser.add_argument("--fraction", type=float, default=None, help="the random forget set's share of D")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write")
    args = parser.parse_args(argv)
    if args.fraction is not None and not 0 < args.fraction < 1:
        parser.error("--fraction: a share of D strictly between 0 and 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    profile = {**PROFILES[name], **({"fraction": args.fraction} if args.fraction is not None else {})}
    out = args.out or RESULTS_DIR / ("trajectory_pushes" + ("" if name == "full" else f"_{name}") + ".json")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(scratch) / "model"
            train_model(profile, model_dir)
        result = run(model_dir, profile)
    result.update(profile=name, command=["python", "-m", "bench.trajectory_pushes", *(sys.argv[1:] if argv is None
                                                                                   else argv)])
    write_json(out, result)
    d, u = result["all_of_D"], result["forget_set"]
    print(f"replay bitwise: {result['replay']['bitwise_equal_to_the_saved_model']}; all of D: exact "
          f"{d['exact_norm']:.3g}, trapezium {d['trapezium']['norm']:.3g} (cosine {d['trapezium']['cosine']:.3f}); "
          f"U ({result['m']}): exact {u['exact_norm']:.3g}, trapezium {u['trapezium']['norm']:.3g} (cosine "
          f"{u['trapezium']['cosine']:.3f}), midpoint {u['midpoint']['norm']:.3g} (cosine "
          f"{u['midpoint']['cosine']:.3f});"
          f" wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
