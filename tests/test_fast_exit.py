"""omni_common.fast_exit: a service's fast way out keeps its exit status and its last words."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys
    from omni_common.fast_exit import run_service

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))

    def main():
        logging.getLogger("svc").info("stopped in order")
        print("last words", end="")  # buffered, no newline: flushed on the way out
        return {result}

    run_service(main)
""")


@pytest.mark.parametrize(("result", "status", "message"), [
    ("None", 0, ""), ("0", 0, ""), ("3", 3, ""), ("'decoder: bad flag'", 1, "decoder: bad flag"),
])
def test_run_service_keeps_the_status_and_flushes_logs_and_streams(result, status, message):
    run = subprocess.run([sys.executable, "-c", PROGRAM.format(result=result)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == status, run
    assert run.stdout == "last words", run
    assert "stopped in order" in run.stderr and message in run.stderr, run.stderr
    # the interpreter's own exit is skipped: atexit hooks do not run
    assert "atexit ran" not in run.stderr, run.stderr


def test_an_exception_takes_the_ordinary_way_out():
    program = textwrap.dedent("""
        from omni_common.fast_exit import run_service

        def main():
            raise SystemExit("decoder: the model directory is missing")

        run_service(main)
    """)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "the model directory is missing" in run.stderr, run


def test_multiprocessing_children_are_reaped_before_the_exit(tmp_path):
    """A child that is still ending (a tensor-parallel worker) is waited for;
    one that does not end within the wait is terminated, not left behind."""
    script = tmp_path / "service.py"  # a file: spawned children import their target from it
    script.write_text(textwrap.dedent("""
        import sys, time
        from omni_common import fast_exit

        def quick():
            time.sleep(0.5)
            print("quick child done", file=sys.stderr, flush=True)

        def stuck():
            time.sleep(600)

        if __name__ == "__main__":
            import multiprocessing

            fast_exit.CHILDREN_WAIT_S = 2.0
            ctx = multiprocessing.get_context("spawn")
            a, b = ctx.Process(target=quick), ctx.Process(target=stuck)
            a.start(); b.start()
            print(a.pid, b.pid, flush=True)
            fast_exit.exit_now(0)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run
    assert "quick child done" in run.stderr and "Traceback" not in run.stderr, run.stderr
    import psutil

    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2, run.stdout
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
