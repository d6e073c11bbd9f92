"""QAT training, distributed: the process group under ``torchrun`` (gloo on CPU, nccl on GPUs) and its
teardown, the end of a rank's process, FSDP2 sharding of the student, and the full (single-process format)
state dicts of an FSDP2 student and its optimiser. Imports no other training module.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, NoReturn, Sequence

import torch
from torch import nn


#: Timeout of every collective (and of the rendezvous). Ranks legitimately wait on each other for long: rank 0
#: gathers and writes the checkpoint (an 11B student with its optimiser state is ~130 GB) while the others wait in
#: the next collective, and on a loaded machine one rank can be descheduled for minutes. NCCL's default (10 min)
#: is too short for that; a real hang still ends (and under torchrun a crashed rank stops the others at once).
DIST_TIMEOUT = timedelta(hours=2)

#: Whether this process created the default process group (and so must tear it down, see :func:`leave_dist`).
_created_process_group = False
#: Whether this process ran as one rank of several (then ``python -m qat.train`` ends with :func:`end_rank`).
_ran_as_rank = False


def init_dist() -> tuple[int, int]:
    """(rank, world size); under torchrun (``WORLD_SIZE`` > 1) the default process group, created once."""
    global _created_process_group, _ran_as_rank
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():  # before any CUDA use: NCCL and FSDP2 work on the current device
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=DIST_TIMEOUT)
        _created_process_group = _ran_as_rank = True
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


def leave_dist(ok: bool) -> None:
    """Tear down the process group this process created: after a successful run, a barrier (no rank leaves while
    another still has a collective to do), then ``destroy_process_group`` (the documented teardown; for NCCL it
    frees the communicators). After an error nothing: another rank may be stuck in a collective this one will never
    join, and a teardown (an NCCL abort in particular) could then block; the exit status reports the failure.

    This does not stop gloo's threads: DDP and FSDP2 keep references to the group (its two ``pt_gloo_runloop``
    workers and the ``gloo_tcp_loop`` thread are still alive after ``destroy_process_group`` and ``gc.collect``),
    so the rank must not finalise its interpreter with them (:func:`end_rank`)."""
    global _created_process_group
    if not _created_process_group or not torch.distributed.is_initialized():
        return
    _created_process_group = False
    if ok:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def end_rank(status: int) -> NoReturn:
    """End a rank's process without interpreter finalisation (stdout and stderr flushed; every file qat.train
    writes is closed, the checkpoint fsynced).

    Why: a gloo worker that has completed a collective still holds the work object until it re-takes its lock;
    the main thread, woken by the completion, can meanwhile reach ``Py_FinalizeEx``. When the worker then drops the
    work, freeing a tensor whose PyObject C++ keeps alive takes the GIL; CPython ends a thread that asks for the GIL
    during finalisation with ``pthread_exit``, whose forced unwind through the (noexcept) destructor calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT of that rank, and torchrun kills
    the others (gdb: ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire -> take_gil ->
    PyThread_exit_thread -> __gxx_personality_v0 -> std::terminate). The window is the worker's delay in
    dropping the work, so it opens on loaded machines. Without finalisation no thread can ask for the GIL."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def fully_shard_student(net: nn.Module, student: nn.Module, device: torch.device, world: int) -> None:
    """FSDP2 (``fully_shard``): each transformer layer (the model's ``_no_split_modules``: Llama decoder layers;
    mllama's self- and cross-attention decoder layers and vision encoder layers) is one all-gather unit, ``net``
    the root holding the rest (embeddings and the tied LM head, norms, projector, vision stem). The specs'
    codebooks and permutations are plain attributes of the fake-quantised modules, replicated on every rank."""
    # heavy, needed under torchrun only: torch.distributed's FSDP2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    hf: Any = student  # an HF PreTrainedModel
    layers = set(hf._no_split_modules)
    for m in student.modules():
        if type(m).__name__ in layers:
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)


def _renumbered(osd: dict[str, Any], keys: Sequence[Any]) -> dict[str, Any]:
    """An optimiser state dict with its parameters renamed in order (torch.optim's indices <-> DCP's names)."""
    old = [k for g in osd["param_groups"] for k in g["params"]]
    new = dict(zip(old, keys, strict=True))
    return {"state": {new[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [new[k] for k in g["params"]]} for g in osd["param_groups"]]}


def full_state_dicts(student: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimiser state dicts of an FSDP2 student, gathered on rank 0 (in CPU memory; empty on the
    other ranks, every rank must call), in the single-process format: tied weights share one tensor, the
    optimiser state is keyed by parameter index."""
    # heavy, needed under FSDP2 only: torch.distributed.checkpoint
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(student, options=options)
    opt_sd: dict[str, Any] = get_optimizer_state_dict(student, opt, options=options)
    if torch.distributed.get_rank() != 0:
        return {}, {}
    first: dict[int, str] = {}
    for name, p in student.named_parameters(remove_duplicate=False):
        model_sd[name] = model_sd[first.setdefault(id(p), name)]
    n_params = sum(len(g["params"]) for g in opt_sd["param_groups"])
    return model_sd, _renumbered(opt_sd, range(n_params))


def load_full_optimizer_state(student: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's (full, index-keyed) optimiser state into the optimiser of an FSDP2 student: each rank
    keeps its shards."""
    # heavy, needed under FSDP2 only: torch.distributed.checkpoint
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in student.named_parameters()}
    by_name = _renumbered(state, [names[id(p)] for g in opt.param_groups for p in g["params"]])
    set_optimizer_state_dict(student, opt, by_name, options=StateDictOptions(full_state_dict=True))


def ran_as_rank() -> bool:
    """Whether this process ran as one rank of several (then it ends with :func:`end_rank`)."""
    return _ran_as_rank
