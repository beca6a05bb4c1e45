"""Test doubles and stand-in checkpoints: never imported by the service unless asked.

- :mod:`.fake_engine`: the fake engine (``FakeBackend``, the fake vocoder):
  a deterministic test double where the model goes, served by
  ``--engine fake`` (chosen at the decoder's entry point, imported then);
- :mod:`.fake_family`: the fake engine as an entry of the model-family
  registry (``decoder_svc.families``);
- :mod:`.standin_models`: tiny random-weight Qwen3 checkpoints (the
  runner-hook and backend tests, the step-gap benchmark);
- :mod:`.standin_backend`: ``StandinBackend``, the generic vLLM backend on
  such a checkpoint;
- :mod:`.standin_profiles`: stand-in checkpoints and backends for a deploy
  profile.

The served model is Qwen3-Omni (``decoder_svc.qwen3_omni``).
"""
