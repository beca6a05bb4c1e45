"""Test session setup and fixtures shared by several test files."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import FakeDecoder, remove_dir, short_socket_dir

from omni_common import torchvision_compat

torchvision_compat.install()  # the torchvision shim, before transformers loads

# Engines in float32 (decoder_svc/engine_settings.py): dtype auto is bfloat16
# on processors that have it, and the parity checks compare float32 runs.
# Inherited by every service a test starts.
os.environ.setdefault("OMNI_ENGINE_SET", "dtype=float32")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short temporary directory for Unix sockets (removed afterwards)."""
    path = short_socket_dir()
    yield path
    remove_dir(path)


@pytest.fixture
def decoder(sock_dir: Path) -> Iterator[FakeDecoder]:
    """A fake decoder service (test double) on a Unix socket in sock_dir."""
    with FakeDecoder(sock_dir / "decoder.sock") as fake:
        yield fake


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny Qwen3-Omni checkpoint (seed 0), written once per session.

    What serves a model directory only reads it (tests that serve it check
    its tree is unchanged), so the tests that need this checkpoint as it is
    share one copy; a test that needs another (a seed, shards) writes its own."""
    from decoder_svc.qwen3_omni.tiny import create_tiny_checkpoint

    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt") / "qwen3-omni-tiny")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    """The tiny checkpoint, the torchvision shim installed first (the parity
    tests load transformers' reference beside it). Modules may define their own."""
    from tests.reference_model import with_shim

    return with_shim(tiny_checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' Qwen3-Omni-MoE on ``checkpoint`` in float32 (tests/reference_model.py)."""
    from tests.reference_model import load_reference

    return load_reference(checkpoint)


@pytest.fixture(scope="session")
def tts_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-TTS checkpoints (seed 0) of the three kinds, by kind, written once per session."""
    from decoder_svc.qwen3_tts.layout import KINDS
    from decoder_svc.qwen3_tts.tiny import create_tiny_checkpoint

    root = tmp_path_factory.mktemp("tts-ckpt")
    return {kind: create_tiny_checkpoint(root / kind, kind=kind) for kind in KINDS}
