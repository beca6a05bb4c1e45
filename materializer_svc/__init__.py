"""materializer_svc: builds MultimodalPayload messages from step snapshots.

Implementations are chosen at the process entry point from a registry
(`--impl NAME`); any process that speaks MaterializerService can replace them.
"""
