"""``unlearn mixed-linear-dist``: Mixed-Linear training + forgetting data-parallel across
DeepSpeed ranks on this machine (loopback), launched with torchrun or the deepspeed launcher.

Config (YAML; unknown fields are errors):
    model: runs/models/core          # model directory holding the core weights w_c
    user_data: {source: digits, options: {dtype: float64}, split: train, sample_ids: null}
                                     # default: the model card's data, whole split
    forget: {sample_ids: [3, 30]}    # optional; without it only the user weights are trained
    init_user_weights: null          # OUTPUT/user_weights.safetensors of an earlier run: forget only
    settings: {user_last_modules: 1, user_parameters: [], sigma: 0.0, cg_rtol: 1.0e-10, cg_max_iter: null}
    weight_decay: 0.01
    zero_stage: 0                    # ZeRO stage of the engine holding the user weights (0-3)
    dtype: float64
    batch_size: 256
    seed: 0
    output: runs/mixed-linear/core-users   # must not exist; written atomically by rank 0

Each rank holds a contiguous shard of the user data; the products inside conjugate gradient
are all-reduced (gloo on CPU, NCCL on GPU). See ``cluster.deepspeed_mixed_linear``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel, ConfigDict, Field

from jobs.config import ConfigError, load_config


class UserData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    split: str = "train"
    sample_ids: list[int] | None = None


class ForgetIds(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sample_ids: list[int] = Field(default_factory=list)


class MixedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_parameters: list[str] = Field(default_factory=list)
    user_last_modules: int = Field(1, ge=1)
    sigma: float = Field(0.0, ge=0)
    cg_rtol: float = Field(1e-10, gt=0)
    cg_max_iter: int | None = Field(None, gt=0)


class MixedLinearDistConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Path
    user_data: UserData = Field(default_factory=UserData)
    forget: ForgetIds = Field(default_factory=ForgetIds)
    init_user_weights: Path | None = None
    settings: MixedSettings = Field(default_factory=MixedSettings)
    weight_decay: float = Field(0.01, ge=0)
    zero_stage: int = Field(0, ge=0, le=3)
    dtype: str = Field("float64", pattern="^(float32|float64)$")
    batch_size: int = Field(256, gt=0)
    seed: int = 0
    backend: str = Field("auto", pattern="^(auto|gloo|nccl)$")
    output: Path


def _abs(base: Path, p: Path | None) -> str | None:
    if p is None:
        return None
    return str(p if p.is_absolute() else (base / p).resolve())


def to_spec(config: MixedLinearDistConfig, base: Path):
    """The rank-side spec (absolute paths) for ``cluster.deepspeed_mixed_linear``."""
    from cluster.deepspeed_mixed_linear import DistMixedLinearSpec

    model_dir = _abs(base, config.model)
    if not (Path(model_dir) / "model.json").exists():
        raise ConfigError(f"model: {model_dir} is not a model directory (model.json missing)")
    output = _abs(base, config.output)
    if Path(output).exists():
        raise ConfigError(f"output {output} already exists: choose a new output directory")
    init = _abs(base, config.init_user_weights)
    if init is not None and not Path(init).exists():
        raise ConfigError(f"init_user_weights: {init} does not exist")
    spec = DistMixedLinearSpec(
        model_dir=model_dir, output=output, data_source=config.user_data.source,
        data_options=config.user_data.options, data_split=config.user_data.split,
        user_ids=config.user_data.sample_ids, forget_ids=config.forget.sample_ids,
        weight_decay=config.weight_decay, user_parameters=config.settings.user_parameters,
        user_last_modules=config.settings.user_last_modules, init_user_weights=init,
        zero_stage=config.zero_stage, dtype=config.dtype, batch_size=config.batch_size,
        cg_rtol=config.settings.cg_rtol, cg_max_iter=config.settings.cg_max_iter,
        sigma=config.settings.sigma, seed=config.seed, backend=config.backend,
    )
    spec.validate()
    return spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(launcher: str, nproc: int, port: int, spec_path: Path) -> list[str]:
    """torchrun or deepspeed, bound to 127.0.0.1, running the rank module."""
    module_args = ["cluster.deepspeed_mixed_linear", "--spec", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                "--master_addr=127.0.0.1", f"--master_port={port}", "-m", *module_args]
    deepspeed_bin = Path(sys.executable).with_name("deepspeed")
    if not deepspeed_bin.exists():
        raise click.ClickException(f"the deepspeed launcher is not installed next to {sys.executable}; "
                                   "use --launcher torchrun")
    return [str(deepspeed_bin), f"--num_gpus={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
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
        config = load_config(MixedLinearDistConfig, config_path)
        if zero_stage is not None:
            config.zero_stage = zero_stage
        if output is not None:
            config.output = output
        spec = to_spec(config, config_path.resolve().parent)
    except (ConfigError, ValueError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="mixed-linear-dist-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.to_json())
        cmd = launch_command(launcher, nproc, master_port or free_port(), spec_path)
        proc = subprocess.run(cmd, env=launch_env())
    if proc.returncode != 0:
        click.echo(f"error: the {launcher} run failed with exit code {proc.returncode} (see the rank logs above)",
                   err=True)
        sys.exit(proc.returncode)
    record = json.loads((Path(spec.output) / "mixed_linear.json").read_text())
    click.echo(json.dumps({"output": spec.output, "world_size": record["world_size"],
                           "zero_stage": record["zero_stage"], "seconds": record["seconds"]}))
