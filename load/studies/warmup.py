"""A deployment that has served the model before: its length calibration taught answers of the model first.

The gateway calibrates its length estimates from the answers its workers observed (:mod:`gateway.assign.calibrated`),
kept in Redis per served model. A deployment that ran the model yesterday starts today's batches calibrated; a
fresh one (a benchmark's own ``fleetbatch gateway up``) has nothing. :class:`Warmup` stands in for that history, as
``fleetbatch gateway calibrate --answers`` does for a user: the recorded answers of the same model to prompts
outside the workload, taught to the deployment's length models before the first batch is submitted.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from gateway.assign.calibrated import REFRESH_S
from gateway.deploy.calibrate import cluster_models, registered_models, teach
from load.workload import WorkItem
from predictor.calibration import Calibration
from workqueue import WorkQueue, connect
from workqueue.length_stats import read_stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Warmup:
    """Answers to teach: prompts, their recorded lengths (capped as the workload's) and the predictor's raw estimates."""

    prompts: list[str]
    lengths: list[int]
    raw: list[float]

    @classmethod
    def of(
        cls, dataset: str, items: list[WorkItem], n: int, seed: int, max_tokens: int, predictor: str
    ) -> Warmup:
        """``n`` answers of ``dataset`` to prompts that are not in ``items`` (fewer when the dataset has fewer)."""
        from fleetdata.datasets import load_dataset, response_lengths
        from localmodels import default_tokenizer
        from predictor.serving import LengthPredictor

        used = {it.prompt for it in items}
        rest = [r for r in load_dataset(dataset) if r.prompt not in used]
        picked = random.Random(seed + 1).sample(rest, min(n, len(rest)))
        if not picked:
            raise ValueError(f"{dataset} has no prompt outside the workload to teach the calibration with")
        lengths = [max(1, min(max_tokens, x)) for x in response_lengths(picked, default_tokenizer())]
        prompts = [r.prompt for r in picked]
        # capped as a worker caps the estimate it records beside an answer cut at max_tokens
        raw = [
            min(max_tokens, p.expected_tokens) for p in LengthPredictor.from_dir(predictor).predict(prompts)
        ]
        log.info("calibration warm-up: %d answers of %s outside the workload", len(prompts), dataset)
        return cls(prompts, lengths, raw)

    def teach(self, redis_url: str, clusters: int, timeout_s: float = 300.0) -> dict:
        """Teach every length model the deployment's ``clusters`` registered (waiting for their engines)."""
        queue = WorkQueue(connect(redis_url))
        give_up = time.monotonic() + timeout_s
        while True:
            if len(cluster_models(queue)) >= clusters:
                break
            if time.monotonic() > give_up:
                raise TimeoutError(
                    f"the deployment's {clusters} clusters did not register their length models"
                )
            time.sleep(0.2)
        models = registered_models(queue)
        for m in models:
            teach(queue, m, self.prompts, self.lengths, self.raw)
        ratio = Calibration.from_stats(read_stats(queue.r, models[0])).ratio
        time.sleep(
            REFRESH_S + 0.5
        )  # every gateway has re-read the calibration: the first batch is split on it
        return {"length_models": models, "answers": len(self.prompts), "ratio": round(ratio, 4)}
