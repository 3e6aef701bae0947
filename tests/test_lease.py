"""The one lease primitive (workqueue.lease): exclusive, renewed and released by its holder only, lapsing on
Redis time; and no other module carries a lease rule of its own."""

from __future__ import annotations

import re
import uuid

from tests.harness import wait_until
from tests.test_keys import ROOT, project_modules
from workqueue import connect, keys
from workqueue.lease import Lease

LEASE_MODULE = ROOT / "workqueue" / "lease.py"
# the rules of a lease, spelled anywhere: a SET NX with an expiry (acquire), a token compared with a GET
# before PEXPIRE or DEL (renew, release), in Python or in Lua
LEASE_RULES = [
    re.compile(r"nx\s*=\s*True"),
    re.compile(r"['\"]NX['\"]", re.IGNORECASE),
    re.compile(r"redis\.call\(\s*'GET'"),
    re.compile(r"'PEXPIRE'|'PEXPIREAT'"),
]


def _key() -> str:
    return keys.MOVER + ":test:" + uuid.uuid4().hex  # a lease of its own for each test


def test_a_lease_has_one_holder_and_only_it_renews_or_releases(redis_url):
    r = connect(redis_url)
    key = _key()
    a, b = Lease(r, key, "a", 60), Lease(r, key, "b", 60)
    assert a.acquire()
    assert not b.acquire() and a.holder() == "a"
    assert not a.acquire()  # not twice, even by its holder: a second taker is a second holder
    assert not b.renew() and not b.release()
    assert a.holder() == "a"
    r.pexpire(key, 5_000)
    assert a.renew() and r.pttl(key) > 5_000  # back to its 60 s, on the server's clock
    assert a.release() and a.holder() is None
    assert not a.release()  # given back already
    assert b.acquire() and b.holder() == "b"
    b.release()


def test_a_lapsed_lease_is_anothers_and_its_old_holder_cannot_touch_it(redis_url):
    r = connect(redis_url)
    key = _key()
    short, other = Lease(r, key, "short", 0.05), Lease(r, key, "other", 60)
    assert short.acquire()
    wait_until(other.acquire, 30, "the short lease to lapse on Redis time", 0.01)
    assert not short.renew() and not short.release()  # its holder came back late
    assert other.holder() == "other"
    assert other.release() and other.holder() is None


def test_no_module_but_workqueue_lease_carries_a_lease_rule():
    bad = {}
    for path in project_modules():
        if path == LEASE_MODULE:
            continue
        text = path.read_text()
        found = [rule.pattern for rule in LEASE_RULES if rule.search(text)]
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"lease rules outside workqueue/lease.py (use workqueue.lease.Lease): {bad}"
