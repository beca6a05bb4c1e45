"""Starting the AR stages' processes: ``stage_specs`` and ``launch_stages``.

One ``StageHostSpec`` per AR stage of a profile, and one ``StageProcess``
(``.proxy``) per spec, started side by side (the engines build at the same
time); the first that cannot start stops the others.
"""

from __future__ import annotations

import time
from typing import Any

from decoder_svc.profile import Profile
from decoder_svc.stage.messages import StageHostSpec
from decoder_svc.stage.proxy import StageProcess


def launch_stages(specs: list[StageHostSpec], *, start_timeout_s: float = 600.0,
                  one_by_one: bool = False) -> dict[str, StageProcess]:
    """Start one process per spec (the engines build side by side) and wait
    until all are ready; the first that cannot start stops the others, and
    its reason is raised (UnavailableError). `one_by_one`: each starts once
    the one before is ready (stages sharing a GPU: vLLM checks at start that
    the device's free memory covers the engine's share, which holds only
    once the engine before has taken its own)."""
    stages: dict[str, StageProcess] = {}
    deadline = time.monotonic() + start_timeout_s

    def wait_ready() -> None:
        while not all(s.ready for s in stages.values()):
            for stage in stages.values():
                if not stage.ready:
                    stage.check_start(deadline, start_timeout_s)
            time.sleep(0.1)

    try:
        for spec in specs:
            stage = StageProcess(spec, start_timeout_s=start_timeout_s)
            stages[spec.stage] = stage
            stage.launch()
            if one_by_one:
                wait_ready()
        wait_ready()
    except BaseException:
        for stage in stages.values():
            stage.stop()
        raise
    return stages


def stage_specs(profile: Profile, **common: Any) -> list[StageHostSpec]:
    """One spec per AR stage of the profile (`common`: the fields every
    stage shares, its thread budget included: decoder_svc.server.stage_threads)."""
    return [StageHostSpec(profile=profile, stage=s.name, **common) for s in profile.ar_stages]
