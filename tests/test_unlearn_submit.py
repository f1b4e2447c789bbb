"""`unlearn submit` / `campaign --ray-address`: the working directory Ray uploads never holds a
version store or a ledger (checked with Ray's own packager), and a configuration naming a path
the job will not see is refused before anything is submitted."""
from __future__ import annotations

import zipfile
from pathlib import Path

import click
import pytest

from jobs.submit import build_runtime_env, check_job_paths


def _project(root: Path) -> Path:
    for name, text in {
        "jobs/cli.py": "", "pipeline/store/versions.py": "", "pipeline/store/ledger.py": "", "configs/forget.yaml": "x: 1\n",
        "store/digits/versions/000000/model.safetensors": "w", "store/digits/versions/000000/manifest.json": "{}",
        "store/digits/CURRENT": "{}", "store/digits/LEDGERS": "[]", "store/digits/.lock": "",
        "store/digits/.staging/abc/model.safetensors": "w", "store/ledger.sqlite3": "db", "store/ledger.sqlite3-wal": "wal",
        "elsewhere/custom.sqlite3": "db", "runs/models/m/model.json": "{}",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_rays_packager_leaves_stores_and_ledgers_out_of_the_upload(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    project = _project(tmp_path / "project")
    env = build_runtime_env(project, (), ())
    target = tmp_path / "upload.zip"
    create_package(str(project), target, include_gitignore=True, excludes=env["excludes"])
    names = set(zipfile.ZipFile(target).namelist())
    assert {"jobs/cli.py", "pipeline/store/versions.py", "pipeline/store/ledger.py", "configs/forget.yaml"} <= names
    leaked = sorted(n for n in names if n.startswith(("store/", "runs/")) or ".sqlite3" in n)
    assert leaked == [], leaked


def test_paths_the_job_would_not_see_are_refused_up_front(tmp_path):
    project = _project(tmp_path / "project")
    (project / "forget.yaml").write_text("model: runs/models/m\nforget: {sample_ids: [1]}\noutput: /shared/out\n")
    with pytest.raises(click.ClickException, match="model = 'runs/models/m' is not uploaded"):
        check_job_paths(project, ("forget", "--config", "forget.yaml"))
    (project / "campaign.yaml").write_text("name: c\nmodel: {store: store, name: digits}\nledger: /shared/l.sqlite3\n"
                                           "batch_size: 1\nrequests: configs/forget.yaml\n")
    with pytest.raises(click.ClickException, match="model.store = 'store' is relative"):
        check_job_paths(project, ("campaign", "run", "campaign.yaml"))
    # absolute shared paths and uploaded relative ones pass
    (project / "ok.yaml").write_text("model: /shared/models/m\nforget: {ids_file: configs/forget.yaml}\noutput: /shared/out\n")
    check_job_paths(project, ("forget", "--config", "ok.yaml"))
