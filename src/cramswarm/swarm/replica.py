"""One peer's replica of one pipeline stage, pure torch: what both training transports compute with (the emulation's
threads, ``emulation_training``, and the launcher's stage peers, ``hivemind_peer``). Which calls count, when a stage
steps, how the gradient sums are averaged and what crosses a boundary is the transports' business.
"""

from __future__ import annotations

import copy
import hashlib
import time

import torch

from cramswarm.precision import autocast
from cramswarm.swarm.stages import SavedActivations
from cramswarm.training import apply_gradients, make_optimizer


class StageReplica:
    """A stage's module and trainable parameters, the recipe's optimizer (``training.make_optimizer``), the precision
    and device it computes in, and its gradient sums in the parameters' ``.grad``. ``local_samples``: the samples
    whose gradients ``.grad`` holds (the caller counts a backward call's once it is over); ``snapshot``: (step, flat
    fp32 gradients divided by their samples, samples) of ``take_snapshot``, until ``apply``."""

    def __init__(self, module: torch.nn.Module, recipe: dict, precision: str, device: torch.device, last: bool,
                 speed: float = 1.0, unit_time_s: float | None = None):
        self.module, self.recipe, self.precision, self.device, self.last = module, recipe, precision, device, last
        self.module.train()
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sizes = [p.numel() for p in self.params]
        self.num_params = sum(self.sizes)
        self.optimizer = make_optimizer(module, recipe)
        self.speed, self.unit_time_s = speed, unit_time_s   # unit_time_s: emulated compute floor per work unit
        self.step = self.local_samples = 0
        self.snapshot: tuple[int, torch.Tensor, int] | None = None
        self.activation_bytes = 0   # the most bytes one backward call's forward saved for backward (SavedActivations)

    def clone(self, speed: float) -> StageReplica:
        """A replica of speed ``speed`` with this one's parameters, optimizer state and step, without gradients."""
        twin = StageReplica(copy.deepcopy(self.module), self.recipe, self.precision, self.device, self.last, speed,
                            self.unit_time_s)
        twin.load_state(copy.deepcopy(self.state()))
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(self.precision, self.device):
            return self.module(x)

    def backward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor | None, float | None]:
        """Re-run the forward (any replica can take the call, as in SWARM) and backpropagate into ``.grad`` the loss x
        samples on the last stage (``target``: the labels), else the output gradient ``target`` (which carries that
        weighting): sample-weighted sums. Returns (the input gradient, None for token ids; the loss or None)."""
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with torch.enable_grad():
            with SavedActivations(self.params) as saved, autocast(self.precision, self.device):
                out = self.module(x, target) if self.last else self.module(x)
            self.activation_bytes = max(self.activation_bytes, saved.bytes)
            if self.last:
                (out.float() * x.shape[0]).backward()
            else:
                out.backward(target.to(out.dtype))
        return (x.grad if x.is_floating_point() else None), (float(out.item()) if self.last else None)

    def emulate_speed(self, seconds: float, units: float) -> None:
        """Sleep so that a call that computed ``seconds`` takes compute / ``speed``: the compute is ``seconds``, with
        ``unit_time_s`` at least ``units`` (``rebalancing.WORK_UNITS``) x that, so that a call's time, and peers'
        speed ratios, do not move with the host's load while the real compute fits under the floor. Without the floor
        a peer of speed s < 1 sleeps ``seconds x (1/s - 1)``, one of speed >= 1 not at all."""
        floor = units * self.unit_time_s if self.unit_time_s else 0.0
        time.sleep(max(0.0, max(seconds, floor) / self.speed - seconds))

    def take_grads(self) -> tuple[torch.Tensor, int]:
        """Move the gradient sums out of ``.grad``: (one flat fp32 vector on the host, zeros where none; samples)."""
        flat = torch.cat([p.grad.detach().float().reshape(-1).cpu() if p.grad is not None
                          else torch.zeros(p.numel()) for p in self.params])
        self.optimizer.zero_grad(set_to_none=True)
        samples, self.local_samples = self.local_samples, 0
        return flat, samples

    def add_grads(self, flat: torch.Tensor, samples: int) -> None:
        """Add gradient sums held as one flat fp32 vector (``take_grads``' layout) of ``samples`` samples."""
        for p, g in zip(self.params, torch.split(flat, self.sizes)):
            g = g.to(p.device, p.dtype).view_as(p)
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.local_samples += samples

    def take_snapshot(self, step: int) -> tuple[torch.Tensor, int]:
        """``take_grads`` divided by the samples in place, once per ``step`` (a retry gets the same vector); ``apply``
        drops it, so no second copy of the gradients exists (a group of one averages in place)."""
        if self.snapshot is None or self.snapshot[0] != step:
            flat, samples = self.take_grads()
            if samples:
                flat.div_(samples)
            self.snapshot = (step, flat, samples)
        _, flat, samples = self.snapshot
        return flat, samples

    def apply(self, averaged: torch.Tensor, lr: float) -> None:
        """One optimizer step on the flat ``averaged`` gradient (clipped in place) at ``lr``; the gradients of calls
        that arrived after the snapshot stay in ``.grad``."""
        leftover = [p.grad for p in self.params]
        self.snapshot = None
        apply_gradients(self.params, self.optimizer, torch.split(averaged, self.sizes), lr,
                        self.recipe["grad_clip_norm"])
        for p, g in zip(self.params, leftover):
            p.grad = g
        self.step += 1

    def digest(self) -> str:
        """SHA-1 of the parameters, in order: replicas that applied the same bytes have the same one."""
        digest = hashlib.sha1()
        for p in self.params:
            digest.update(p.detach().cpu().contiguous().numpy())   # its buffer, not a copy
        return digest.hexdigest()

    def state(self) -> dict:
        """Parameters, optimizer state and step (the live tensors): what a joining replica downloads."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state(self, state: dict) -> int:
        """Load a ``state``, dropping the gradients held; returns its step."""
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)
        self.step, self.local_samples, self.snapshot = state["step"], 0, None
        return self.step
