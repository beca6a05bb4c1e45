"""Test session setup."""

import omni_common  # noqa: F401 -- the torchvision import shim, before any test imports transformers
