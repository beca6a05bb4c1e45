"""``StandinBackend``: the generic vLLM backend on a stand-in checkpoint (tiny random Qwen3).

A :class:`decoder_svc.vllm_engine.backend.VLLMBackend` whose model-specific
parts come from a checkpoint written by :func:`.standin_models.create_model`:
its facts from ``omni_stage.json`` and, for a talker, a linear code
predictor (``code_predictor.safetensors``: one matmul per step fills
codebooks 1..K-1 from the last hidden row). The runner-hook and backend
tests, the stand-in profiles (:mod:`.standin_profiles`) and the step-gap
benchmark use it; the service never does.
"""

from __future__ import annotations

import torch

from decoder_svc.vllm_engine.backend import VLLMBackend
from decoder_svc.vllm_engine.capture import StepCapture
from omni_common.errors import InvalidArgumentError

from .standin_models import load_code_predictor, read_stage_config


class StandinBackend(VLLMBackend):
    """VLLMBackend on a stand-in checkpoint (module docstring)."""

    def _configure(self, role: str | None) -> None:
        """Model facts from the ``omni_stage.json`` of the stand-in checkpoint."""
        stage = read_stage_config(self.model_dir)
        self.engine_dir = self.model_dir
        self.role = role or stage["kind"]
        self.hidden_size = int(stage["hidden_size"])
        self.vocab_size = int(stage["vocab_size"])
        self.eos_token_id = int(stage["eos_token_id"])
        self.num_codebooks = int(stage.get("num_codebooks", 1))
        self.codec_vocab = int(stage.get("codec_vocab_size", self.vocab_size))
        # code predictor [K-1, V, H] -> [(K-1) * V, H] for one matmul per step
        self._cp_weight: torch.Tensor | None = None
        if self.role == "talker" and self.num_codebooks > 1:
            cp = load_code_predictor(self.model_dir).to(torch.float32)
            k1, v, h = cp.shape
            if (k1, v, h) != (self.num_codebooks - 1, self.codec_vocab, self.hidden_size):
                raise InvalidArgumentError(
                    "model_dir",
                    f"code predictor shape {tuple(cp.shape)} does not match omni_stage.json",
                )
            self._cp_weight = cp.reshape(k1 * v, h).contiguous()

    def _codes(self, cap: StepCapture, row_ok: torch.Tensor) -> torch.Tensor:
        """Talker: all codebooks of the frame each row sampled, [n, K] int64
        on the runner's device, from the sampler's own ids (``row_ok``: on
        the device; every row is predicted, the caller keeps the valid ones)."""
        last = cap.last_hidden_per_request()  # [n, H], device
        n, dev = last.shape[0], last.device
        codes = torch.empty((n, self.num_codebooks), dtype=torch.int64, device=dev)
        codes[:, 0] = cap.sampled_token_ids[:, 0]
        if self._cp_weight is not None:
            w = self._cp_weight
            if w.device != dev:  # loaded on the host; moved to the runner's device once
                self._cp_weight = w = w.to(dev)
            logits = (last.to(w.dtype) @ w.T).view(n, self.num_codebooks - 1, self.codec_vocab)
            codes[:, 1:] = logits.argmax(-1)
        return codes
