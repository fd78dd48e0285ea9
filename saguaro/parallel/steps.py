"""The step link: rank 0 tells the other ranks which pass to run, over the control group.

A step is exactly what a backend's ``run`` takes (ids, positions, the prepared attention metadata,
the rows whose logits are wanted), so every rank runs the same pass on its shard. On the wire: a
header [kind, payload bytes, ids on the device] and the pickled step as bytes; token ids that already
sit on a GPU (drafted tokens the host has not read) travel over the device group instead.

Waiting: an idle engine may send nothing for hours, so a rank waits for the next header without a
deadline (a dead rank 0 still ends the wait: its connections close). Everything after the header,
and everything rank 0 sends, is bounded by the groups' timeout: a rank that hangs mid-step is noticed.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from saguaro.parallel.groups import TPGroups

_PASS, _STOP = 1, 0


@dataclass
class Step:
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long, host
    meta: Any  # the backend's attention metadata (host tensors)
    logit_rows: torch.Tensor  # [R] long, host


class StepLink:
    def __init__(self, groups: TPGroups):
        self.groups = groups
        self.timeout = timedelta(seconds=groups.timeout_s)

    # -- rank 0 --------------------------------------------------------------------------------
    def send(self, step: Step) -> None:
        on_device = step.input_ids.device.type != "cpu"
        ids = step.input_ids
        payload = pickle.dumps(Step(ids.new_empty(0).cpu() if on_device else ids, step.positions, step.meta,
                                    step.logit_rows))
        self._header(_PASS, len(payload), ids.numel() if on_device else -1)
        self._bytes(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if on_device:
            self.groups.device_pg.broadcast(ids.contiguous(), 0, self.timeout).wait()

    def stop(self) -> None:
        """Tell every rank to leave its loop (rank 0 is closing)."""
        self._header(_STOP, 0, -1)

    # -- the other ranks -----------------------------------------------------------------------------
    def recv(self, device: torch.device) -> Step | None:
        """The next step, or None when rank 0 said stop."""
        header = torch.zeros(3, dtype=torch.int64)
        self.groups.broadcast_control(header)  # no deadline: see the module docstring
        kind, size, ids_on_device = header.tolist()
        if kind == _STOP:
            return None
        step: Step = pickle.loads(self._bytes(torch.empty(size, dtype=torch.uint8)).numpy().tobytes())
        if ids_on_device >= 0:
            step.input_ids = torch.empty(ids_on_device, dtype=torch.long, device=device)
            self.groups.device_pg.broadcast(step.input_ids, 0, self.timeout).wait()
        return step

    # -- both -------------------------------------------------------------------------------------------
    def _header(self, kind: int, size: int, ids_on_device: int) -> None:
        self.groups.broadcast_control(torch.tensor([kind, size, ids_on_device], dtype=torch.int64), self.timeout)

    def _bytes(self, buf: torch.Tensor) -> torch.Tensor:
        return self.groups.broadcast_control(buf, self.timeout) if buf.numel() else buf

