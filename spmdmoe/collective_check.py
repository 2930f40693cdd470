"""The collective-checking mode: every spmdmoe collective first compares its inputs across the ranks that run it.

In this mode (``spmdmoe.set_checks("collectives")`` or ``SPMDMOE_CHECKS=collectives``; off by default) each
public collective, each :func:`spmdmoe.moe.sync_grads` call and each MoE layer's forward first exchanges a record
per rank through the process group's store, and every rank that arrives raises the same error where the records
differ. A local constructor that rejects its input on one rank raises there at once, and its record
(:func:`announce`) stands in for the rank's in the axis' next check. Eager only. What is compared, the errors
and the cost: ``docs/guide.md``, "Every rank agrees"; what carries each check: ``docs/design.md`` §6.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .host import tracing
from .types import errors
from .types.checks import checks_mode
from .types.errors import SPMDCollectiveError, SPMDDtypeError, SPMDLayoutError, SPMDShapeError
from .types.mesh import MeshAxis
from .types.placement import Replicate
from .types.tensor import LOCAL_ERROR_HOOKS, SPMDTensor

__all__ = ["check_collective", "announce", "timeout_s", "exchange"]

# the fields every rank must hold equal, in the order they are reported, and the error each one raises
FIELDS = (("op", SPMDCollectiveError), ("target", SPMDCollectiveError), ("grad_enabled", SPMDCollectiveError),
          ("training", SPMDCollectiveError),
          ("needs_grad", SPMDLayoutError),
          ("placement", SPMDLayoutError), ("global_tokens", SPMDLayoutError),
          ("token_dim", SPMDLayoutError), ("dtype", SPMDDtypeError), ("features", SPMDShapeError),
          ("checksum", SPMDCollectiveError))
# the fix each field's disagreement calls for (the input's metadata fields: _METADATA_HINT)
_HINTS = {
    "checksum": "the replicated content differs between ranks: build it from the same data (same seed), or use "
                "Shard / Varying if it is per-rank data",
    "op": "every rank must call the same collectives in the same order",
    "target": "every rank must redistribute to the same placement (a different target runs another collective)",
    "grad_enabled": "run the step under the same grad mode on every rank (torch.no_grad() on some ranks only leaves "
                    "the others waiting in the backward's collectives)",
    "needs_grad": "freeze the same parameters on every rank",
    "training": "put the model in the same train() / eval() mode on every rank",
}
_METADATA_HINT = ("the input was built with different metadata on some ranks (a locally built tensor: shard, "
                  "SPMDTensor(...), with_local, from_buffer); build it alike on every rank")
_sequence: dict[str, int] = {}  # per process group (its name): the calls checked so far


def timeout_s() -> float:
    """How long a rank waits for its peers' records (``SPMDMOE_CHECK_TIMEOUT``, seconds; default 60)."""
    return float(os.environ.get("SPMDMOE_CHECK_TIMEOUT", "60"))


def _record(op: str, x: Any, problem: Optional[BaseException]) -> dict[str, Any]:
    rec: dict[str, Any] = {"op": op, "grad_enabled": torch.is_grad_enabled()}
    if isinstance(x, SPMDTensor):
        local = x.local
        rec.update(placement=repr(x.placement), global_tokens=x._global_tokens, token_dim=x.token_dim,
                   dtype=str(local.dtype),
                   features=[n for d, n in enumerate(local.shape) if d != x.token_dim % max(local.dim(), 1)])
        if isinstance(x.placement, Replicate):
            data = local.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            rec["checksum"] = f"{zlib.crc32(data):08x}"
    else:
        rec["placement"] = type(x).__name__
    if problem is not None:
        rec["problem"] = [type(problem).__name__, str(problem)]
    return rec


def _post(axis: MeshAxis, payload: bytes, space: str = "collective_check") -> tuple[Any, int, list[str]]:
    """Write this rank's record of the axis' next exchange in ``space`` (its own sequence of numbers):
    ``(store, its sequence number, every member's key)``."""
    store = dist.distributed_c10d._get_default_store()
    group = str(getattr(axis.group, "group_name", axis.ranks))  # the same on every member
    seq = _sequence.get(space + group, 0)
    _sequence[space + group] = seq + 1
    prefix = f"spmdmoe/{space}/" + hashlib.sha1(group.encode()).hexdigest()[:12]
    keys = [f"{prefix}/{seq}/{r}" for r in range(axis.size)]
    store.set(keys[axis.rank], payload)
    return store, seq, keys


def exchange(axis: MeshAxis, payload: bytes, space: str = "collective_check",
             timeout: Optional[float] = None) -> list[bytes]:
    """Every member's payload, in axis-rank order, through the default store (host to host: no device work); a
    member that does not arrive within ``timeout`` seconds (default :func:`timeout_s`) raises
    :class:`SPMDCollectiveError` on every rank that did. ``space``: the exchanges numbered together (this
    mode's checks; sync-free EP's ``T_max``, ``moe/parallel/admission.py``)."""
    store, seq, keys = _post(axis, payload, space)
    limit = timeout_s() if timeout is None else timeout
    try:
        store.wait(keys, timedelta(seconds=limit))
    except RuntimeError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise SPMDCollectiveError(
            f"{space} exchange #{seq} on mesh axis ranks {list(axis.ranks)}: axis rank(s) {missing} (global "
            f"{[axis.ranks[r] for r in missing]}) did not arrive within {limit:g} s; they run another "
            f"number of spmdmoe calls than this rank (a collective or a layer skipped or added on some ranks), or "
            f"are stuck elsewhere" + (". Raise SPMDMOE_CHECK_TIMEOUT if they are only slow" if timeout is None
                                      else "")) from None
    records = [store.get(k) for k in keys]
    if seq >= 1:  # every member wrote call seq's record, so none still reads call seq - 1's (nor waits on it)
        with contextlib.suppress(RuntimeError, NotImplementedError):  # a store without deletes keeps them
            store.delete_key(keys[axis.rank].rsplit("/", 2)[0] + f"/{seq - 1}/{axis.rank}")
    return records


def announce(op: str, axis: MeshAxis, error: BaseException) -> None:
    """The collective-checking mode only: a local check of ``op`` (a constructor that talks to no rank:
    ``SPMDTensor(...)``, ``from_buffer``, ``with_local``, ``shard``, ``padded_empty``) is about to raise ``error``
    on this rank alone. Its record, with the problem, becomes this rank's entry in the axis' next collective
    check, so the peers that go on into that collective raise the same error type instead of waiting for this
    rank. No wait: this rank raises ``error`` at once."""
    if checks_mode() == "collectives" and dist.is_initialized() and not tracing():
        payload = {"op": op, "problem": [type(error).__name__, f"{op}: {error}"]}
        _post(axis, json.dumps(payload).encode())


LOCAL_ERROR_HOOKS.append(announce)


def _verdict(axis: MeshAxis, recs: list[dict[str, Any]]) -> Optional[BaseException]:
    """The same error on every rank (or None): local problems first, then the first field that differs."""
    def who(ranks: list[int]) -> str:
        return f"axis rank(s) {ranks} (global {[axis.ranks[r] for r in ranks]})"
    bad = [r for r, rec in enumerate(recs) if "problem" in rec]
    if bad:
        error = getattr(errors, recs[bad[0]]["problem"][0], SPMDLayoutError)
        details = "; ".join(f"axis rank {r}: {recs[r]['problem'][1]}" for r in bad)
        op = next((rec["op"] for rec in recs if "problem" not in rec), recs[0]["op"])  # announced: its own op
        return error(f"{op} rejected the input on {who(bad)}: {details}")
    for field, error in FIELDS:
        values = [rec.get(field) for rec in recs]
        if any(v != values[0] for v in values):
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(json.dumps(v), []).append(r)
            seen = "; ".join(f"{v} on {who(rs)}" for v, rs in groups.items())
            return error(f"ranks disagree on {recs[0]['op']}'s input: {field} is {seen}. Fix: "
                         f"{_HINTS.get(field, _METADATA_HINT)}")
    return None


def check_collective(op: str, axis: MeshAxis, x: Any, problem: Optional[BaseException],
                     fields: Optional[dict[str, Any]] = None) -> None:
    """Compare this collective's input across ``axis`` (the collective-checking mode); raise the same error on
    every rank, or return when all agree and no rank has a problem. ``fields``: more values to compare (one of
    :data:`FIELDS`' names)."""
    if tracing():
        raise SPMDCollectiveError(
            f"{op}: the collective-checking mode (spmdmoe.set_checks('collectives')) is eager only: it exchanges on "
            f"the host before every collective. Turn it off under torch.compile and CUDA graph capture "
            f"(spmdmoe.set_checks(True)) and debug the eager step")
    payload = json.dumps({**_record(op, x, problem), **(fields or {})}).encode()
    recs = [json.loads(p) for p in exchange(axis, payload)]
    verdict = _verdict(axis, recs)
    if verdict is not None:
        raise verdict
