"""decoder_svc: runs a deploy profile's stages and streams request outputs.

AR stages run on an engine backend (a model family on vLLM by default:
``decoder_svc.families``; the fake engine of ``decoder_svc.testing`` as a
test double) and snapshot each decode step into the shared-memory arena; a
materializer builds the payloads off the critical path.
"""
