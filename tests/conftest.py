"""Session-wide settings and the shared fixtures of the suite (builders: ``tests/kit.py``).

  trained_model_dir   factory: ``trained_model_dir(preset="linear", options=None, **kit options)``
                      -> a fresh model directory trained by the real ``unlearn train`` code path
  ray_local           one Ray per test session, started inside the process on loopback
                      (2 CPUs, a small object store, its own short temp dir)
  http                the HTTP client helper (``kit.http_json``)
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import tempfile  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


OBJECT_STORE_BYTES = 256 * 2**20


def _xdist_workers() -> int:
    """How many pytest-xdist workers this run has (0 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)


def pytest_configure(config) -> None:
    """Under pytest-xdist (scripts/test.sh runs a worker per core): torch's intra-op threads split the
    cores between the workers instead of each taking them all."""
    workers = _xdist_workers()
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The suite's longest files, in seconds (their tests and module fixtures, summed from the junit report of
# `pytest -n 2 --dist loadfile` on 2 cores, 2026-11-30). They are handed to the pytest-xdist workers first,
# longest first, so that the files left for the end are short ones and the workers finish together
# (scripts/test.sh passes --no-loadscope-reorder: xdist's own order, most tests first, had left the kill
# audits, one or two tests each and a minute or more, for the end).
LONGEST_FILES = {
    "test_newton_mlp.py": 240, "test_target_retrain.py": 118, "test_unlearn_random_kills.py": 102,
    "test_cluster_ray.py": 100, "test_benchmark_model_examples.py": 73, "test_method_configs.py": 73,
    "test_unlearn_exactly_once.py": 70, "test_ray_jobs.py": 69, "test_stream_fast_path_service.py": 66,
    "test_deep_forgetting_bench.py": 64, "test_progress.py": 56, "test_lfoci_gauss_newton.py": 56,
    "test_unlearn_campaign_crash.py": 55, "test_memory_budget.py": 50, "test_bench_smoke.py": 40,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist, the longest files (``LONGEST_FILES``) first, longest first; a stable sort, so the
    other files keep pytest-randomly's shuffled order, and every file its shuffled tests."""
    if _xdist_workers() > 1:
        items.sort(key=lambda item: -LONGEST_FILES.get(item.path.name, 0))


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session) -> None:
    """Print pytest-randomly's seed even under -q (its own header line is shown only without -q), so a
    failure that depends on the shuffled order can be replayed."""
    config = session.config
    seed = getattr(config.option, "randomly_seed", None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and config.pluginmanager.hasplugin("randomly") and reporter is not None:
        reporter.write_line(f"test order shuffled by pytest-randomly, seed {seed}: replay it with "
                            f"-p randomly --randomly-seed={seed} (or fix the order with -p no:randomly)")


@pytest.fixture()
def one_thread():
    """torch on one thread for the test (timings and float reductions independent of the core count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Before a fixture of module, class, package or session scope is built: torch's global generator
    seeded from the fixture's own name and place (and its parameter), so an unseeded draw in it (a
    model's initial weights) is the same whichever test of the shuffled order first asks for it.
    Function-scoped fixtures draw after ``torch_globals`` has seeded the test."""
    if fixturedef.scope != "function":
        key = f"{fixturedef.baseid}::{fixturedef.argname}[{getattr(request, 'param_index', 0)}]"
        torch.manual_seed(zlib.crc32(key.encode()))
    yield


@pytest.fixture(autouse=True)
def torch_globals(request):
    """Before each test: torch's global generator seeded from the test's own id (as pytest-randomly
    seeds random and numpy), so an unseeded draw is the same whatever ran before. After it: the thread
    count and the default dtype are the session's, else the test fails naming the change (a fixture
    that sets them must restore them)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    # as the test starts: a module's own (restored) setting, made by a fixture of wider scope, holds
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield
    changed = []
    if torch.get_num_threads() != threads:
        changed.append(f"torch threads {threads} -> {torch.get_num_threads()}")
        torch.set_num_threads(threads)
    if torch.get_default_dtype() != dtype:
        changed.append(f"default dtype {dtype} -> {torch.get_default_dtype()}")
        torch.set_default_dtype(dtype)
    if changed:
        pytest.fail(f"{request.node.nodeid} (or a fixture it set up) left {', '.join(changed)}: restore them "
                    "(the tests after it, in any order, would run under them)")


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """A factory of trained model directories; same arguments, same (cached) directory."""
    from tests import kit

    made: dict[str, Path] = {}

    def make(preset: str = "linear", options: dict | None = None, **kwargs: Any) -> Path:
        key = repr((preset, sorted((options or {}).items()), sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in made:
            made[key] = kit.trained_model_dir(tmp_path_factory.mktemp(f"model-{preset}"), preset, options, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def ray_local():
    """A Ray started inside the test process (or the one already running), stopped at the end
    only if started here."""
    from cluster.runtime import connect

    tmp = tempfile.mkdtemp(prefix="urt-", dir="/tmp")
    rt = connect(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, temp_dir=tmp, log_to_driver=False)
    try:
        yield rt
    finally:
        if rt.owned:
            rt.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def http():
    """The HTTP client helper: ``http(port, method, path, body=None, headers=None) -> (status, json)``."""
    from tests.kit import http_json

    return http_json
