"""SLURM auto-requeue with ``DistributedCheckpoint``: the checkpoint is ours, the requeue is Lightning's.

Lightning's own handler for ``SLURMEnvironment(auto_requeue=True)`` would
write a synchronous full ``hpc_ckpt_<N>.ckpt`` inside the signal handler and
restore it after the requeue. With the callback, the core's preemption
handling owns the requeue signal: every rank saves at the next step boundary,
the save commits, and then rank 0 requeues the job exactly as Lightning does
(``scontrol requeue <job id>``). The requeued run resumes from the newest
valid checkpoint of ours, also when an ``hpc_ckpt_*.ckpt`` is present.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from typing import Any, Mapping, Optional

log = logging.getLogger("lightning.pytorch.ckpt")


def requeue_signal(trainer: Any) -> Optional[int]:
    """The signal on which Lightning would requeue this job (``SLURMEnvironment`` with auto-requeue), else None."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return int(environment.requeue_signal)
    return None


def job_id(environ: Mapping[str, str] = os.environ) -> str:
    """``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID`` (as Lightning requeues)."""
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    jid = f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}" if array_job is not None else environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", jid):
        raise ValueError(f"not a SLURM job id: {jid!r}")
    return jid


def requeue(environ: Mapping[str, str] = os.environ) -> int:
    """Run ``scontrol requeue <job id>``; its exit code (logged)."""
    jid = job_id(environ)
    log.info("requeuing SLURM job %s after its checkpoint committed", jid)
    try:
        result = subprocess.call(["scontrol", "requeue", jid])
    except FileNotFoundError:
        result = subprocess.call(f"scontrol requeue {jid}", shell=True)
    if result == 0:
        log.info("requeued SLURM job %s", jid)
    else:
        log.warning("requeuing SLURM job %s failed with exit code %d", jid, result)
    return result
