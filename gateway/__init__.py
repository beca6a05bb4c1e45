"""omni-serving gateway: the client-facing front of the stack.

Layout (one responsibility per module):

* `outputs` - `OmniRequestOutput` (the one, non-nested client output),
  `MultimodalPayload`, `EngineOutput`, `wrap_output`.
* `output_processor` - `OutputProcessor` / `RequestState`: decoder messages
  to per-request outputs, modality-agnostic, per-key accumulation strategies.
* `validation` - request checks, each error naming its field.
* `decoder_client` - the `DecoderService` channel, cached decoder info,
  decoder errors as shared exceptions.
* `health` - `DecoderMonitor`: periodic grpc.health.v1 checks of one decoder.
* `replicas` - several decoders: ``--decoder`` targets, DNS lookups,
  `ReplicaPool` (a client and a monitor per decoder, balancing, request →
  decoder tracking, per-decoder metrics, the gateway's health).
* `engine` - `GatewayEngine`: admission, decoder stream, processor,
  `Abort` on cancel; used by both front ends.
* `audio` - PCM16 conversion, Speak chunks, WAV headers.
* `servicer` - the thin gRPC `OmniGatewayService`.
* `http_facade` - OpenAI-compatible ``POST /v1/audio/speech`` on aiohttp.
* `metrics` - Prometheus collectors.
* `app` / `__main__` - process assembly and ``python -m gateway``.

See docs/gateway.md.
"""
