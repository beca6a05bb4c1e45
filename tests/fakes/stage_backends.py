"""Test doubles of AR stage backends, built inside a stage process
(``StageHostSpec.fake_factory``). Not models."""

from __future__ import annotations

import time

from decoder_svc.backend import RequestSpec
from decoder_svc.testing.fake_engine import FakeBackend
from omni_common.errors import InvalidArgumentError

REFUSED_MARKER = "refuse-me"
TALKER_REFUSES_MARKER = "talker-refuses"


class RefusingFakeBackend(FakeBackend):
    """The fake engine, refusing prompts that contain REFUSED_MARKER (any
    stage) or TALKER_REFUSES_MARKER (the talker only), as an engine refuses a
    request it cannot take: InvalidArgumentError naming the field."""

    def add_request(self, spec: RequestSpec) -> None:
        if REFUSED_MARKER in spec.prompt or (self.role == "talker" and TALKER_REFUSES_MARKER in spec.prompt):
            raise InvalidArgumentError("prompt", f"this {self.role} refuses it")
        super().add_request(spec)




class SlowFakeBackend(FakeBackend):
    """The fake engine, each step taking at least `step_s` (a slow model)."""

    def __init__(self, *, step_s: float = 0.02, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step_s = step_s

    def step(self):
        out = super().step()
        if out is not None:
            time.sleep(self.step_s)
        return out


class FailingStepFakeBackend(SlowFakeBackend):
    """The slow fake engine whose `fail_step`-th step raises (once)."""

    def __init__(self, *, fail_step: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_step = fail_step
        self.steps = 0

    def step(self):
        out = super().step()
        if out is not None:
            self.steps += 1
            if self.steps == self.fail_step:
                raise RuntimeError("this step fails")
        return out


def failing_fake_backend(**kwargs):
    """A backend that cannot be built (a stage whose engine fails to start)."""
    raise RuntimeError("this engine cannot be built")
