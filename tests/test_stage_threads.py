"""The AR stage processes' thread budget: the decoder's --stage-threads and
--omp-wait-policy options, and the environment a spawned process starts
with (docs/decoder.md, "Threads"). Served end to end (the talker's process,
GetDecoderInfo, the metric) in test_vllm_e2e.py."""

from __future__ import annotations

import argparse
import multiprocessing
import os

import pytest

from decoder_svc.server import add_arguments, stage_threads
from decoder_svc.spawned import start_with_threads
from omni_common.errors import InvalidArgumentError


def _options(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_thread_options_default_to_openmps_own_and_are_checked_naming_the_option(monkeypatch):
    monkeypatch.delenv("OMNI_STAGE_THREADS", raising=False)
    monkeypatch.delenv("OMNI_OMP_WAIT_POLICY", raising=False)
    # auto: the cores less those reserved (code2wav workers, the other services), split between the
    # stage processes, at least one thread each
    got = {(stages, cores, reserved): stage_threads(_options(), stages, cores, reserved)[0]
           for stages, cores, reserved in ((1, 2, 2), (2, 2, 2), (2, 1, 2), (1, 4, 2), (2, 16, 3), (2, 64, 5))}
    assert got == {(1, 2, 2): 1, (2, 2, 2): 1, (2, 1, 2): 1, (1, 4, 2): 2, (2, 16, 3): 6, (2, 64, 5): 29}, got
    assert stage_threads(_options(), 1)[0] >= 1  # this host's cores
    assert stage_threads(_options())[1] == ""  # OpenMP's own wait policy
    assert stage_threads(_options("--stage-threads", "3", "--omp-wait-policy", "passive"), 2, 2) == (3, "passive")
    assert stage_threads(_options("--omp-wait-policy", "active"), 2, 6) == (2, "active")
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(InvalidArgumentError) as err:
            stage_threads(_options("--stage-threads", bad))
        assert err.value.field == "--stage-threads" and repr(bad) in str(err.value), str(err.value)
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        _options("--omp-wait-policy", "sleepy")
    monkeypatch.setenv("OMNI_STAGE_THREADS", "2")
    monkeypatch.setenv("OMNI_OMP_WAIT_POLICY", "passive")
    assert stage_threads(_options(), 2, 16) == (2, "passive")
    monkeypatch.setenv("OMNI_OMP_WAIT_POLICY", "Sleepy")
    with pytest.raises(InvalidArgumentError) as err:
        stage_threads(argparse.Namespace(stage_threads="auto", omp_wait_policy="Sleepy"))
    assert err.value.field == "--omp-wait-policy"


def _report_env(conn) -> None:  # noqa: ANN001
    conn.send({k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")})
    conn.close()


def _child_env(threads: int, policy: str) -> dict[str, str | None]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_report_env, args=(theirs,))
    start_with_threads(process, threads, policy)
    theirs.close()
    try:
        assert ours.poll(60), "the child said nothing"
        return ours.recv()
    finally:
        process.join(30)
        ours.close()


def test_a_spawned_process_starts_with_the_budget_and_ours_is_left_as_it_was(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _child_env(1, "passive") == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert _child_env(0, "") == {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None}
    assert "OMP_NUM_THREADS" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
    # the deployment's own environment wins over the options
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _child_env(1, "active") == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}
    assert os.environ["OMP_NUM_THREADS"] == "2" and "OMP_WAIT_POLICY" not in os.environ


def test_a_process_started_meanwhile_waits_until_the_variables_are_gone(monkeypatch):
    """Every spawned process starts under the same lock as the one whose
    variables are set for it: a code2wav worker started while a stage
    process starts never inherits the stage's OMP variables."""
    import threading

    from decoder_svc import spawned

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_report_env, args=(theirs,))
    with spawned._ENV_LOCK:  # as while a stage process starts with its variables set
        starter = threading.Thread(target=start_with_threads, args=(process, 0))
        starter.start()
        starter.join(0.5)
        assert starter.is_alive() and process.pid is None, "it started while another's variables were set"
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"  # what the other process's start has set meanwhile
        del os.environ["OMP_WAIT_POLICY"]  # and takes back before it lets go
    starter.join(60)
    theirs.close()
    try:
        assert process.pid is not None and ours.poll(60)
        assert ours.recv() == {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None}
    finally:
        process.join(30)
        ours.close()
