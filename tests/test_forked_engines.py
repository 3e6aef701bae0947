"""Fork-served engines (gateway/deploy/forked.py) as the supervisor sees them, with a real fork server
and real processes: the fork server killed on its own must not make running engines read as exited."""

from __future__ import annotations

import json
import os
import signal
import sys
from multiprocessing import forkserver

from gateway.deploy.forked import EngineProcess
from tests.harness import wait_until
from workqueue.embedded import PARENT_ENV


def _alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped by whoever inherited it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_engine_outlives_its_killed_fork_server_as_running(tmp_path):
    """Before, the server's closed pipe read as exit 255: the supervisor restarted an engine that ran on."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    engine = EngineProcess(
        [sys.executable, "-m", "tests.forked_sleeper", "120"], env, str(tmp_path / "e.log")
    )
    wait_until(lambda: _alive(engine.pid), 30, "the engine")
    server = forkserver._forkserver._forkserver_pid
    assert server and server != engine.pid
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: engine._p.exitcode is not None, 30, "the server's pipe to close")
    assert engine._p.exitcode == 255  # what the server's end reads as
    assert engine.poll() is None and engine.returncode is None and _alive(engine.pid)  # it runs on
    engine.terminate()  # by its pidfd
    assert engine.wait(30) == 255  # its own code died with the server
    assert not _alive(engine.pid)


def test_an_engine_that_ends_reports_its_code(tmp_path):
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    engine = EngineProcess([sys.executable, "-m", "tests.forked_sleeper", "0"], env, str(tmp_path / "e.log"))
    assert engine.wait(60) == 0 and engine.poll() == 0
    engine.kill()  # a signal to an engine that has ended is nothing


def test_an_engines_stage_server_is_a_fork_of_the_engine_not_a_fresh_interpreter(tmp_path):
    """A forked engine's fork server for its pipeline's stages is forked from the engine as it starts (which has
    the engine's code imported), not a fresh interpreter importing torch again; the stages write to the engine's
    log as before."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    out, log = tmp_path / "stage.json", tmp_path / "e.log"
    for _ in range(2):  # each engine its own server (a restart too)
        engine = EngineProcess([sys.executable, "-m", "tests.forked_stager", str(out)], env, str(log))
        assert engine.wait(60) == 0, log.read_text()[-2000:]
        seen = json.loads(out.read_text())
        assert seen["server_parent"] == engine.pid  # the engine's child: its own
        assert seen["server"] != forkserver._forkserver._forkserver_pid  # not the deployment's server
        assert (
            "forkserver import main" not in seen["cmdline"]
        )  # not a fresh interpreter: a fork of the engine
        assert "tests.forked_stager" in seen["cmdline"] and "[stage fork server]" in seen["cmdline"]
        assert log.read_text().count(" here\n") >= 1  # the stage's output went to the engine's log
        wait_until(lambda s=seen["server"]: not _alive(s), 30, "the stage server to end with its engine")
        log.unlink()
