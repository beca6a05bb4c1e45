"""The decoder's Prometheus series."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# 10 us .. 1 s: the step gap of an async stage is tens of microseconds; an
# inline build can take milliseconds.
_GAP_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
)

STEP_GAP = Histogram(
    "omni_decoder_step_gap_seconds",
    "Critical-path time between sampling a step and launching the next one",
    ["stage"],
    buckets=_GAP_BUCKETS,
)
STEP_TIME = Histogram(
    "omni_decoder_step_seconds", "Time of one decode step (forward + sample)", ["stage"],
    buckets=_GAP_BUCKETS,
)
CODE_PREDICTOR_TIME = Histogram(
    "omni_decoder_code_predictor_seconds",
    "Time the talker's code predictor took in one decode step (codebooks 1..G-1 of every row and their "
    "bookkeeping; host time, part of omni_decoder_step_seconds)",
    ["stage"],
    buckets=_GAP_BUCKETS,
)
STEPS = Counter("omni_decoder_steps_total", "Decode steps run", ["stage", "path"])
MATERIALIZER_LAG = Gauge(
    "omni_decoder_materializer_lag_steps", "Steps sent to the materializer and not yet answered"
)
SLOTS_IN_USE = Gauge("omni_decoder_arena_slots_in_use", "Shared-memory arena slots held")
FALLBACK_STEPS = Counter(
    "omni_decoder_fallback_steps_total",
    "Steps built in-process because the materializer could not",
    ["reason"],
)
MATERIALIZER_SWITCHES = Counter(
    "omni_decoder_materializer_switches_total",
    "Switches between the materializer stream (to_remote) and in-process building "
    "(to_in_process), by reason",
    ["direction", "reason"],
)
MATERIALIZER_MODE = Gauge(
    "omni_decoder_materializer_mode",
    "Where step payloads are built now: 1 for the current mode (remote or in_process)",
    ["mode"],
)
MATERIALIZER_INFO = Gauge(
    "omni_decoder_materializer_info",
    "The materializer instance the decoder streams to: 1 for the attached one (no series "
    "while building in-process)",
    ["instance_id", "implementation", "version", "contract_version", "transport"],
)
MATERIALIZER_ATTACHMENTS = Counter(
    "omni_decoder_materializer_attachments_total",
    "Streams attached to a materializer instance: after connecting (connect) or to the "
    "replacement of one that drains (handover)",
    ["kind"],
)
INTERNAL_ERRORS = Counter(
    "omni_decoder_internal_errors_total",
    "Exceptions caught on a decoder thread (the affected requests failed, the thread kept "
    "serving), by thread",
    ["where"],
)
PREEMPTIONS = Counter(
    "omni_decoder_preemptions_total",
    "Requests a stage's engine preempted to free KV cache for others (each is recomputed, "
    "prompt and tokens so far, when it resumes), by stage",
    ["stage"],
)
STEP_TOKENS = Histogram(
    "omni_decoder_step_tokens",
    "Tokens a stage's engine scheduled in one step (decode tokens and prompt tokens, whole prompts or "
    "chunks; at most the stage's max_num_batched_tokens), by stage",
    ["stage"],
    buckets=tuple(2.0**i for i in range(15)),
)
STAGE_THREADS = Gauge(
    "omni_decoder_stage_intra_op_threads",
    "Intra-op threads an AR stage's engine process runs its steps on, with its OMP_WAIT_POLICY "
    "(default: unset, OpenMP's own); set when the process is ready",
    ["stage", "omp_wait_policy"],
)
REQUESTS = Counter("omni_decoder_requests_total", "Requests that ended, by outcome", ["outcome"])
ACTIVE_REQUESTS = Gauge("omni_decoder_active_requests", "Requests running")


def attachment_labels(attachment) -> tuple[str, str, str, str, str]:
    """The MATERIALIZER_INFO labels of a decoder_svc.link.state.Attachment."""
    return (
        attachment.instance_id,
        attachment.implementation,
        attachment.version,
        str(attachment.contract_version),
        attachment.transport,
    )


def note_stage_threads(stage: str, engine_settings: dict) -> None:
    """STAGE_THREADS of a stage process that said its thread budget (its
    engine settings' intra_op_threads and omp_wait_policy)."""
    threads = engine_settings.get("intra_op_threads")
    if threads is not None:
        STAGE_THREADS.labels(stage, str(engine_settings.get("omp_wait_policy", "default"))).set(float(threads))


def set_mode(remote: bool) -> None:
    MATERIALIZER_MODE.labels("remote").set(1 if remote else 0)
    MATERIALIZER_MODE.labels("in_process").set(0 if remote else 1)
REPETITION_STOPS = Counter(
    "omni_decoder_repetition_stops_total",
    "Requests the runaway guard ended (their codec stream kept repeating one short cycle)",
)
CODE2WAV_WORKERS = Gauge(
    "omni_decoder_code2wav_workers",
    "code2wav worker processes running and ready (0 with the in-thread generation stage)",
)
CODE2WAV_RESTARTS = Counter(
    "omni_decoder_code2wav_worker_restarts_total",
    "code2wav worker processes that ended unasked and were restarted (their requests failed)",
)
STAGE_RESTARTS = Counter(
    "omni_decoder_stage_process_restarts_total",
    "Starts of an AR stage's engine process after it ended unasked (each attempt; its requests failed), by stage",
    ["stage"],
)
CODE2WAV_INLINE_FALLBACKS = Counter(
    "omni_decoder_code2wav_inline_fallbacks_total",
    "Codec frames sent to a code2wav worker as bytes in the message instead of an arena slot, "
    "by reason (no_slot: none free in time; too_large: more than a slot holds)",
    ["reason"],
)
CODE2WAV_QUEUE_CHUNKS = Gauge(
    "omni_decoder_code2wav_queue_chunks",
    "code2wav chunks ready (their frames arrived) and not yet decoded, all workers together",
)
FIRST_CHUNKS = Counter(
    "omni_decoder_first_chunks_total",
    "Requests whose audio started, by the codec frames of their first chunk (chosen by load or by the request)",
    ["frames"],
)
# 1 ms .. 10 s: idle, a first chunk waits for nothing; under load, for the
# chunks decoded before it
CODE2WAV_FIRST_CHUNK_WAIT = Histogram(
    "omni_decoder_code2wav_first_chunk_wait_seconds",
    "Time a request's first code2wav chunk waited: from the arrival of the frames that "
    "completed it at its worker to the start of its decode",
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
# set where the vocoder runs: on the decoder's thread, or in a code2wav worker
# process, whose series reach the decoder's /metrics labelled stage="code2wav"
# and worker="<index>" (decoder_svc.code2wav.pool)
CODE2WAV_CHUNK_SECONDS = Histogram(
    "omni_decoder_code2wav_chunk_seconds",
    "Time one vocoder call took: the next chunk of every request batched in it "
    "(omni_decoder_code2wav_batch_chunks)",
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CODE2WAV_HEAP_TRIMS = Counter(
    "omni_decoder_code2wav_heap_trims_total",
    "Times a code2wav worker handed its freed heap back to the OS (glibc malloc_trim) while waiting "
    "for work after decoding (at most every 2 s)",
)
CODE2WAV_BATCH_CHUNKS = Histogram(
    "omni_decoder_code2wav_batch_chunks",
    "Chunks (one per request) decoded together in one vocoder call",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
