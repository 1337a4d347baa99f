"""Agreement among ranks that cannot rely on a collective: "is every rank here?".

After an exception, a rank does not know whether the other ranks reached the
same point (a signal broadcast by the framework) or are stuck inside a
collective (an error on one rank only). Entering the collective save alone
would hang forever. ``all_ranks_agree`` answers the question through the
process group's key-value store, never through a collective, within a time
limit, and gives the same answer on every rank that asks:

* every rank adds itself to a counter under ``tag``;
* rank 0 waits until all ``world_size`` ranks arrived (or the time is up) and
  proposes its decision with an atomic compare-and-set;
* a rank that gives up first (time is up, or it is not ready itself)
  proposes "no" with the same compare-and-set.

The first proposal wins, so no rank can decide "yes" while another decides
"no". A rank that never arrives makes everyone decide "no" after the time
limit.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger("ckpt_core")

_calls = itertools.count()
_YES, _NO = b"1", b"0"


def _default_store() -> Optional[Any]:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: callers decide without agreement
        return None


def all_ranks_agree(tag: str, local_ok: bool = True, timeout_s: float = 30.0, store: Optional[Any] = None) -> bool:
    """True on every rank iff every rank called this with ``tag`` and ``local_ok`` within ``timeout_s``.

    Never enters a collective, so it is safe to call when some ranks may be
    stuck elsewhere. Ranks must call it in the same order with the same
    ``tag`` (include the step). Without ``torch.distributed`` (or with one
    rank) it returns ``local_ok``. Without a reachable store it returns False
    on more than one rank.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(local_ok)
    store = store if store is not None else _default_store()
    if store is None:
        log.warning("ckpt_core: no process-group store to agree on %r; assuming the ranks disagree", tag)
        return False
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"ckpt_core/agree/{next(_calls)}/{tag}"
    decision, arrived = f"{prefix}/decision", f"{prefix}/arrived"
    if not local_ok:
        return store.compare_set(decision, "", _NO.decode()) == _YES
    store.add(arrived, 1)
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        while store.add(arrived, 0) < world and time.monotonic() < deadline and not store.check([decision]):
            time.sleep(0.02)
        want = _YES if store.add(arrived, 0) >= world else _NO
        return store.compare_set(decision, "", want.decode()) == _YES
    deadline += max(1.0, 0.2 * timeout_s)  # leave rank 0 the first word
    while time.monotonic() < deadline:
        if store.check([decision]):
            return store.get(decision) == _YES
        time.sleep(0.02)
    return store.compare_set(decision, "", _NO.decode()) == _YES
