"""``fleetbatch loadgen``: the users' side and the benchmarks that drive the whole system from outside.

At the top: workloads (:mod:`load.workload`), the gRPC client (:mod:`load.client`), OpenAI batch output
(:mod:`load.openai_batch`), a local deployment for the demo and the studies (:mod:`load.deployment`),
arrival processes (:mod:`load.arrivals`), the TCP proxy for latency and partitions (:mod:`load.tcp_proxy`)
and the command (:mod:`load.cli`). In rooms by job: :mod:`load.chaos` (fault injection on a real
deployment), :mod:`load.studies` (MICO's study, the planned fleet, deadlines, prefixes, the WAN, policies,
offloading), :mod:`load.soaks` (the gateway's API at scale) and :mod:`load.reports` (what a run leaves and
how it is read). It sits above every other package but the simulator and the command.
"""
