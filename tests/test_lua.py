"""The Lua scripts share their functions one way (workqueue.lua): each script carries exactly the library's
functions it uses, directly or through others, and each compiles in a real Redis."""

from __future__ import annotations

import pytest

from workqueue import (
    WorkQueue,
    batch_scripts,
    connect,
    intake_ops,
    lease,
    move_scripts,
    scripts,
    ticks,
    upgrade,
)
from workqueue.lua import Library, names_in
from workqueue.lua_queue import LIBRARY

MODULES = (scripts, batch_scripts, move_scripts, upgrade, ticks, intake_ops, lease)
EVERY_FUNCTION = LIBRARY.extended(move_scripts.MOVE_FUNCTIONS, upgrade.ORDER_KEY_OF)
SOURCES = {
    id(move_scripts.MOVE_FUNCTIONS),
    id(upgrade.ORDER_KEY_OF),
    id(lease.LUA),
}  # the library's, not scripts


def all_scripts() -> dict[str, str]:
    out = {}
    for module in MODULES:
        for name, value in vars(module).items():
            if (
                name.isupper()
                and isinstance(value, str)
                and "redis.call" in value
                and id(value) not in SOURCES
            ):
                out[f"{module.__name__}.{name}"] = value
    return out


def carried(library: Library, script: str) -> tuple[set[str], set[str]]:
    """The library's definitions ``script`` carries, and those it needs (used by the rest of it, or by them)."""
    present = {n for n, d in library.definitions.items() if d.source in script}
    rest = script
    for n in present:
        rest = rest.replace(library.definitions[n].source, "")
    return present, set(library.needed(rest))


def test_every_script_carries_exactly_the_functions_it_uses():
    found = all_scripts()
    assert len(found) >= 18, sorted(found)
    wrong = {}
    for name, script in found.items():
        present, needed = carried(EVERY_FUNCTION, script)
        if present != needed:
            wrong[name] = {"unused": sorted(present - needed), "missing": sorted(needed - present)}
    assert not wrong, wrong
    assert "gave_up_result" not in scripts.COMPLETE and "land" not in names_in(scripts.CLAIM)


def test_the_library_refuses_a_function_used_before_it_is_defined_or_defined_twice():
    with pytest.raises(ValueError, match="defined after it"):
        Library("local function a() return b() end\nlocal function b() return 1 end\n")
    with pytest.raises(ValueError, match="defined twice"):
        Library("local function a() return 1 end\n").extended("local function a() return 2 end\n")
    lib = Library(
        "local X = 1\n-- b doubles\nlocal function b(y)\n  return 2 * y\nend\nlocal function c() return b(X) end\n"
    )
    assert lib.needed("return c()") == ["X", "b", "c"]
    assert lib.needed("return 'c' -- not c()") == []
    assert lib.script("return b(1)").startswith("-- b doubles\nlocal function b(y)")


def test_every_script_compiles_in_redis(redis_url):
    r = connect(redis_url)
    for name, script in all_scripts().items():
        assert r.script_load(script), name


def test_a_redis_that_lost_the_scripts_gets_them_again(redis_url):
    """EVALSHA, NOSCRIPT, load, again: in one pipeline (workqueue.script_call) and alone (redis-py's Script)."""
    r = connect(redis_url)
    queue = WorkQueue(r)
    queue.register_cluster("a", capacity_hint_tps=1.0)
    r.script_flush()
    assert queue.requeue_all_expired() == {"a": 0}
    r.script_flush()
    assert queue.requeue_expired("a") == 0
