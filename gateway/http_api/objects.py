"""OpenAI's batch object for a gateway batch and its HTTP record: the status mapping, the times, the request
counts and usage, and this gateway's extension.

**The ``fleetbatch`` extension** (a field OpenAI's clients keep as an extra attribute): the batch's
``deadline`` and ``priority``, its token progress (``predicted_tokens``, ``done_predicted_tokens``,
``done_actual_tokens``) and, while it runs, its ETA (``predicted_finish_at``, ``at_risk``,
``remaining_tokens``; :mod:`gateway.status.eta`). ``expires_at`` is the batch's deadline (creation plus its
``completion_window``). An ``expiring`` batch (its window ended, its unfinished rows are being cancelled)
reads ``finalizing``; then ``expired``, its finished rows in the output file and the rest as
``batch_expired`` lines in the error file.
"""

from __future__ import annotations

import json

from gateway.checks.windows import WindowError, parse_window
from gateway.http_api.format import CHAT
from gateway.status.eta import Eta
from workqueue import BatchInfo, BatchState


def usage_of(rec: dict) -> dict | None:
    """OpenAI's batch ``usage`` (summed over the output file's requests), once the batch is finalized."""
    if not rec.get("finalized_at"):
        return None
    prompt, completion = int(rec.get("input_tokens") or 0), int(rec.get("output_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _ts(value) -> int | None:
    return int(float(value)) if value not in (None, "", "0") else None


def openai_status(info: BatchInfo | None, rec: dict) -> str:
    """OpenAI's status. With no gateway batch: ``expired`` once the record says so (or once it
    was finalized: the gateway batch expired first), ``validating`` while ``SubmitBatch`` is still
    creating it (the record is written first; ``cancelling`` once a cancel came meanwhile), ``failed`` with
    no record either. ``failed`` too when
    the input file was invalid (``invalid``: no gateway batch) or the finalizer gave up (``finalize_error``)."""
    if rec.get("finalize_error") or rec.get("invalid"):
        return "failed"
    if info is None:
        if not rec:
            return "failed"
        if rec.get("expired_at") or rec.get("finalized_at"):
            return "expired"
        return "cancelling" if rec.get("cancelling_at") else "validating"  # a cancel waits for its creation
    if not info.final:
        return (
            "finalizing" if info.status == BatchState.EXPIRING else info.status
        )  # validating | in_progress | cancelling
    if rec and not rec.get("finalized_at"):
        return "cancelling" if info.status == BatchState.CANCELLED else "finalizing"
    return info.status  # completed | failed | cancelled | expired


def batch_object(batch_id: str, info: BatchInfo | None, rec: dict, eta: Eta | None = None) -> dict:
    """OpenAI's batch object for a gateway batch (``info``) and its HTTP record (``rec``, maybe empty), with
    the ``fleetbatch`` extension (``eta``: its ETA, when it runs)."""
    status = openai_status(info, rec)
    created = _ts(rec.get("created_at")) or (int(info.created_at) if info else 0)
    done = _ts(rec.get("finalized_at")) or (int(info.completed_at) if info and info.completed_at else None)
    failed = (info.failed + info.cancelled) if info else 0
    errors = None
    if rec.get("invalid"):
        errors = {"object": "list", "data": json.loads(rec["invalid"])}
    elif status == "failed" or (info and info.error):
        message = (
            rec.get("finalize_error")
            or (info and info.error)
            or ("every request failed; see error_file_id" if info else "the batch was not created")
        )
        errors = {
            "object": "list",
            "data": [{"code": "failed", "message": message, "param": None, "line": None}],
        }
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": rec.get("endpoint", CHAT),
        "errors": errors,
        "input_file_id": rec.get("input_file_id", ""),
        "completion_window": rec.get("completion_window", "24h"),
        "status": status,
        "output_file_id": rec.get("output_file_id") or None,
        "error_file_id": rec.get("error_file_id") or None,
        "created_at": created,
        "in_progress_at": _ts(rec.get("in_progress_at")),
        "expires_at": int(info.deadline) if info and info.deadline else created + int(_window_s(rec)),
        "finalizing_at": _ts(rec.get("finalizing_at")),
        "completed_at": done if status == "completed" else None,
        "failed_at": done if status == "failed" else None,
        "expired_at": _ts(rec.get("expired_at")) or (done if status == "expired" else None),
        "cancelling_at": _ts(rec.get("cancelling_at")),
        "cancelled_at": done if status == "cancelled" else None,
        "request_counts": {
            "total": info.total if info else 0,
            "completed": info.completed if info else 0,
            "failed": failed,
        },
        "metadata": (info.metadata if info else None) or None,
        "usage": usage_of(rec),
        "fleetbatch": fleetbatch_fields(info, eta),
    }


def fleetbatch_fields(info: BatchInfo | None, eta: Eta | None) -> dict | None:
    """The ``fleetbatch`` extension of a batch object (None without a gateway batch)."""
    if info is None:
        return None
    live = eta is not None and not info.final
    return {
        "deadline": info.deadline or None,
        "priority": info.priority,
        "predicted_tokens": round(info.predicted_tokens, 1),
        "done_predicted_tokens": round(info.done_predicted_tokens, 1),
        "done_actual_tokens": info.done_actual_tokens,
        "predicted_finish_at": round(eta.finish_at, 3) if live else None,
        "at_risk": eta.at_risk if live else False,
        "remaining_tokens": round(eta.remaining_tokens, 1) if live else None,
    }


def _window_s(rec: dict) -> float:
    try:
        return parse_window(rec.get("completion_window"))
    except WindowError:
        return parse_window(None)
