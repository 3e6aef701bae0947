"""``fleetbatch loadgen deadlines``' figures on recorded reads, and the simulator's deadline order and expiry."""

from __future__ import annotations

from types import SimpleNamespace

from load.studies.deadlines_stats import eta_errors, expired_rows_problems, met
from sim.core import ClusterSpec, SimConfig, Simulator
from sim.queues import OrderedQueue
from sim.workload import Workload


def test_the_eta_error_is_read_when_the_batch_reaches_its_share_of_tokens():
    batches = {
        "a": {"status": "COMPLETED", "submitted_at": 100.0, "completed_at": 200.0, "deadline": 250.0},
        "x": {"status": "EXPIRED", "submitted_at": 100.0, "completed_at": 150.0, "deadline": 150.0},
    }
    reads = [
        {
            "batch": "a",
            "t": 110.0,
            "predicted_tokens": 1000,
            "done_predicted_tokens": 100,
            "predicted_finish_at": 400,
        },
        {
            "batch": "a",
            "t": 130.0,
            "predicted_tokens": 1000,
            "done_predicted_tokens": 260,
            "predicted_finish_at": 210,
        },
        {
            "batch": "a",
            "t": 150.0,
            "predicted_tokens": 1000,
            "done_predicted_tokens": 520,
            "predicted_finish_at": 195,
        },
        {
            "batch": "x",
            "t": 120.0,
            "predicted_tokens": 10,
            "done_predicted_tokens": 9,
            "predicted_finish_at": 1,
        },
    ]
    assert eta_errors(reads, batches, 0.25) == {
        "a": 0.1
    }  # |210 - 200| / (200 - 100); an expired batch has none
    assert eta_errors(reads, batches, 0.5) == {"a": 0.05}
    assert eta_errors(reads, batches, 0.9) == {}
    assert met(batches) == ["a"]


def test_an_expired_batchs_files_are_checked_row_by_row():
    counts = SimpleNamespace(total=3, completed=1, failed=2)
    batch = SimpleNamespace(status="expired", request_counts=counts)
    out = [{"custom_id": "r1"}]
    errors = [{"custom_id": c, "error": {"code": "batch_expired"}} for c in ("r2", "r3")]
    assert expired_rows_problems(batch, ["r1", "r2", "r3"], out, errors) == []
    twice = expired_rows_problems(batch, ["r1", "r2", "r3"], out, [*errors, errors[0]])
    assert any("more than once" in p for p in twice)
    lost = expired_rows_problems(batch, ["r1", "r2", "r3", "r4"], out, errors)
    assert any("in neither file" in p for p in lost)
    other = [{"custom_id": "r2", "error": {"code": "server_error"}}, errors[1]]
    assert any(
        "other than batch_expired" in p for p in expired_rows_problems(batch, ["r1", "r2", "r3"], out, other)
    )
    done = SimpleNamespace(status="completed", request_counts=counts)
    assert any("not expired" in p for p in expired_rows_problems(done, ["r1", "r2", "r3"], out, errors))


def test_the_simulators_queue_runs_the_lowest_key_first_and_gives_up_its_back():
    q = OrderedQueue()
    for i, key in enumerate([5.0, 5.0, 1.0, 9.0, 1.0]):
        q.append(i, key)
    assert q.tail(3) == [0, 1, 3]
    assert q.pop() == 3 and q.popleft() == 2 and q.popleft() == 4 and q.popleft() == 0
    assert q.tail(5) == [1] and q.pop() == 1 and not q


def test_the_simulator_runs_the_earliest_deadline_first_and_expires_what_waited_past_it():
    n = 9
    work = Workload(
        prompt_tokens=[4] * n,
        true_tokens=[20] * n,
        predicted_tokens=[20.0] * n,
        arrival_s=[0.0] * n,
        order_key=[100.0] * 3 + [10.0] * 6,  # the last six were submitted later, due sooner
        deadline_s=[0.0] * 8 + [0.01],  # the last one's window ends before a slot frees for it
    )
    specs = [ClusterSpec("c1", batch=1)]
    sim = Simulator(specs, work, SimConfig(policy="round_robin", offload=False))
    finish = sim.run().finish_s
    assert sim.expired == {8}
    assert max(finish[3:8]) < min(finish[0:3])
