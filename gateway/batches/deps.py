"""What the gateway's servicers and its batch service use (:class:`GatewayDeps`), built once by the server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.assign.calibrated import LengthCalibrator, LengthEstimates
from gateway.assign.policies import AssignmentPolicy
from gateway.assign.prefixes import Prefix
from gateway.batches.limits import InflightBytes
from gateway.config import GatewayConfig
from gateway.intake.background import IntakeSettings
from gateway.offload.moves import LinkCost
from gateway.status.eta import EtaBoard
from gateway.status.metrics import GatewayMetrics
from workqueue import WorkQueue


@dataclass
class GatewayDeps:
    """Everything the servicers use; built once by the server."""

    config: GatewayConfig
    queue: WorkQueue
    count_tokens: Callable[[list[str]], list[int]]
    # raw and calibrated (gateway.assign.calibrated; a plain list: uncalibrated)
    predict_tokens: Callable[[list[str]], LengthEstimates | list[float]]
    policy: AssignmentPolicy
    metrics: GatewayMetrics
    links: LinkCost = LinkCost()
    predictor: object | None = None  # the LengthPredictor, kept for hot reload
    intake: IntakeSettings = field(default_factory=IntakeSettings.from_env)
    # a bound of a prompt's tokens: prompts of a large batch it proves short are counted in intake
    token_bound: Callable[[str], int] | None = None
    tokenizer: object | None = None  # the serving tokenizer, for the HTTP front's chat templates
    inflight: InflightBytes | None = None  # --max-inflight-mb, shared by gRPC calls and the HTTP front
    #: every unfinished batch's ETA, refreshed by the offloader
    eta: EtaBoard = field(default_factory=EtaBoard)
    #: the length calibration (None: the raw estimates are used as they are)
    calibrator: LengthCalibrator | None = None
    #: each prompt's prefix group (gateway.assign.prefixes; None: none looked for, as a policy that ignores them)
    find_prefixes: Callable[[list[str], list[int]], list[Prefix]] | None = None
