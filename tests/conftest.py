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
