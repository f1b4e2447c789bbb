"""``unlearn mixed-linear-dist``: Mixed-Linear training + forgetting data-parallel across
DeepSpeed ranks on this machine (loopback), launched with torchrun or the deepspeed launcher.

Config (YAML; unknown fields are errors; example: configs/mixed-linear-dist/linear-digits.yaml):
    model: runs/models/core          # model directory holding the core weights w_c
    user_data: {source: digits, options: {}, split: train, sample_ids: null}
                                     # default: the model card's data, whole split
    forget: {sample_ids: [3, 30]}    # optional; without it only the user weights are trained
    init_user_weights: null          # OUTPUT/user_weights.safetensors of an earlier run: forget only
    settings: {user_last_modules: 1, user_parameters: [], sigma: 0.0, cg_rtol: 1.0e-10, cg_max_iter: null}
    weight_decay: 0.01
    dtype: float64                   # the core model AND the user data are cast to it
    batch_size: 256
    zero_stage: 0                    # ZeRO stage of the engine holding the user weights (0-3)
    backend: auto                    # auto | gloo | nccl
    output: runs/mixed-linear/core-users   # must not exist; written atomically by rank 0

The job itself is ``pipeline.methods.mixed_linear.DataParallelJob`` / ``run_data_parallel``;
``cluster.deepspeed_mixed_linear`` runs it on each rank.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

import click
from pydantic import Field

from cluster.net import LOOPBACK, free_port
from jobs.usererrors import user_errors
from pipeline.config import ConfigError, load_config
from pipeline.methods.mixed_linear import DataParallelJob


class MixedLinearDistConfig(DataParallelJob):
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage of the engine holding the user weights")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl with CUDA, else gloo")


def to_spec(config: MixedLinearDistConfig):
    """The rank-side spec for ``cluster.deepspeed_mixed_linear`` (paths already absolute)."""
    from cluster.deepspeed_mixed_linear import RankSpec

    if not (config.model / "model.json").exists():
        raise ConfigError(f"model: {config.model} is not a model directory (model.json missing)")
    if config.output.exists():
        raise ConfigError(f"output: {config.output} already exists: choose a new output directory")
    if config.init_user_weights is not None and not config.init_user_weights.exists():
        raise ConfigError(f"init_user_weights: {config.init_user_weights} does not exist")
    job = DataParallelJob.model_validate(config.model_dump(exclude={"zero_stage", "backend"}))
    return RankSpec(job=job, zero_stage=config.zero_stage, backend=config.backend)


def launch_command(launcher: str, nproc: int, port: int, spec_path: Path) -> list[str]:
    """torchrun or deepspeed, bound to 127.0.0.1, running the rank module."""
    module_args = ["cluster.deepspeed_mixed_linear", "--spec", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_addr={LOOPBACK}", f"--master_port={port}", "-m", *module_args]
    deepspeed_bin = Path(sys.executable).with_name("deepspeed")
    if not deepspeed_bin.exists():
        raise click.ClickException(f"the deepspeed launcher is not installed next to {sys.executable}; "
                                   "use --launcher torchrun")
    return [str(deepspeed_bin), f"--num_gpus={nproc}", f"--master_addr={LOOPBACK}", f"--master_port={port}",
            "--module", *module_args]


def launch_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    if shutil.which("nvidia-smi") is None:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


@click.command("mixed-linear-dist")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path),
              help="YAML: core model dir, user data, forget ids, settings, zero_stage, output.")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ranks (processes) on this machine; one GPU each when GPUs exist.")
@click.option("--launcher", type=click.Choice(["torchrun", "deepspeed"]), default="torchrun", show_default=True)
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="Rendezvous port on 127.0.0.1 (default: a free one).")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=None, help="Override zero_stage.")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Override the output directory.")
def command(config_path: Path, nproc: int, launcher: str, master_port: int | None, zero_stage: int | None,
            output: Path | None) -> None:
    """Train and forget Mixed-Linear user weights data-parallel across DeepSpeed ranks.

    Writes OUTPUT/user_weights.safetensors and OUTPUT/mixed_linear.json (rank 0, atomically).
    """
    try:
        config = load_config(MixedLinearDistConfig, config_path, "mixed-linear-dist config", relative_paths=True)
        if zero_stage is not None:
            config.zero_stage = zero_stage
        if output is not None:
            config.output = output.resolve()
        spec = to_spec(config)
    except ValueError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    _launch(spec, launcher, nproc, master_port)


@user_errors
def _launch(spec, launcher: str, nproc: int, master_port: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="mixed-linear-dist-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.model_dump_json())
        cmd = launch_command(launcher, nproc, master_port or free_port(), spec_path)
        proc = subprocess.run(cmd, env=launch_env())
    if proc.returncode != 0:
        click.echo(f"error: the {launcher} run failed with exit code {proc.returncode} (see the rank logs above)",
                   err=True)
        sys.exit(proc.returncode)
    output = spec.job.output
    record = json.loads((Path(output) / "mixed_linear.json").read_text())
    click.echo(json.dumps({"output": str(output), "world_size": record["world_size"],
                           "zero_stage": record["zero_stage"], "seconds": record["seconds"]}))
