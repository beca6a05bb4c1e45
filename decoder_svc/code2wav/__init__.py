"""code2wav, the generation stage: codec frames in, audio chunks out, per request.

- :mod:`.chunking`: where chunks end (``chunk_boundaries``) and a request's
  chunk state (``ChunkState``);
- :mod:`.core`: the stream core shared by both variants below
  (``Code2WavCore``: ready chunks and which goes next; ``run_chunks``: the
  decode loop; the vocoder's worker spec);
- :mod:`.thread`: the variant on a thread of the decoder (``Code2WavWorker``);
- :mod:`.pool`: the variant in worker processes, parent side
  (``Code2WavProcessPool``), :mod:`.worker` the child side, :mod:`.messages`
  what crosses their pipes.

The vocoder itself comes from the model family (the checkpoint's Code2Wav:
``decoder_svc.qwen3_omni``) or the fake engine's test double.
"""
