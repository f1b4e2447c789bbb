"""The Ray layer on a real local Ray (one per session, loopback, 2 CPUs): sharded probe,
worker crashes mid-shard, sharded curvature, and a whole removal through the Ray hooks."""
from __future__ import annotations

import os

import pytest
import torch

from cluster.curvature_pool import RayCurvatureFactory
from cluster.pool import WorkerPool
from cluster.probe_pool import RayProbeRunner
from cluster.shards import aligned_ranges
from cluster.worker import FaultPlan
from pipeline.removal import remove
from pipeline.curvature import BlockHessian
from pipeline.data import load_source
from pipeline.models.card import load_model_dir
from pipeline.param_block import ParamBlock
from pipeline.methods.base import CurvatureFactory, PerturbOptions, ProbeRunner
from pipeline.probe import run_probe
from tests.kit import load_in_dtype

MLP = {"hidden": [24, 16]}
PERTURB = PerturbOptions(perturb_sigma=0.1)


@pytest.fixture(scope="module")
def mlp_dir(trained_model_dir):
    return trained_model_dir("mlp", MLP, steps=3)


@pytest.fixture(scope="module")
def forget_batch():
    return load_source("digits")["train"].take(torch.arange(0, 6)).columns


def probe_in_process(model_dir, forget, perturbations, pass_size):
    model, task, _ = load_model_dir(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (one CPU each)
    try:
        return run_probe(model, task, forget, seed=11, start=0, stop=perturbations, pass_size=pass_size,
                         perturb_options=PERTURB)
    finally:
        torch.set_num_threads(threads)


def test_shard_plans_tile_whole_passes():
    assert aligned_ranges(100, 16, 3) == [(0, 48), (48, 80), (80, 100)]
    assert aligned_ranges(10, 16, 4) == [(0, 10)]
    for p, ps, k in [(1000, 32, 7), (97, 5, 4), (64, 64, 2)]:
        ranges = aligned_ranges(p, ps, k)
        assert ranges[0][0] == 0 and ranges[-1][1] == p
        assert all(a % ps == 0 and a < b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    assert aligned_ranges(1437, 256, 2) == [(0, 768), (768, 1437)]
    with pytest.raises(ValueError, match="perturbations must be >= 1"):
        aligned_ranges(0, 16, 2, "perturbations")


@pytest.mark.parametrize("seam,impl", [(ProbeRunner, RayProbeRunner), (CurvatureFactory, RayCurvatureFactory)])
def test_ray_versions_satisfy_the_typed_seams(seam, impl):
    """Every parameter of the seam's protocol is accepted by the Ray version, by the same name
    and kind (positional / keyword-only), so the method can call either."""
    import inspect

    want = inspect.signature(seam.__call__).parameters
    have = inspect.signature(impl.__call__).parameters
    for name, param in want.items():
        assert name in have, (impl.__name__, name)
        assert have[name].kind == param.kind, (impl.__name__, name, have[name].kind, param.kind)


def test_perturb_options_reject_unknown_keys():
    """The probe's options keep the settings' names; a misspelt key is an error, not ignored."""
    from pipeline.tasks import DenseInputTask

    batch = load_source("digits")["train"].take(torch.arange(0, 2)).columns
    task = DenseInputTask()
    moved = task.perturb(batch, torch.Generator().manual_seed(0), **PERTURB)
    assert not torch.equal(moved["x"], batch["x"])
    with pytest.raises(ValueError, match="sigma"):
        task.perturb(batch, torch.Generator(), sigma=0.1)  # the old renamed key
    with pytest.raises(ValueError, match="k"):
        task.perturb(batch, torch.Generator(), k=2)


def test_sharded_probe_is_bit_identical_for_1_and_2_workers(ray_local, mlp_dir, forget_batch):
    model, task, _ = load_model_dir(mlp_dir)
    runs = {}
    for workers, per_worker in [(1, 1), (2, 2)]:
        with WorkerPool(mlp_dir, workers=workers, runtime=ray_local) as pool:
            runner = RayProbeRunner(pool, shards_per_worker=per_worker)
            runs[workers] = runner(model, task, forget_batch, seed=11, perturbations=200, pass_size=16,
                                   perturb_options=PERTURB)
            assert len(runner.last["shards"]) == workers * per_worker
    local = probe_in_process(mlp_dir, forget_batch, 200, 16)
    assert runs[1].activations.shape == (200, 24 + 16 + 10)
    assert torch.equal(runs[1].activations, runs[2].activations)
    assert torch.equal(runs[1].losses, runs[2].losses)
    assert torch.equal(runs[2].activations, local.activations)
    assert torch.equal(runs[2].losses, local.losses)


@pytest.mark.parametrize("restarts", [2, 0], ids=["ray-restart", "driver-replaces"])
def test_worker_killed_mid_shard_is_retried_with_the_same_result(ray_local, mlp_dir, forget_batch, tmp_path, restarts):
    model, task, _ = load_model_dir(mlp_dir)
    marker = tmp_path / "crashed"
    fault = FaultPlan(marker=str(marker), probe_shard=1)
    with WorkerPool(mlp_dir, workers=2, runtime=ray_local, fault=fault, max_restarts=restarts) as pool:
        pids = {d["pid"] for d in pool.describe}
        runner = RayProbeRunner(pool)
        result = runner(model, task, forget_batch, seed=11, perturbations=200, pass_size=16,
                        perturb_options=PERTURB)
        assert marker.exists()  # the worker running shard 1 really exited mid-shard
        crashed_pid = int(marker.read_text())
        assert crashed_pid in pids
        assert pool.replacements == (0 if restarts else 1)
    local = probe_in_process(mlp_dir, forget_batch, 200, 16)
    assert torch.equal(result.activations, local.activations)
    assert torch.equal(result.losses, local.losses)


@pytest.fixture(scope="module")
def linear64_dir(trained_model_dir):
    return trained_model_dir("linear", {}, dtype=torch.float64, steps=8)


def test_sharded_curvature_matches_block_hessian_in_float64(ray_local, linear64_dir, tmp_path):
    model, task = load_in_dtype(linear64_dir, "linear", {}, torch.float64)
    data = load_source("digits", {"dtype": "float64"})["train"]
    rows = {"1.weight": [0, 3, 7], "1.bias": [0, 3, 7]}
    block = ParamBlock.from_rows(model, rows)
    local = BlockHessian(model, task, data, block, 0.01, reduction="mean", batch_size=200)
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(block.numel, generator=gen, dtype=torch.float64)
    cols = torch.randn(block.numel, 5, generator=gen, dtype=torch.float64)
    fault = FaultPlan(marker=str(tmp_path / "crashed"), product_call=1)
    with WorkerPool(linear64_dir, workers=2, runtime=ray_local, fault=fault) as pool:
        assert pool.describe[0]["dtype"] == "torch.float64"  # the directory keeps its float64 ...
        factory = RayCurvatureFactory(pool)
        op = factory(model, task, data, block, 0.01, reduction="mean", batch_size=200)
        hv = op.matvec(v)  # ... and the workers compute with the driver's float64 weights
        hv_again = op.matvec(v)  # product call 1: one worker dies, Ray restarts it, same numbers
        hm = op.matmat(cols)
        summed = RayCurvatureFactory(pool, exact_order=False)(model, task, data, block, 0.01,
                                                              reduction="sum", batch_size=200)
        hv_sum = summed.matvec(v)
        factory.close()
    assert (tmp_path / "crashed").exists()
    want = local.matvec(v)
    scale = float(want.abs().max())
    assert float((hv - want).abs().max()) <= 1e-10 * scale
    assert torch.equal(hv, want)  # the driver adds per-batch products in the in-process order
    assert torch.equal(hv_again, hv)
    assert torch.equal(hm, local.matmat(cols))
    want_sum = BlockHessian(model, task, data, block, 0.01, reduction="sum", batch_size=200).matvec(v)
    assert float((hv_sum - want_sum).abs().max()) <= 1e-10 * float(want_sum.abs().max())


def test_removal_through_ray_hooks_equals_in_process(ray_local, mlp_dir):
    # selection lfoci so the probe runs on the workers; the refusal threshold is off because
    # this test compares the Ray path with the in-process one, not the step's quality
    settings = {"selection": "lfoci", "perturbations": 64, "pass_size": 16, "max_slices": 3,
                "min_gradient_reduction": 0.0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the driver's own products (gradients, line search) in one order both times
    try:
        baseline = remove(mlp_dir, [6, 17, 41], settings=settings, seed=3, batch_size=512)
        with WorkerPool(mlp_dir, workers=2, runtime=ray_local) as pool:
            factory = RayCurvatureFactory(pool)
            distributed = remove(mlp_dir, [6, 17, 41], settings=settings, seed=3, batch_size=512,
                                 probe_runner=RayProbeRunner(pool), curvature_factory=factory)
            assert sum(op.products for op in factory.operators) > 0
    finally:
        torch.set_num_threads(threads)
    assert distributed.record["selection"]["selected"] == baseline.record["selection"]["selected"]
    for key, value in baseline.new_state.items():
        assert torch.equal(distributed.new_state[key], value), key
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"


def test_a_set_memory_budget_reaches_the_workers_and_auto_stays_theirs(ray_local, mlp_dir, linear64_dir, forget_batch):
    """A budget the removal sets is the workers' budget too: one that cannot hold a single probe
    pass or Hessian chunk fails on the workers with the setting's message (the driver sized
    nothing here); under ``auto`` the same calls run on each worker's own machine budget."""
    from pipeline import memory

    assert memory.forwarded(memory.MemoryBudget.from_setting("auto")) is None
    assert memory.forwarded(memory.MemoryBudget.from_setting("3MiB")) == 3 * 2**20
    tiny = memory.MemoryBudget(64)
    model, task, _ = load_model_dir(mlp_dir)
    with WorkerPool(mlp_dir, workers=2, runtime=ray_local) as pool:
        # a local Ray: both workers compute in this machine's memory, so each takes half a budget
        assert len({d["node"] for d in pool.describe}) == 1 and pool.sharing == 2
        runner = RayProbeRunner(pool)
        with memory.use_budget(tiny), pytest.raises(
                memory.MemoryBudgetError, match=r"memory_budget 32 B \(the set 64 B shared by 2 workers on one machine\)"):
            runner(model, task, forget_batch, seed=11, perturbations=32, pass_size=16, perturb_options=PERTURB)
        result = runner(model, task, forget_batch, seed=11, perturbations=32, pass_size=16, perturb_options=PERTURB)
    assert result.activations.shape == (32, 24 + 16 + 10)
    model64, task64 = load_in_dtype(linear64_dir, "linear", {}, torch.float64)
    data = load_source("digits", {"dtype": "float64"})["train"]
    block = ParamBlock.from_rows(model64, {"1.weight": [0, 3], "1.bias": [0, 3]})
    v = torch.ones(block.numel, dtype=torch.float64)
    with WorkerPool(linear64_dir, workers=2, runtime=ray_local) as pool:
        factory = RayCurvatureFactory(pool)
        with memory.use_budget(tiny):
            op = factory(model64, task64, data, block, 0.01, reduction="mean", batch_size=200)
        with pytest.raises(memory.MemoryBudgetError, match="memory_budget 32 B .*shared by 2 workers"):
            op.matvec(v)
        want = BlockHessian(model64, task64, data, block, 0.01, reduction="mean", batch_size=200).matvec(v)
        got = factory(model64, task64, data, block, 0.01, reduction="mean", batch_size=200).matvec(v)
        factory.close()
    assert torch.allclose(got, want, rtol=1e-12, atol=0.0)
