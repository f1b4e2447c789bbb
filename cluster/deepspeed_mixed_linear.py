"""The DeepSpeed side of data-parallel Mixed-Linear forgetting: the process group, the
summing all-reduce and the ZeRO engine that stores the user weights. What is computed (load
the core model and the user data, shard, train, forget) is
``pipeline.methods.mixed_linear.run_data_parallel``; this module only supplies where it runs.

Run one process per rank (``torchrun --nproc_per_node=N --master_addr=127.0.0.1 ...`` or the
``deepspeed`` launcher; ``unlearn mixed-linear-dist`` does it for you):

    python -m cluster.deepspeed_mixed_linear --spec SPEC.json

``allreduce`` = ``torch.distributed.all_reduce`` (SUM; gloo on CPU, NCCL on GPU): every sum
over samples inside conjugate gradient - J^T J v, J^T r and the counts - is reduced across
ranks, while the CG vectors (CPU float64) stay identical on every rank.

The user weights live in a DeepSpeed engine (``deepspeed.initialize`` with a ZeRO config of
the chosen stage and a client torch optimizer, so no optimizer op is compiled): with stage 3
they are partitioned across ranks and read / written through
``deepspeed.zero.GatheredParameters``. ZeRO-3 only partitions half/bfloat16/float32 tensors,
so the float64 vector is stored bit for bit as a float32 view (two words per weight); the
engine never does arithmetic on it, and every write is read back and checked.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from cluster.net import LOOPBACK, free_port
from pipeline.methods.mixed_linear import DataParallelJob, run_data_parallel


class RankSpec(BaseModel):
    """What every rank is told (JSON file on its command line): the job and where it runs."""

    model_config = ConfigDict(extra="forbid")
    job: DataParallelJob
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage of the engine holding the user weights")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl when CUDA is available, else gloo")

    @classmethod
    def from_json(cls, path: str | Path) -> "RankSpec":
        return cls.model_validate_json(Path(path).read_text())


# -- process group ------------------------------------------------------------------------------
def init_process_group(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Initialise torch.distributed through DeepSpeed; a plain ``python`` run is one rank on
    loopback (DeepSpeed would otherwise try MPI discovery)."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": LOOPBACK})
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    use_nccl = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_nccl:
        torch.cuda.set_device(local)
    else:
        _skip_shared_memory_kernel()
    deepspeed.init_distributed(dist_backend="nccl" if use_nccl else "gloo")
    device = torch.device("cuda", local) if use_nccl else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _skip_shared_memory_kernel() -> None:
    """On gloo, DeepSpeed's CPU comm backend would first JIT-compile its shared-memory all-reduce
    kernel (deepspeed_shm_comm, after probing a compiler for every op): minutes on a machine that
    has not built it yet, for a kernel these jobs never call (every reduction here is a
    torch.distributed one over gloo). Without it DeepSpeed falls back to gloo, as it does on
    platforms without the kernel."""
    import importlib

    try:  # (the module itself: ``import deepspeed.comm.torch`` names torch, which deepspeed.comm imports)
        ds_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # a DeepSpeed without that module builds no such kernel
        return
    if callable(getattr(ds_torch, "build_shm_op", None)):
        ds_torch.build_shm_op = lambda: None


def sum_allreduce(t: Tensor) -> Tensor:
    """The Mixed-Linear ``allreduce`` hook: in-place SUM over all ranks."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


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


class ZeroWeightStore:
    """``pipeline.methods.mixed_linear.WeightStore`` backed by a DeepSpeed engine."""

    def __init__(self, dim: int, zero_stage: int, device: torch.device) -> None:
        self.engine = make_engine(dim, zero_stage, device)

    def read(self) -> Tensor:
        return read_user_weights(self.engine)

    def write(self, w: Tensor) -> None:
        write_user_weights(self.engine, w)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_rank(spec: RankSpec) -> dict[str, Any]:
    """Set up this rank's process group and engine, run the job, wait for the other ranks."""
    rank, world, device = init_process_group(spec.backend)
    context = {"backend": dist.get_backend(), "zero_stage": spec.zero_stage}
    record = run_data_parallel(spec.job, rank=rank, world=world, device=device, allreduce=sum_allreduce,
                               store_factory=lambda dim: ZeroWeightStore(dim, spec.zero_stage, device),
                               context=context, log=_stderr)
    dist.barrier()
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file of a RankSpec")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    run_rank(RankSpec.from_json(args.spec))  # on an error the launcher tears the other ranks down
    dist.barrier()
    dist.destroy_process_group()
    end_rank()


def end_rank() -> None:
    """End a rank whose work is done (rank 0's output written, every rank past the last barrier, the group
    destroyed) without the interpreter's finalisation: there the ZeRO engine and gloo's worker threads are
    torn down in no set order, and a thread still joinable aborted one rank ("terminate called without an
    active exception", exit -6), so the launcher reported a failed run whose output was complete."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
