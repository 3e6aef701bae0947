"""The cluster file (``clusters.yaml``) as a shared contract at the bottom: one versioned schema.

One file describes a fleet for every command that reads one: ``fleetbatch gateway serve --clusters``,
``fleetbatch gateway up --clusters`` (which plans the clusters that name devices) and
``fleetbatch planner fleet``. :mod:`clusterfile.schema` holds the schema (pydantic); :mod:`clusterfile.prices` the
catalog's default GPU prices and the rule that prices a cluster (``price_per_hour``, ``market``);
:func:`load_cluster_file` reads and validates a file, :func:`dump_cluster_file` writes one. This package
imports nothing of the project.
"""

from clusterfile.prices import (
    DEVICE_PRICES_PER_HOUR,
    SPOT_FRACTION,
    Market,
    cluster_price_per_hour,
    devices_price_per_hour,
)
from clusterfile.schema import (
    CLUSTER_FILE_VERSION,
    ENDPOINT_BACKEND,
    NAME_PATTERN,
    BackendName,
    Cluster,
    ClusterFile,
    ClusterFileError,
    Emulation,
    dump_cluster_file,
    endpoint_base,
    load_cluster_file,
    parse_cluster_file,
)

__all__ = [
    "CLUSTER_FILE_VERSION",
    "DEVICE_PRICES_PER_HOUR",
    "SPOT_FRACTION",
    "Market",
    "cluster_price_per_hour",
    "devices_price_per_hour",
    "ENDPOINT_BACKEND",
    "NAME_PATTERN",
    "BackendName",
    "Cluster",
    "ClusterFile",
    "ClusterFileError",
    "Emulation",
    "dump_cluster_file",
    "endpoint_base",
    "load_cluster_file",
    "parse_cluster_file",
]
