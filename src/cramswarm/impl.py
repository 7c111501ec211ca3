"""How a run executes, apart from what it computes: the ``impl`` sections of the config.

``pretrain.impl`` and ``swarm.impl`` hold the settings that may change a run's speed, where its processes start and
how often it logs or saves, never its result. The workflow hands them to the commands as rule resources, not params
(cramswarm.workflow: ``PRETRAIN_IMPL``, ``SWARM_IMPL``), so changing one reruns nothing, and no resume fingerprint
holds them, so a saved state resumes under other values. Everything else in ``pretrain`` and ``swarm`` is what the
run computes (:func:`computed`): it reaches the params and the fingerprints.
"""

from __future__ import annotations

import dataclasses

# the keys of each impl section (config/schema.yaml), for the messages naming an old key's new place
PRETRAIN_IMPL_KEYS = (
    "compile", "compile_mode", "device", "attention_backend", "prefetch", "devices", "nodes", "log_every_steps",
    "resume_every_seconds", "resume_every_steps",
)  # fmt: skip
SWARM_IMPL_KEYS = (
    "give_up_after_s", "launcher_grace_s", "placement", "host", "interface", "srun_args", "checkpoint_every_s",
    "startup_timeout_s",
)  # fmt: skip


def computed(section: dict) -> dict:
    """What a ``pretrain`` or ``swarm`` section computes: the section less its ``impl``."""
    return {key: value for key, value in section.items() if key != "impl"}


@dataclasses.dataclass(frozen=True)
class PretrainImpl:
    """``pretrain.impl``: how a pretraining run executes. The defaults are the schema's (tests/test_config.py holds
    them equal)."""

    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile the model
    compile_mode: str = "default"  # default | max-autotune | reduce-overhead
    attention_backend: str = "auto"  # auto | math | flash | efficient
    prefetch: bool = True  # gather the next micro-batch in a background thread
    devices: int = 1  # data-parallel processes per node
    nodes: int = 1  # nodes of a data-parallel run
    log_every_steps: int = 10  # optimizer steps between training-log rows
    resume_every_seconds: float = 600.0  # wall-clock seconds between saves of the resumable state
    resume_every_steps: int | None = None  # also save every this many optimizer steps

    @classmethod
    def parse(cls, values: dict | None) -> PretrainImpl:
        """The settings ``values`` holds (a ``pretrain.impl`` section, validated), the rest at their defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values or {}) - known)
        if unknown:
            raise ValueError(f"pretrain.impl: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**(values or {}))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
