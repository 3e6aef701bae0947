"""Round trips counted on a real Redis: a command is one, a pipeline of many commands is one."""

from __future__ import annotations

from workqueue.embedded import connect
from workqueue.roundtrips import count_round_trips


def test_commands_and_pipelines_are_counted(redis_url):
    r = connect(redis_url)
    trips = count_round_trips(r)
    r.ping()  # the first use opens a connection: its set-up counts too
    after_connect = trips.value
    assert after_connect >= 1
    r.set("rt:a", "1")
    r.get("rt:a")
    assert trips.value == after_connect + 2
    pipe = r.pipeline(transaction=False)
    for i in range(50):
        pipe.incr(f"rt:{i}")
    pipe.execute()
    assert trips.value == after_connect + 3
    r.delete(*(f"rt:{i}" for i in range(50)), "rt:a")
