"""The one lease primitive: a Redis key that names its holder until the holder gives it back or its time runs out.

The mover lease (:mod:`workqueue.mover`), a batch's intake lease (:mod:`workqueue.intake_ops`) and the
HTTP front's finalizer lease (:mod:`gateway.http_api.finalizer`) are all a :class:`Lease`:

* **acquire**: ``SET key token NX PX ttl``: only when nobody holds it;
* **renew**: the holder only (its token still in the key): ``PEXPIRE`` to ``ttl`` from now;
* **release**: the holder only: ``DEL``; a lapsed lease, now another's, is left alone.

**Lease time is Redis time.** The key expires on the Redis server's clock (``PX``, ``PEXPIRE``),
never the client's, so clients with skewed clocks neither cut a live lease short nor keep a dead
one; a holder that dies blocks others for at most its ``ttl``. Scripts that act under a lease (the
intake's ``ENQUEUE_CHUNK``) check and renew it with the same Lua functions (:data:`LUA`:
``lease_held``, ``lease_renew``), which reach them through :mod:`workqueue.lua`.
"""

from __future__ import annotations

import redis

from workqueue.lua import Library

LUA = r"""
-- A lease is held by `token` while its key holds that token (the key expires on Redis time).
local function lease_held(key, token)
  return redis.call('GET', key) == token
end
-- The holder extends its lease to `ms` from now; 1, or 0 when `token` does not hold it.
local function lease_renew(key, token, ms)
  if lease_held(key, token) then return redis.call('PEXPIRE', key, ms) end
  return 0
end
-- The holder gives its lease back; 1, or 0 when `token` does not hold it (lapsed: another's, or no one's).
local function lease_release(key, token)
  if lease_held(key, token) then return redis.call('DEL', key) end
  return 0
end
"""

_LIBRARY = Library(LUA)
# KEYS: the lease. ARGV: token, ms.
RENEW = _LIBRARY.script("return lease_renew(KEYS[1], ARGV[1], tonumber(ARGV[2]))")
# KEYS: the lease. ARGV: token.
RELEASE = _LIBRARY.script("return lease_release(KEYS[1], ARGV[1])")


def ttl_ms(ttl_s: float) -> int:
    """A lease's time in whole milliseconds (at least 1), as Redis keeps it."""
    if not ttl_s > 0:
        raise ValueError(f"a lease's ttl must be > 0 s, not {ttl_s}")
    return max(1, int(ttl_s * 1000))


class Lease:
    """The lease ``key`` as ``token`` would hold it, for ``ttl_s`` at a time (see the module docstring)."""

    def __init__(self, client: redis.Redis, key: str, token: str, ttl_s: float) -> None:
        if not token:
            raise ValueError("a lease needs a token naming its holder")
        self.r, self.key, self.token, self.ttl_ms = client, key, token, ttl_ms(ttl_s)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)

    def acquire(self) -> bool:
        """Take the lease if nobody holds it; True when this token holds it now."""
        return bool(self.r.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        """Extend the lease to its ttl from now (Redis time); False when this token does not hold it."""
        return bool(int(self._renew(keys=[self.key], args=[self.token, self.ttl_ms])))

    def release(self) -> bool:
        """Give the lease back; False when this token did not hold it (it lapsed)."""
        return bool(int(self._release(keys=[self.key], args=[self.token])))

    def holder(self) -> str | None:
        """The token holding the lease now, if any."""
        return self.r.get(self.key)
