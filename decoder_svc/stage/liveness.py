"""The decoder's stages under a liveness watchdog (``omni_common.liveness``).

``watch_stages`` puts every AR stage of a pipeline, the dispatch loop of
every materializer link (``link:<name>``: steps waiting to go out), and each
code2wav worker process, under one ``Watchdog``:

- a stage in a process of its own (``.proxy.StageProcess``): its progress
  follows the turn count its process reports; stuck, the process is killed
  (``StageProcess.kill_stuck``), its requests end with UNAVAILABLE naming the
  stall, and it is started again as after a crash;
- a stage whose decode loop runs in this process (``.runner.StageRunner``):
  nothing can restart a thread, so its requests (every running request of
  the pipeline: a stuck stage holds up the stages after it) end with
  UNAVAILABLE naming the stall, and the service reports itself not ready
  (the watchdog's verdict) until the loop moves again, not live past the
  grace (the supervisor or Kubernetes restarts it);
- a link's dispatch loop is judged like its stage's decode loop: in a stage
  process (its count reported in the process's ``Status``) the process is
  killed and restarted; in this process the running requests are failed
  and the decoder reports not ready, not live past the grace;
- a code2wav worker process (``decoder_svc.code2wav.pool``, part
  ``code2wav:<index>``): its progress follows the chunks its decode loop
  reports; stuck, the process is killed (``Code2WavProcessPool.kill_stuck``),
  the requests pinned to it end with UNAVAILABLE naming the stall, and it is
  started again as after a crash;
- code2wav on a thread of the decoder (``decoder_svc.code2wav.thread``, part
  ``code2wav``): like a decode loop in this process, its stall fails the
  running requests and the decoder reports not ready, not live past the
  grace.

Both kinds of child process are killed the same way (``_kill``: the part's
``kill_stuck(seconds, limit_s)``).

The requests are failed on a thread of their own: aborting them reaches the
backends, one of which may be the part that wedged; the watchdog keeps
looking meanwhile.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from decoder_svc.code2wav.pool import Code2WavProcessPool
from decoder_svc.code2wav.thread import Code2WavWorker
from decoder_svc.stage.proxy import StageProcess
from omni_common.errors import UnavailableError
from omni_common.liveness import Progress, Watchdog, no_progress

if TYPE_CHECKING:
    from decoder_svc.pipeline import Pipeline

logger = logging.getLogger(__name__)


def watch_stages(pipeline: Pipeline, watchdog: Watchdog) -> list[Progress]:
    """Watch every AR stage of `pipeline`, the dispatch loop of every
    materializer link, and its code2wav (worker processes, or its thread)
    with `watchdog`; the parts watched."""
    parts = []
    for runner in pipeline.runners.values():
        if isinstance(runner, StageProcess):
            loops = [runner.progress, runner.link_progress]
            runner.progress.on_stuck = _kill(
                functools.partial(runner.kill_stuck, loop="decode loop"), watchdog)
            runner.link_progress.on_stuck = _kill(
                functools.partial(runner.kill_stuck, loop="materializer link"), watchdog)
        else:
            loops = [runner.progress]
            runner.progress.on_stuck = _fail_running(pipeline, watchdog)
        parts += [watchdog.watch(p) for p in loops]
    if pipeline.link is not None:  # the link of the stages in this process
        pipeline.link.progress.on_stuck = _fail_running(pipeline, watchdog)
        parts.append(watchdog.watch(pipeline.link.progress))
    code2wav = pipeline.code2wav
    if isinstance(code2wav, Code2WavProcessPool):
        for index, progress in enumerate(code2wav.progress):
            progress.on_stuck = _kill(functools.partial(code2wav.kill_stuck, index), watchdog)
            parts.append(watchdog.watch(progress))
    elif isinstance(code2wav, Code2WavWorker):
        code2wav.progress.on_stuck = _fail_running(pipeline, watchdog)
        parts.append(watchdog.watch(code2wav.progress))
    return parts


def _kill(kill_stuck: Callable[[float, float], None], watchdog: Watchdog):
    """on_stuck for a part in a child process: its `kill_stuck(seconds, limit_s)`
    kills the process; its owner fails its requests and starts it again."""
    def on_stuck(progress: Progress, seconds: float) -> None:
        kill_stuck(seconds, watchdog.limit_s(progress))

    return on_stuck


def _fail_running(pipeline: Pipeline, watchdog: Watchdog):
    def on_stuck(progress: Progress, seconds: float) -> None:
        error = UnavailableError(f"{progress.name} {no_progress(seconds, watchdog.limit_s(progress))}; "
                                 "the request was ended")
        ids = pipeline.requests.ids()
        logger.error("%s is stuck in this process: failing its %d request(s); the decoder reports not ready",
                     progress.name, len(ids))
        threading.Thread(target=pipeline._fail_requests, args=(ids, error),
                         name=f"{progress.name}-stuck", daemon=True).start()

    return on_stuck
