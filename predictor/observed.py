"""Observed response lengths in Redis, for retraining (MICO §3.2).

Engines push one JSON object per finished query onto the Redis LIST :data:`OBSERVED_KEY`:
``{"prompt": str, "length": int, "source": str, "cluster": str, "predicted": float | null}``,
``length`` being completion tokens in the serving tokenizer. The record is
:class:`workqueue.records.Observation`, which both sides use.
"""

from __future__ import annotations

import logging

import redis

from fleetdata.datasets import Record
from workqueue.embedded import connect, redact_url
from workqueue.keys import OBSERVED
from workqueue.records import Observation

log = logging.getLogger(__name__)

OBSERVED_KEY = OBSERVED  # the key schema lives in workqueue.keys


def encode_observed(
    prompt: str, length: int, source: str = "", cluster: str = "", predicted: float | None = None
) -> str:
    """The JSON element for one finished query."""
    if length < 0:
        raise ValueError(f"observed length must be non-negative, not {length}")
    return Observation(prompt, int(length), source, cluster, predicted).to_json()


def record_observed(
    client: redis.Redis,
    prompt: str,
    length: int,
    source: str = "",
    cluster: str = "",
    predicted: float | None = None,
) -> None:
    """Append one observation (RPUSH, so the list runs oldest to newest)."""
    client.rpush(OBSERVED_KEY, encode_observed(prompt, length, source, cluster, predicted))


def read_observed(redis_url: str, limit: int | None = None) -> list[Record]:
    """The observations (the newest ``limit`` when given) as records with ``length`` set; bad entries are skipped."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive, not {limit}")
    client = connect(redis_url)  # its timeouts, TLS and clear errors, as every client's
    try:
        raw = client.lrange(OBSERVED_KEY, -limit if limit else 0, -1)
    except redis.exceptions.ConnectionError as e:
        raise ConnectionError(f"cannot read {OBSERVED_KEY} from Redis at {redact_url(redis_url)}: {e}") from e
    finally:
        client.close()
    out: list[Record] = []
    bad = 0
    for item in raw:
        try:
            obs = Observation.from_json(item)
            if not isinstance(obs.prompt, str) or not obs.prompt.strip() or obs.length < 0:
                raise ValueError("empty prompt or negative length")
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        out.append(
            Record(
                obs.prompt,
                "",
                obs.source or "observed",
                length=obs.length,
                meta={"cluster": obs.cluster, "predicted": obs.predicted},
            )
        )
    if bad:
        log.warning("skipped %d malformed entries in %s", bad, OBSERVED_KEY)
    log.info("read %d observed lengths from %s", len(out), OBSERVED_KEY)
    return out
