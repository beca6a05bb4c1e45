"""Code shared by two or more omni-serving services.

Knows no service and no engine: never imports vllm or a service package
(the engine lives behind decoder_svc's `cpu`/`cuda` extras), and has no
import side effects. The torchvision import shim
(:mod:`omni_common.torchvision_compat`) is installed explicitly where it is
needed: by the Qwen3-Omni family before transformers loads, by the decoder's
engine factory, and by the vLLM plugin in every engine process.
"""
