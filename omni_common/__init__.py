"""Code shared by two or more omni-serving services.

Never imports vllm: the engine lives behind decoder_svc's `cpu`/`cuda` extras.
"""

from omni_common import torchvision_compat as _torchvision_compat

_torchvision_compat.install()
