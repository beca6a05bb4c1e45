"""The decoder's AR stages under a liveness watchdog (``omni_common.liveness``).

``watch_stages`` puts every AR stage of a pipeline, and the dispatch loop
of every materializer link (``link:<name>``: steps waiting to go out), under
one ``Watchdog``:

- a stage in a process of its own (``.proxy.StageProcess``): its progress
  follows the turn count its process reports; stuck, the process is killed
  (``StageProcess.kill_stuck``), its requests end with UNAVAILABLE naming the
  stall, and it is started again as after a crash;
- a stage whose decode loop runs in this process (``.runner.StageRunner``):
  nothing can restart a thread, so its requests (every running request of
  the pipeline: a stuck stage holds up the stages after it) end with
  UNAVAILABLE naming the stall, and the service reports itself not ready
  (the watchdog's verdict) until the loop moves again, not live past the
  grace (the supervisor or Kubernetes restarts it).
- a link's dispatch loop is judged like its stage's decode loop: in a stage
  process (its count reported in the process's ``Status``) the process is
  killed and restarted; in this process the running requests are failed
  and the decoder reports not ready, not live past the grace.

The requests are failed on a thread of their own: aborting them reaches the
backends, one of which may be the part that wedged; the watchdog keeps
looking meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from decoder_svc.stage.proxy import StageProcess
from omni_common.errors import UnavailableError
from omni_common.liveness import Progress, Watchdog

if TYPE_CHECKING:
    from decoder_svc.pipeline import Pipeline

logger = logging.getLogger(__name__)


def watch_stages(pipeline: Pipeline, watchdog: Watchdog) -> list[Progress]:
    """Watch every AR stage of `pipeline`, and the dispatch loop of every
    materializer link, with `watchdog`; the parts watched."""
    parts = []
    for runner in pipeline.runners.values():
        if isinstance(runner, StageProcess):
            loops = [runner.progress, runner.link_progress]
            runner.progress.on_stuck = _kill(runner, watchdog, "decode loop")
            runner.link_progress.on_stuck = _kill(runner, watchdog, "materializer link")
        else:
            loops = [runner.progress]
            runner.progress.on_stuck = _fail_running(pipeline, watchdog)
        parts += [watchdog.watch(p) for p in loops]
    if pipeline.link is not None:  # the link of the stages in this process
        pipeline.link.progress.on_stuck = _fail_running(pipeline, watchdog)
        parts.append(watchdog.watch(pipeline.link.progress))
    return parts


def _kill(stage: StageProcess, watchdog: Watchdog, loop: str):
    def on_stuck(progress: Progress, seconds: float) -> None:
        stage.kill_stuck(seconds, watchdog.limit_s(progress), loop)

    return on_stuck


def _fail_running(pipeline: Pipeline, watchdog: Watchdog):
    def on_stuck(progress: Progress, seconds: float) -> None:
        error = UnavailableError(f"{progress.name} made no progress for {seconds:.1f} s with work waiting "
                                 f"(limit {watchdog.limit_s(progress):.1f} s); the request was ended")
        ids = pipeline.requests.ids()
        logger.error("%s is stuck in this process: failing its %d request(s); the decoder reports not ready",
                     progress.name, len(ids))
        threading.Thread(target=pipeline._fail_requests, args=(ids, error),
                         name=f"{progress.name}-stuck", daemon=True).start()

    return on_stuck
