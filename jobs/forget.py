"""`unlearn forget`: one removal, in-process, from a config file.

Config (YAML; see configs/forget/*.yaml):
    model: path/to/model_dir          # model.safetensors + model.json (from `unlearn train`)
    forget: {sample_ids: [..]}        # or {ids_file: path}: one id a line, or CSV with sample_id
    method: {name: lfoci-newton, settings: {...}}   # or a bare name: configs/methods/<name>.yaml
    seed: 0
    device: cpu
    output: path/to/new_model_dir     # must not exist; written atomically
Writes output/model.safetensors, output/model.json (the card, n and removed ids updated) and
output/removal.json (the record: selected slices and T values, sigma, epsilon, timings ...;
strict JSON: a non-finite number such as an infinite epsilon is written as null).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from cluster.errors import ClusterError
from cluster.hooks import ClusterOptions
from pipeline.checkpoint import CheckpointMismatchError
from pipeline.config import ConfigError, format_errors, load_config
from pipeline.errors import NonFiniteGradientError
from pipeline.data.sampleset import SampleIdError
from pipeline import memory
from pipeline.jsonio import dumps
from pipeline.methods.base import MethodRef, MethodSettings, get_method, parse_settings
from pipeline.methods.mixed_linear import USER_WEIGHTS_FILE, save_user_weights
from pipeline.trajectory import refer_to_trajectory
from pipeline.models.card import write_model_dir


class ForgetSet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sample_ids: list[int] | None = None
    ids_file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "ForgetSet":
        if (self.sample_ids is None) == (self.ids_file is None):
            raise ValueError("give exactly one of forget.sample_ids or forget.ids_file")
        return self

    @property
    def field(self) -> str:
        """The field the user wrote the ids in (quoted by errors about unknown ids)."""
        return "forget.sample_ids" if self.sample_ids is not None else f"forget.ids_file ({self.ids_file})"

    def resolve(self, base: Path) -> list[int]:
        if self.sample_ids is not None:
            return list(self.sample_ids)
        path = self.ids_file if self.ids_file.is_absolute() else base / self.ids_file
        if not path.exists():
            raise ConfigError(f"forget.ids_file {path} does not exist")
        ids: list[int] = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            token = line.split(",")[0].strip()
            if not token or token == "sample_id" or token.startswith("#"):
                continue
            try:
                ids.append(int(token))
            except ValueError:
                raise ConfigError(f"forget.ids_file {path} line {lineno}: '{token}' is not an integer sample id") from None
        return ids


class MethodChoice(MethodRef):
    """The method to run and its parsed settings (a bare name loads configs/methods/<name>.yaml);
    ``per_method`` holds settings (parsed too) for methods chosen with ``--method``."""

    per_method: dict[str, SerializeAsAny[MethodSettings]] = Field(default_factory=dict)

    @field_validator("per_method", mode="before")
    @classmethod
    def _parse_each(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        parsed = {}
        for name, settings in raw.items():
            try:
                parsed[name] = parse_settings(name, settings)
            except ValidationError as err:
                raise ValueError("; ".join(format_errors(err, get_method(name).Settings, prefix=f"{name}."))) from None
        return parsed

    def choose(self, name: str | None) -> "MethodChoice":
        if name is None or name == self.name:
            return self
        if name in self.per_method:
            return MethodChoice(name=name, settings=self.per_method[name], per_method=self.per_method)
        return MethodChoice.model_validate(name).model_copy(update={"per_method": self.per_method})


class ForgetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Path
    forget: ForgetSet
    method: MethodChoice = Field(default_factory=lambda: MethodChoice.model_validate({}))
    seed: int = 0
    device: str = "cpu"
    batch_size: int = Field(1024, gt=0)
    memory_budget: memory.Setting = Field(
        "auto", description="working memory each pass may use on top of the loaded model and data: 'auto' "
                            f"({memory.AUTO_FRACTION:g} x available RAM, or CUDA free memory), or a size like '8GiB'")
    output: Path


USER_ERRORS = (ConfigError, SampleIdError, CheckpointMismatchError, NonFiniteGradientError,
               FileNotFoundError, ValueError, KeyError)


def run_forget(config: ForgetConfig, base: Path, cluster: "ClusterOptions | None" = None) -> dict:
    """Run the removal and write the output directory atomically; returns the record.
    ``cluster``: run the probe and the curvature on Ray workers (``cluster.hooks``)."""
    from pipeline.progress import StageProgress
    from pipeline.removal import remove

    model_dir = config.model if config.model.is_absolute() else base / config.model
    output = config.output if config.output.is_absolute() else base / config.output
    if output.exists():
        raise ConfigError(f"output {output} already exists: choose a new output directory")
    ids = config.forget.resolve(base)
    with contextlib.ExitStack() as stack:
        hooks: dict[str, Any] = {}
        if cluster is not None:
            from cluster.hooks import ray_removal_hooks

            hooks = stack.enter_context(ray_removal_hooks(model_dir, cluster))
        describe = hooks.pop("describe", None)
        run = remove(model_dir, ids, method=config.method.name, settings=config.method.settings,
                     seed=config.seed, device=config.device, batch_size=config.batch_size,
                     field=config.forget.field, memory_budget=config.memory_budget,
                     stage_hook=StageProgress(f"forget {config.method.name}"), **hooks)
        if describe is not None:
            run.record["distributed"] = describe()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        # the recorded run is referred to, not copied: it saw the removed samples (its last checkpoint is the original)
        write_model_dir(staging, run.new_state, refer_to_trajectory(run.card, model_dir, output))
        if run.user_weights is not None:
            save_user_weights(staging / USER_WEIGHTS_FILE, run.user_weights)
        record_bytes = dumps(run.record).encode()
        with open(staging / "removal.json", "wb") as fh:
            fh.write(record_bytes)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return run.record


@click.command("forget")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path),
              help="YAML file: model, forget ids, method, seed, output.")
@click.option("--method", "method_name", default=None,
              help="Override method.name (lfoci-newton, fisher, ntk, mixed-linear, ...).")
@click.option("--output", "output", default=None, type=click.Path(path_type=Path),
              help="Override the output directory.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Run the probe and the curvature on this many Ray workers (default: in this process).")
@click.option("--address", default=None,
              help="Ray cluster address for the workers (default: RAY_ADDRESS, else a local Ray); implies Ray.")
def command(config_path: Path, method_name: str | None, output: Path | None,
            workers: int | None, address: str | None) -> None:
    """Remove the given training samples from a model directory.

    In this process by default; with --workers/--address the probe shards and the training-set
    Hessian-vector products run on Ray workers (same result, bit for bit, on the same device).
    Writes OUTPUT/model.safetensors, OUTPUT/model.json and OUTPUT/removal.json; nothing is
    written if anything fails.
    """
    try:
        config = load_config(ForgetConfig, config_path)
        config.method = config.method.choose(method_name)
        if output:
            config.output = output
        cluster = ClusterOptions(address=address, workers=workers) if (workers or address) else None
        record = run_forget(config, config_path.resolve().parent, cluster)
    except (*USER_ERRORS, ClusterError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    summary = {k: record.get(k) for k in ("method", "n_before", "n_after", "epsilon_spent", "wall_seconds")}
    click.echo(dumps(summary, indent=None))
