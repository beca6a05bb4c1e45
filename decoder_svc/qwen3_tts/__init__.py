"""Qwen3-TTS (12 Hz): the text-to-speech family (layout, tiny checkpoints)."""
