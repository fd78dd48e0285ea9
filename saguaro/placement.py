"""Where the SSD speculator runs: which device, and in a process of its own or in a thread.

``place_speculator`` decides from the target's device, the requested draft device, the number
of GPUs and the requested transport, and nothing else (a pure function; tested on its own):

  * target on the CPU: the speculator process pinned to its own cores (``draft_cores``);
  * target on a GPU, another GPU present: the draft on the next GPU, in its own process, over
    NCCL (the paper's setting);
  * target on a GPU, no other GPU: a thread of the target's process on the same GPU, with its
    own CUDA stream. Two processes cannot share one GPU here: NCCL refuses two ranks on one
    device, and without MPS the GPU time-slices between processes instead of overlapping them.

``speculator_transport="thread"`` also runs on the CPU (the thread pins itself to
``draft_cores``); it shares the interpreter lock with the target, so it is slower there than
the process. A placement that cannot work is refused with the options that can.
"""
from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("auto", "process", "thread")


@dataclass(frozen=True)
class Placement:
    transport: str  # "process" (WorkerLink) or "thread" (ThreadLink)
    draft_device: str  # "cpu" or "cuda:N"


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"speculator_transport must be one of {TRANSPORTS}, got {transport!r}")


def gpu_index(device: str) -> int | None:
    """N of "cuda:N" ("cuda" is GPU 0); None for the CPU."""
    if not device.startswith("cuda"):
        return None
    return int(device.split(":")[1]) if ":" in device else 0


def place_speculator(device: str, draft_device: str | None, gpu_count: int, transport: str = "auto") -> Placement:
    """The speculator's transport and device for a target on ``device``.

    ``draft_device`` None picks the default: the CPU for a CPU target; for a GPU target the next GPU
    when there are several (unless the thread transport was asked for: it colocates), else the
    target's own GPU. ``transport`` "auto" picks the process unless it cannot work (a draft on the
    target's GPU, or on a GPU beside a CPU target: its NCCL link would put both ranks on one GPU).
    """
    check_transport(transport)
    for name, dev in (("device", device), ("draft_device", draft_device)):
        index = gpu_index(dev) if dev is not None else None
        if index is not None and index >= gpu_count:
            raise ValueError(f"{name} {dev!r} requested but only {gpu_count} GPU(s) are present")
    target_gpu = gpu_index(device)
    if draft_device is None:
        if target_gpu is None:
            draft_device = "cpu"
        elif gpu_count > 1 and transport != "thread":
            draft_device = f"cuda:{(target_gpu + 1) % gpu_count}"
        else:
            draft_device = f"cuda:{target_gpu}"
    draft_gpu = gpu_index(draft_device)
    # the process link's NCCL ranks sit on the draft's GPU and on the target's device
    process_ok = draft_gpu is None or (target_gpu is not None and target_gpu != draft_gpu)
    if transport == "auto":
        transport = "process" if process_ok else "thread"
    if transport == "process" and not process_ok:
        other = ("put the draft on another GPU (draft_device='cuda:N')" if gpu_count > 1
                 else "this machine has no second GPU for it")
        raise ValueError(
            f"the SSD speculator cannot run in a process of its own on {draft_device} beside a target on {device}: "
            f"NCCL refuses two ranks on one GPU (and two processes on one GPU take turns rather than overlap). "
            f"Options: speculator_transport='thread' (the speculator in a thread of the target's process, on its own "
            f"CUDA stream), or 'auto'; or {other}")
    return Placement(transport, draft_device)

