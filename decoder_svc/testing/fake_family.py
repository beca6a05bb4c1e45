"""The fake engine as a model family (``decoder_svc.families``): ``--engine fake``.

Not a model: ``FakeBackend`` per AR stage and the fake vocoder (``.fake_engine``),
in this process or in stage processes. A stage process builds its backend
from ``StageHostSpec.fake_factory`` (default ``FakeBackend``) and
``fake_kwargs`` (tests and benchmarks swap in their own doubles).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from decoder_svc.families import EngineParts
from decoder_svc.profile import Profile
from decoder_svc.spawned import call_factory

from .fake_engine import FakeBackend, fake_vocoder

DEFAULT_FACTORY = "decoder_svc.testing.fake_engine:FakeBackend"


def build_engine(
    profile: Profile, model: str, *, max_num_seqs: int, launch: Callable[[str], dict[str, Any]] | None = None,
    code2wav_workers: int = 0, voice_dir: str = "",
) -> EngineParts:
    if launch is not None:
        backends = launch("")
    else:
        backends = {
            s.name: FakeBackend(role=s.engine_role or s.name, max_num_seqs=max_num_seqs or s.engine.max_num_seqs)
            for s in profile.ar_stages
        }
    return EngineParts(backends, fake_vocoder(profile, backends[profile.ar_stages[-1].name]))


def build_stage_backend(spec):
    """One AR stage's fake backend (a stage process's; ``spec``: its StageHostSpec)."""
    config = spec.config
    kwargs = {"role": config.engine_role or config.name, "max_num_seqs": spec.max_num_seqs or config.engine.max_num_seqs, **spec.fake_kwargs}
    return call_factory(spec.fake_factory or DEFAULT_FACTORY, kwargs, "fake_factory")
