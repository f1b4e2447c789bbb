"""Mixed-Linear training and forgetting, data-parallel across DeepSpeed ranks.

Run one process per rank (``torchrun --nproc_per_node=N --master_addr=127.0.0.1 ...`` or the
``deepspeed`` launcher; ``unlearn mixed-linear-dist`` does it for you):

    python -m cluster.deepspeed_mixed_linear --spec SPEC.json

Every rank loads the core model (w_c) from a model directory and the user data, keeps the
contiguous shard [r N / W, (r+1) N / W) of it, and runs ``pipeline.methods.mixed_linear``'s
``train_user_weights`` / ``forget_user_data`` with ``allreduce`` = ``torch.distributed``'s
``all_reduce`` (SUM; gloo on CPU, NCCL on GPU). So every sum over samples inside conjugate
gradient - the Jacobian-vector / vector-Jacobian products J^T J v, J^T r and the counts - is
reduced across ranks, while the CG vectors (CPU float64) stay identical on every rank.

The user weights live in a DeepSpeed engine (``deepspeed.initialize`` with a ZeRO config of
the chosen stage and a client torch optimizer, so no optimizer op is compiled): with stage 3
they are partitioned across ranks and read / written through
``deepspeed.zero.GatheredParameters``. ZeRO-3 only partitions half/bfloat16/float32 tensors,
so the float64 vector is stored bit for bit as a float32 view (two words per weight); the
engine never does arithmetic on it, and every write is read back and checked.

Rank 0 writes OUTPUT/user_weights.safetensors (full parameter shapes, zero outside the block,
plus the flat vector under ``mixed_linear.flat``) and OUTPUT/mixed_linear.json, atomically.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

FLAT_KEY = "mixed_linear.flat"


@dataclass
class DistMixedLinearSpec:
    """What one distributed Mixed-Linear run does (JSON on the command line of every rank)."""

    model_dir: str
    output: str
    data_source: str | None = None  # default: the model card's data
    data_options: dict[str, Any] = field(default_factory=dict)
    data_split: str = "train"
    user_ids: list[int] | None = None  # None: the whole split
    forget_ids: list[int] = field(default_factory=list)
    weight_decay: float = 0.01
    user_parameters: list[str] = field(default_factory=list)
    user_last_modules: int = 1
    init_user_weights: str | None = None  # user_weights.safetensors of an earlier run: skip training
    zero_stage: int = 0
    dtype: str = "float64"
    batch_size: int = 256
    cg_rtol: float = 1e-10
    cg_max_iter: int | None = None
    sigma: float = 0.0
    seed: int = 0
    backend: str = "auto"  # auto: nccl when CUDA is available, else gloo

    def validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")

    @classmethod
    def from_json(cls, path: str | Path) -> "DistMixedLinearSpec":
        spec = cls(**json.loads(Path(path).read_text()))
        spec.validate()
        return spec

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# -- process group ------------------------------------------------------------------------------
def init_process_group(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Initialise torch.distributed through DeepSpeed; a plain ``python`` run is one rank on
    loopback (DeepSpeed would otherwise try MPI discovery)."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    use_nccl = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_nccl:
        torch.cuda.set_device(local)
    deepspeed.init_distributed(dist_backend="nccl" if use_nccl else "gloo")
    device = torch.device("cuda", local) if use_nccl else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sum_allreduce(t: Tensor) -> Tensor:
    """The Mixed-Linear ``allreduce`` hook: in-place SUM over all ranks."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def contiguous_shard(n: int, rank: int, world: int) -> torch.Tensor:
    """Positions [rank n / world, (rank+1) n / world) (possibly empty)."""
    return torch.arange(rank * n // world, (rank + 1) * n // world)


# -- the user weights inside a DeepSpeed engine --------------------------------------------------
class UserWeightStore(nn.Module):
    """The user-weight vector as the engine's one parameter (float64 bits in a float32 view)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.bits = nn.Parameter(torch.zeros(2 * dim, dtype=torch.float32), requires_grad=True)

    def forward(self) -> Tensor:  # pragma: no cover - the engine is a store, never trained
        return self.bits


def make_engine(dim: int, zero_stage: int, device: torch.device) -> Any:
    import deepspeed

    store = UserWeightStore(dim).to(device)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # memory_efficient_linear off: ZeRO-3 would otherwise patch F.linear globally with an
        # autograd.Function that has no forward-mode rule, breaking the core model's JVPs.
        "zero_optimization": {"stage": zero_stage, "memory_efficient_linear": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.SGD(store.parameters(), lr=0.0)  # client optimizer: no op compile
    engine, *_ = deepspeed.initialize(model=store, optimizer=optimizer, config=config)
    return engine


def read_user_weights(engine: Any) -> Tensor:
    """The whole float64 vector (gathered from the ZeRO-3 partitions when partitioned)."""
    import deepspeed

    param = engine.module.bits
    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        bits = param.detach().to("cpu").clone()
    return bits.view(torch.float64).clone()


def write_user_weights(engine: Any, w: Tensor) -> None:
    """Store ``w`` (identical on every rank): rank 0's copy is broadcast and re-partitioned."""
    import deepspeed

    param = engine.module.bits
    bits = w.detach().to("cpu", torch.float64).contiguous().view(torch.float32)
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        with torch.no_grad():
            param.data.copy_(bits.to(param.device))
    back = read_user_weights(engine)
    if not torch.equal(back, w.detach().to("cpu", torch.float64)):
        raise RuntimeError("the DeepSpeed engine did not store the user weights bit for bit")


# -- the run ------------------------------------------------------------------------------------
def load_core(model_dir: str | Path, dtype: torch.dtype) -> tuple[nn.Module, Any, Any]:
    """The core model of a model directory built in ``dtype`` (weights loaded exactly)."""
    from pipeline.checkpoint import load_into, read_state_dict
    from pipeline.models.card import read_card
    from pipeline.models.registry import build

    card = read_card(model_dir)
    model, task = build(card.preset, card.options)
    model = model.to(dtype)
    load_into(model, read_state_dict(Path(model_dir) / "model.safetensors"), source=str(model_dir))
    return model.eval(), task, card


def _write_outputs(output: Path, tensors: dict[str, Tensor], record: dict[str, Any]) -> None:
    from pipeline.checkpoint import save_safetensors

    if output.exists():
        raise FileExistsError(f"output {output} already exists: choose a new output directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        save_safetensors(tensors, staging / "user_weights.safetensors")
        (staging / "mixed_linear.json").write_text(json.dumps(record, indent=2, default=str))
        os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_rank(spec: DistMixedLinearSpec, *, log: Callable[[str], None] = _stderr) -> dict[str, Any]:
    """This rank's part of the run; returns its record (the weights are identical on every rank)."""
    from pipeline.data import load_source
    from pipeline.linearized import LinearizedModel
    from pipeline.methods.mixed_linear import (
        forget_user_data, train_user_weights, user_block, user_state, user_vector,
    )
    from pipeline.checkpoint import read_state_dict

    spec.validate()
    started = time.perf_counter()
    rank, world, device = init_process_group(spec.backend)
    dtype = getattr(torch, spec.dtype)
    model, task, card = load_core(spec.model_dir, dtype)
    model = model.to(device)
    block = user_block(model, spec.user_parameters or None, spec.user_last_modules)
    lin = LinearizedModel(model, task, block)

    source = spec.data_source or card.data.source
    options = spec.data_options if spec.data_source else (spec.data_options or card.data.options)
    splits = load_source(source, options)
    if spec.data_split not in splits:
        raise ValueError(f"data_split '{spec.data_split}' not in source '{source}' (has {sorted(splits)})")
    user = splits[spec.data_split]
    if spec.user_ids is not None:
        user = user.take(user.positions_of(spec.user_ids, field="user_ids"))
    first = next(user.batches(1))
    outputs = int(lin.base_outputs({k: v.to(device) for k, v in first.items()}).shape[1])

    engine = make_engine(block.numel, spec.zero_stage, device)
    common = dict(rtol=spec.cg_rtol, max_iter=spec.cg_max_iter, allreduce=sum_allreduce,
                  batch_size=spec.batch_size, outputs=outputs)
    record: dict[str, Any] = {"world_size": world, "backend": dist.get_backend(), "zero_stage": spec.zero_stage,
                              "device": str(device), "user_dim": block.numel, "user_samples": len(user),
                              "user_block": block.describe()}
    if spec.init_user_weights:
        w = user_vector(block, read_state_dict(spec.init_user_weights))
        record["train"] = {"loaded_from": spec.init_user_weights}
    else:
        shard = user.take(contiguous_shard(len(user), rank, world)).to(device)
        result = train_user_weights(lin, shard, spec.weight_decay, **common)
        w = result.user_weights
        record["train"] = result.record
    write_user_weights(engine, w)
    if spec.forget_ids:
        retain = user.without(user.positions_of(spec.forget_ids, field="forget_ids"))
        shard = retain.take(contiguous_shard(len(retain), rank, world)).to(device)
        generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + 5)  # same on every rank
        result = forget_user_data(lin, read_user_weights(engine), shard, spec.weight_decay, sigma=spec.sigma,
                                  generator=generator, **common)
        write_user_weights(engine, result.user_weights)
        record["forget"] = {"forget_ids": list(spec.forget_ids), **result.record}
    final = read_user_weights(engine)
    record["seconds"] = time.perf_counter() - started
    if rank == 0:
        tensors = {k: v.contiguous() for k, v in user_state(block, model, final).items()}
        tensors[FLAT_KEY] = final
        _write_outputs(Path(spec.output), tensors, record)
        log(f"rank 0 of {world}: wrote {spec.output} ({record['seconds']:.1f} s)")
    dist.barrier()
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file of a DistMixedLinearSpec")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    spec = DistMixedLinearSpec.from_json(args.spec)
    run_rank(spec)  # on an error the launcher tears the other ranks down
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
