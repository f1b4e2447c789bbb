"""A cache entry shared by processes is built once and read whole (``pipeline.cache_entry``).

  (a) two processes asking for the same Retrain baseline under one ``cache_dir`` at once: exactly one trains, the
      other waits and reads it (cached), both hold the same weights, and nothing but the entry and its lock is left
      in the folder. Without the lock both train (each reports cached = False), so the test fails on that;
  (b) a build that raises leaves neither the entry nor its staging folder, and the lock is free for the next;
  (c) an entry without its record (a build interrupted by code that wrote in place) and a dead build's staging
      folder are replaced by the next build; a body that forgets the record is refused;
  (d) two processes entering ``building`` at once with a body that takes two seconds: one body runs (certain
      overlap, unlike (a), whose training may end before the other process asks);
  (e) the frozen features: a data file without its record, or a record without its data file, is computed again.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.cache_entry import STAGING_MARK, building, lock_of

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = {"optimizer": "sgd", "epochs": 3, "lr": 0.05, "batch_size": 32, "momentum": 0.9, "weight_decay": 5e-4,
          "seed": 5}
CNN = {"channels": [8, 16], "pool": [1, 2], "hidden": [32], "image_size": 8}

RACER = textwrap.dedent("""
    import json, sys, time
    import torch
    torch.set_num_threads(1)
    from pipeline.evaluate.baselines import retrain
    from pipeline.models.card import read_card
    from pipeline.removal import training_set
    model_dir, cache_dir, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
    card = read_card(model_dir)
    data = training_set(card)
    forget = [int(i) for i in data.sample_ids[:10]]
    retain = data.without(torch.arange(10))
    while time.time() < start:
        time.sleep(0.01)
    run = retrain(card, retain, forget, cache_dir=cache_dir)
    print(json.dumps({"cached": run.cached, "directory": str(run.directory)}))
""")


BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from pipeline.cache_entry import building
    target, start = Path(sys.argv[1]), float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.01)
    with building(target, "record.json") as staging:
        if staging is None:
            print("read")
        else:
            with open(target.parent / "builds.log", "a") as log:
                log.write("built\\n")
            time.sleep(2.0)
            (staging / "record.json").write_text("{}")
            print("built")
""")


def _racers(script: str, *args: str, n: int = 2) -> list[str]:
    import time

    start = time.time() + 8.0   # every racer past its imports before any enters
    procs = [subprocess.Popen([sys.executable, "-c", script, *args, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
             for _ in range(n)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(out.strip().splitlines()[-1])
    return outputs


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory):
    from tests import kit

    return kit.trained_model_dir(tmp_path_factory.mktemp("cnn"), "cnn", CNN, data_options={"flatten": False},
                                 recipe=RECIPE)


def test_two_processes_asking_for_one_retrain_train_it_once(cnn_dir, tmp_path):
    cache = tmp_path / "cache"
    outputs = [json.loads(line) for line in _racers(RACER, str(cnn_dir), str(cache))]
    assert sorted(o["cached"] for o in outputs) == [False, True], outputs
    assert outputs[0]["directory"] == outputs[1]["directory"]
    entry = Path(outputs[0]["directory"])
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, lock_of(entry).name])
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]   # no temporary file left inside
    state = load_file(str(entry / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_a_failed_build_leaves_nothing_and_frees_the_lock(tmp_path):
    target = tmp_path / "entry"
    with pytest.raises(RuntimeError, match="boom"):
        with building(target, "record.json") as staging:
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not target.exists()
    assert not list(tmp_path.glob(f".entry{STAGING_MARK}*"))
    with building(target, "record.json") as staging:   # the lock was released: this does not wait
        (staging / "record.json").write_text("{}")
    assert (target / "record.json").exists()
    with building(target, "record.json") as staging:
        assert staging is None   # complete: nothing to build


def test_an_interrupted_entry_and_a_dead_build_are_replaced(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"half")   # written in place, no record
    dead = tmp_path / f".entry{STAGING_MARK}999999"
    dead.mkdir()
    (dead / "junk").write_bytes(b"junk")
    with building(target, "record.json") as staging:
        assert staging is not None and staging != dead
        (staging / "model.safetensors").write_bytes(b"whole")
        (staging / "record.json").write_text("{}")
    assert (target / "model.safetensors").read_bytes() == b"whole"
    assert not dead.exists()
    with pytest.raises(RuntimeError, match="without its record"):
        with building(tmp_path / "other", "record.json") as staging:
            (staging / "model.safetensors").write_bytes(b"no record")
    assert not (tmp_path / "other").exists()


def test_two_processes_entering_one_build_run_its_body_once(tmp_path):
    target = tmp_path / "entry"
    assert sorted(_racers(BUILDER, str(target))) == ["built", "read"]
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert (target / "record.json").exists()
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["builds.log", "entry", lock_of(target).name])


def test_features_without_their_record_or_their_data_are_computed_again(tmp_path):
    from pipeline.data.sampleset import SampleSet
    from pipeline.features import cached_features

    x = torch.randn(12, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    data = SampleSet({"x": x, "y": torch.arange(12) % 3}, torch.arange(12))
    first = cached_features("random-conv", data, {"seed": 3}, tmp_path, "train")
    assert not first.reused
    first.path.with_suffix(".json").unlink()   # data without its record: a build that was killed
    again = cached_features("random-conv", data, {"seed": 3}, tmp_path, "train")
    assert not again.reused and torch.equal(again.data.columns["x"], first.data.columns["x"])
    first.path.unlink()   # a record without its data
    third = cached_features("random-conv", data, {"seed": 3}, tmp_path, "train")
    assert not third.reused and torch.equal(third.data.columns["x"], first.data.columns["x"])
    assert cached_features("random-conv", data, {"seed": 3}, tmp_path, "train").reused
