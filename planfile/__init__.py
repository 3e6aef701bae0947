"""The plan file (``plan.json``) as a shared contract at the bottom: its schema, validation, reading and writing.

The planner writes plan files (:func:`save_plan`); the engines, the vLLM backend and the gateway
read them (:func:`load_plan`) without importing the planner. The fields are described in
:mod:`planfile.schema`. This package imports nothing of the project.
"""

from planfile.device_cost import DeviceCost, DeviceCostError
from planfile.schema import (
    MODEL_KEYS,
    PLAN_VERSION,
    Plan,
    PlanError,
    StagePlan,
    load_plan,
    plan_from_dict,
    save_plan,
)

__all__ = [
    "DeviceCost",
    "DeviceCostError",
    "MODEL_KEYS",
    "PLAN_VERSION",
    "Plan",
    "PlanError",
    "StagePlan",
    "load_plan",
    "plan_from_dict",
    "save_plan",
]
