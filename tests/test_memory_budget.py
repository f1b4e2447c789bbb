"""Memory budgets (pipeline.memory): chunk sizing, the setting, chunked passes that give the
same sums, and real removals in a child process whose peak RSS growth stays inside the budget
(or that fail up front, naming memory_budget, and write nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline import memory
from pipeline.memory import MemoryBudget, MemoryBudgetError, ModelCost, chunk_size, parse_bytes

ROOT = Path(__file__).resolve().parents[1]


# -- the setting and the sizing arithmetic ----------------------------------------------------------
def test_parse_bytes_and_from_setting():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    assert MemoryBudget.from_setting("64KiB").bytes == 65536
    auto = MemoryBudget.from_setting("auto")
    assert auto.bytes > 0 and auto.source.startswith("auto")
    assert MemoryBudget.from_setting(None).source.startswith("auto")
    for bad in ("lots", "8 parsecs", -1, 0, "0GiB", True):
        with pytest.raises(MemoryBudgetError, match="memory_budget"):
            MemoryBudget.from_setting(bad)


def test_auto_is_a_fraction_of_available_memory():
    avail = memory.available_bytes()
    budget = MemoryBudget.auto()
    assert 0 < budget.bytes <= avail  # read at slightly different times; a fraction < 1 of it
    assert budget.bytes <= 0.75 * avail


def test_chunk_size_fits_never_exceeds_and_refuses_clearly():
    budget = MemoryBudget(1000)
    assert chunk_size(budget, per_item=100, fixed=0) == 10
    assert chunk_size(budget, per_item=100, fixed=350) == 6
    assert chunk_size(budget, per_item=100, fixed=0, limit=4) == 4  # never larger than asked
    assert chunk_size(budget, per_item=1000, fixed=0) == 1
    with pytest.raises(MemoryBudgetError) as err:
        chunk_size(MemoryBudget(512 * 2**20), per_item=1.3 * 2**30, what="Hessian column",
                   fix="choose fewer parameters")
    msg = str(err.value)
    assert "memory_budget 512 MiB cannot hold one Hessian column" in msg
    assert "needs ~1.3 GiB" in msg and "raise memory_budget" in msg and "fewer parameters" in msg
    assert isinstance(err.value, ValueError)


def test_hessian_chunks_shrink_within_budget():
    from pipeline.models import build
    from pipeline.param_block import ParamBlock

    model, _ = build("mlp", {"hidden": [16]})
    block = ParamBlock.all_parameters(model)
    cost = ModelCost(activation_bytes=1000, param_bytes=4 * block.numel, element_size=4)
    c, b = memory.hessian_chunks(MemoryBudget(1 << 40), cost, block, columns=128, batch_size=1024)
    assert (c, b) == (128, 1024)  # a large budget leaves the requested sizes alone
    for size in (2**22, 2**24, 2**26):
        c, b = memory.hessian_chunks(MemoryBudget(size), cost, block, columns=128, batch_size=1024)
        used = (4 * cost.touched_bytes(block) + b * ModelCost.HVP_PRIMAL * 1000
                + c * (6 * cost.touched_bytes(block) + 24 * block.numel + b * ModelCost.HVP_TANGENT * 1000))
        assert 1 <= c <= 128 and 1 <= b <= 1024 and used <= size
    with pytest.raises(MemoryBudgetError, match="cannot hold one Hessian column"):
        memory.hessian_chunks(MemoryBudget(2**14), cost, block, columns=128, batch_size=1024)


def test_activation_cost_counts_outputs_not_views():
    from pipeline.models import build

    model, task = build("mlp", {"hidden": [64]})
    one = {"x": torch.randn(1, 64), "y": torch.tensor([3])}
    cost = ModelCost.measure(model, task, one)
    # two addmm (64 + 10), tanh (64), log_softmax (10), the loss: ~600 bytes, not the 16 KiB
    # of the transposed weight views
    assert 4 * (64 + 64 + 10 + 10) <= cost.activation_bytes < 4096
    assert cost.param_bytes == 4 * sum(p.numel() for p in model.parameters())


# -- chunked passes give the same sums ----------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_problem():
    from pipeline.data import SampleSet
    from pipeline.models import build
    from pipeline.param_block import ParamBlock

    torch.manual_seed(0)
    model, task = build("mlp", {"hidden": [16]})
    model = model.double()
    n = 300
    data = SampleSet({"x": torch.randn(n, 64, dtype=torch.float64), "y": torch.randint(0, 10, (n,))}, torch.arange(n))
    return model, task, data, ParamBlock.all_parameters(model)


def test_chunked_hessian_gradient_and_probe_match_unchunked(mlp_problem):
    from pipeline.curvature import BlockHessian, block_gradient
    from pipeline.probe import run_probe

    model, task, data, block = mlp_problem
    big, small = MemoryBudget(1 << 40), MemoryBudget(3 * 2**20)
    cols = torch.randn(block.numel, 40, dtype=torch.float64)
    # the one channel: the scoped budget, read by each operator when it is built
    with memory.use_budget(big):
        h_big = BlockHessian(model, task, data, block, 0.01, batch_size=1024, columns_per_pass=128)
    with memory.use_budget(small):
        h_small = BlockHessian(model, task, data, block, 0.01, batch_size=1024, columns_per_pass=128)
    c, b = h_small._chunks(40)
    assert c < 40 and b < len(data)  # the small budget really splits both ways
    torch.testing.assert_close(h_small.matmat(cols), h_big.matmat(cols), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h_small.matvec(cols[:, 0]), h_big.matvec(cols[:, 0]), rtol=1e-10, atol=1e-12)
    assert memory.sample_chunk(MemoryBudget(2**17), memory.cost_of(model, task, data),
                               memory.cost_of(model, task, data).gradient_plan(block), limit=1024, what="x", fix="y") < 300
    with memory.use_budget(MemoryBudget(2**17)):
        tight = block_gradient(model, task, data, block, 0.01)
    with memory.use_budget(big):
        loose = block_gradient(model, task, data, block, 0.01)
    torch.testing.assert_close(tight, loose, rtol=1e-10, atol=1e-12)
    forget = {k: v[:20] for k, v in data.columns.items()}
    with memory.use_budget(big):
        whole = run_probe(model, task, forget, seed=3, start=0, stop=20, pass_size=8)
    with memory.use_budget(MemoryBudget(2**17)):
        sub = run_probe(model, task, forget, seed=3, start=0, stop=20, pass_size=8)
    torch.testing.assert_close(sub.activations, whole.activations, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sub.losses, whole.losses, rtol=1e-10, atol=1e-12)
    with memory.use_budget(MemoryBudget(512)), \
            pytest.raises(MemoryBudgetError, match="memory_budget .* cannot hold one perturbed forward pass"):
        run_probe(model, task, forget, seed=3, start=0, stop=20, pass_size=8)


def test_one_column_that_does_not_fit_fails_when_the_operator_is_built(mlp_problem):
    from pipeline.curvature import BlockHessian

    model, task, data, block = mlp_problem
    with memory.use_budget(MemoryBudget(2**15)), \
            pytest.raises(MemoryBudgetError, match=r"memory_budget .* cannot hold one Hessian column .* raise memory_budget"):
        BlockHessian(model, task, data, block, 0.01)
    with memory.use_budget(MemoryBudget(2 * 2**20)):
        op = BlockHessian(model, task, data, block, 0.01)
    with pytest.raises(MemoryBudgetError, match="cannot hold the dense .* lower dense_max"):
        op.to_dense()  # 1210 x 1210 float64, twice: ~22 MiB


# -- the setting where users write it ------------------------------------------------------------------
def test_configs_accept_memory_budget_and_examples_still_parse():
    from jobs.forget import ForgetConfig
    from pipeline.config import CONFIGS_DIR, ConfigError, load_yaml, parse
    from pipeline.evaluate.protocol import EvalConfig

    from jobs.evaluate import with_ids_file_read

    for path in sorted((CONFIGS_DIR / "evaluate").glob("*.yaml")):
        config = parse(EvalConfig, with_ids_file_read(load_yaml(path), path.parent), str(path))
        assert config.memory_budget == "auto"
    raw = load_yaml(CONFIGS_DIR / "evaluate" / "minilm-r8-random.yaml")
    assert parse(EvalConfig, {**raw, "memory_budget": "8GiB"}, "x").memory_budget == "8GiB"
    with pytest.raises(ConfigError, match="memory_budget"):
        parse(EvalConfig, {**raw, "memory_budget": "a lot"}, "x")
    forget = {"model": "m", "forget": {"sample_ids": [1]}, "output": "o", "memory_budget": "512MiB"}
    assert ForgetConfig.model_validate(forget).memory_budget == "512MiB"
    from jobs.specs import CampaignSpec, ServiceConfig

    for spec_type, path in ((CampaignSpec, "campaigns/linear-digits.yaml"), (ServiceConfig, "stream/linear-digits.yaml")):
        raw = load_yaml(CONFIGS_DIR / path)
        assert parse(spec_type, raw, path).memory_budget == "auto"
        assert parse(spec_type, {**raw, "memory_budget": "1GiB"}, path).memory_budget == "1GiB"
        with pytest.raises(ConfigError, match="memory_budget"):
            parse(spec_type, {**raw, "memory_budget": "-3"}, path)


# -- real removals in a child process -----------------------------------------------------------------
# A child process runs the removals of the budgets it is given in turn, after one warm-up; each
# run resets the peak (VmHWM) to the current RSS first. The bounded (measured) budget has a
# child of its own; the too-small and the unbounded ones share one (one interpreter start, one
# import of torch and the pipeline, one warm-up less).
CHILD = textwrap.dedent("""
    import gc, json, resource, sys, traceback
    import torch
    torch.set_num_threads(1)
    from pipeline.models.card import load_model_dir
    from pipeline.removal import remove, training_set

    model_dir, budgets, settings, batch_size = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    card = load_model_dir(model_dir)[2]
    ids = training_set(card).sample_ids[:30].tolist()

    def status(key):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    # warm up the code paths (imports, lazy initialisation of torch.func) on a small removal: the
    # same block and solver in batches of 64 (batches of 8 took 22 s of the child's time, for nothing)
    remove(model_dir, ids[:2], method="lfoci-newton", settings={**settings, "newton_max_steps": 1},
           seed=0, batch_size=64, memory_budget="64MiB")
    for budget in budgets:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the peak (VmHWM) to the current RSS
            reset = True
        except OSError:
            reset = False
        before = status("VmRSS")
        peak_before = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {"budget": budget, "before": before, "reset": reset}
        run = None
        try:
            run = remove(model_dir, ids, method="lfoci-newton", settings=settings, seed=0, batch_size=batch_size,
                         memory_budget=budget)
            out["record"] = {k: run.record[k] for k in ("memory_budget", "n_after", "block")}
            out["ok"] = True
        except Exception as err:
            out["ok"] = False
            out["error"] = f"{type(err).__name__}: {err}"
        peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["growth"] = peak - before
        run = None  # the next budget starts without this run's results
        print("RESULT " + json.dumps(out), flush=True)
""")

# the dense Newton system (small_block_solver: dense; auto would solve this damped system by CG and
# never build the 1210 x 1210 matrix whose memory these tests bound)
SETTINGS = {"selection": "all", "dense_max": 4096, "small_block_solver": "dense", "damping": 0.01,
            "newton_max_steps": 2, "min_gradient_reduction": 0.0}


def _children(model_dir: Path, budgets: list[str], batch_size: int = 1024) -> dict[str, dict]:
    """The removals under ``budgets``, in this order, in one child process: {budget: result}."""
    # A fixed glibc mmap threshold: freed large blocks go back to the OS, so RSS tracks live memory.
    # With glibc's dynamic threshold, freed blocks stay in the heap at the allocator's whim and the
    # same removal's peak growth under 48 MiB measured anywhere from 17 to 51 MiB (38.9 MiB, three
    # times in a row, with the fixed threshold; 80 MiB unbounded).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), json.dumps(budgets), json.dumps(SETTINGS),
                           str(batch_size)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert [r["budget"] for r in results] == budgets, proc.stdout[-3000:]
    return {r["budget"]: r for r in results}


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    from tests import kit

    return kit.trained_model_dir(tmp_path_factory.mktemp("mlp16"), "mlp", {"hidden": [16]}, steps=30)


@pytest.fixture(scope="module")
def child_runs(mlp_dir):
    """The model directory's files before, and the removals under a 48 MiB budget (in a process
    of its own), a budget too small for one chunk (256 KiB) and a 1 TiB one (no effective bound)."""
    before = {p.name: p.read_bytes() for p in mlp_dir.iterdir() if p.is_file()}
    return before, {**_children(mlp_dir, ["48MiB"]), **_children(mlp_dir, ["256KiB", "1TiB"])}


def test_removal_peak_memory_stays_inside_a_small_budget(child_runs):
    """30 samples removed from an MLP (1,210 parameters, the whole model as the block: a dense
    1210 x 1210 Newton system) with batch_size 1024 and 128 Hessian columns per vmapped pass.
    Under a 48 MiB budget the process's peak RSS growth stays below 48 MiB."""
    budget = 48 * 2**20
    bounded = child_runs[1]["48MiB"]
    assert bounded["ok"], bounded
    assert "48 MiB" in bounded["record"]["memory_budget"] and bounded["record"]["block"]["numel"] == 1210
    print(f"\npeak RSS growth: {bounded['growth'] / 2**20:.1f} MiB under a 48 MiB budget "
          f"(reset peak: {bounded['reset']})")
    assert bounded["growth"] < budget, bounded
    unbounded = child_runs[1]["1TiB"]
    assert unbounded["ok"], unbounded
    print(f"peak RSS growth: {unbounded['growth'] / 2**20:.1f} MiB with a 1 TiB budget (no effective bound)")
    assert unbounded["growth"] > budget, unbounded  # the same removal needs more: the budget is what bounded it


def test_a_budget_too_small_for_one_chunk_fails_up_front_and_writes_nothing(mlp_dir, child_runs, tmp_path):
    before, results = child_runs
    tiny = results["256KiB"]
    assert not tiny["ok"]
    assert tiny["error"].startswith("MemoryBudgetError: memory_budget 256 KiB cannot hold"), tiny
    assert "raise memory_budget" in tiny["error"]
    assert {p.name: p.read_bytes() for p in mlp_dir.iterdir() if p.is_file()} == before
    # the command line: exit status 2, the message, no output directory
    config = tmp_path / "forget.yaml"
    out = tmp_path / "out"
    from pipeline.models.card import read_card
    from pipeline.removal import training_set

    ids = training_set(read_card(mlp_dir)).sample_ids[:2].tolist()
    config.write_text(json.dumps({"model": str(mlp_dir), "forget": {"sample_ids": ids}, "output": str(out),
                                  "method": {"name": "lfoci-newton", "settings": SETTINGS},
                                  "memory_budget": "1KiB"}))
    # A fixed glibc mmap threshold: freed large blocks go back to the OS, so RSS tracks live memory.
    # With glibc's dynamic threshold, freed blocks stay in the heap at the allocator's whim and the
    # same removal's peak growth under 48 MiB measured anywhere from 17 to 51 MiB (38.9 MiB, three
    # times in a row, with the fixed threshold; 80 MiB unbounded).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", "from jobs.cli import cli; cli()", "forget", "--config", str(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert "memory_budget 1 KiB cannot hold one sample's gradient pass" in proc.stderr
    assert not out.exists()


def test_workers_sharing_a_machine_split_its_budget():
    """Ray workers on one machine together stay inside one budget: a set budget is split between
    them, auto takes AUTO_FRACTION / sharing of the available memory; a lone worker (or a CUDA
    worker, which computes in its own device's memory) keeps the whole of it."""
    from pipeline import memory

    assert memory.worker_budget(3 * 2**20, 1).bytes == 3 * 2**20
    split = memory.worker_budget(3 * 2**20, 4)
    assert split.bytes == 3 * 2**20 // 4 and "shared by 4 workers" in split.source
    assert split.named().startswith("memory_budget 768 KiB (the set 3 MiB shared by 4 workers")
    lone, shared = memory.worker_budget(None, 1), memory.worker_budget(None, 4)
    # auto is measured at each call; the machine's free memory moves a little in between
    assert shared.bytes == pytest.approx(lone.bytes / 4, rel=0.05)
    assert memory.worker_budget(2**20, 4, "cuda").bytes == 2**20


def test_retrieval_features_are_batched_within_the_budget():
    """features_of sizes its batches from the bytes of a one-sample call of the feature method:
    a small budget gives more, smaller batches and the same features; one that cannot hold a
    single sample's call is refused, naming memory_budget."""
    from pipeline import memory
    from pipeline.data import SampleSet
    from pipeline.evaluate.predict import features_of

    class Embedder(nn.Module):
        retrieval_method = "features"

        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 16))
            self.calls: list[int] = []

        def features(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.append(len(x))
            return self.body(x)

    torch.manual_seed(0)
    model = Embedder()
    data = SampleSet({"x": torch.randn(300, 32), "y": torch.zeros(300, dtype=torch.long)}, torch.arange(300))
    whole = features_of(model, data, batch_size=256)
    assert max(model.calls) == 256
    model.calls.clear()
    per_sample = 4 * (512 + 512 + 16)  # the operator outputs of one sample's call, float32
    with memory.use_budget(memory.MemoryBudget(int(ModelCost.FORWARD * per_sample * 40.5))):
        small = features_of(model, data, batch_size=256)
    assert model.calls[1:] and max(model.calls[1:]) == 40  # (the first call measured one sample)
    assert torch.allclose(small, whole, rtol=0, atol=1e-6)
    with memory.use_budget(memory.MemoryBudget(64)), pytest.raises(MemoryBudgetError, match="memory_budget 64 B"):
        features_of(model, data, batch_size=256)
