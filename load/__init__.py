"""``loadgen``: the users' side and the benchmarks that drive the whole system from outside.

Workloads (:mod:`load.workload`), the gRPC client (:mod:`load.client`), the local demo, and
benchmarks that run real deployments: policies (:mod:`load.compare_policies`), offloading
(:mod:`load.bench_offload`), MICO's study (:mod:`load.study`) with run reports
(:mod:`load.report`), fault injection (:mod:`load.chaos`, with the TCP proxy of :mod:`load.tcp_proxy` for partitions
and latency) and intake soak (:mod:`load.soak`).
It sits above every other package.
"""
