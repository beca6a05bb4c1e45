"""decoder_svc entry point: `python -m decoder_svc` / `omni-serving decoder`.

Health: the server as a whole ("") and ``SERVICE_NAME`` report readiness;
``omni_common.liveness.LIVENESS_SERVICE`` reports liveness. A watchdog
(``--stall-after-s``, ``--liveness-grace-s``; ``decoder_svc.stage.liveness``)
judges every AR stage's decode loop, and every materializer link's dispatch
loop, by its progress: a stuck part makes the decoder not ready
(NOT_SERVING) until it moves again or is restarted, and so does a stage
process being restarted; stuck past the grace, the liveness entry goes
NOT_SERVING (restart me). ``GetDecoderInfo.stuck_parts`` names those parts
(``omni_common.liveness_health.HealthFromWatchdog`` turns the verdicts into
health).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import grpc

from decoder_svc import families, lengths
from decoder_svc.engine_settings import ENV_VAR, check_placement, parse_overrides, share_a_device
from decoder_svc.engine_settings import KEYS as ENGINE_KEYS
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import available_profiles, load_profile
from decoder_svc.servicer import DecoderServicer
from decoder_svc.stage.liveness import watch_stages
from omni_common.errors import InvalidArgumentError, OmniError
from omni_common.liveness import DEFAULT_FACTOR, LIVENESS_SERVICE, StallLimits, Watchdog
from omni_common.liveness_health import HealthFromWatchdog
from omni_common.logging_setup import setup_logging
from omni_common.metrics import start_metrics_server
from omni_common.metrics_forward import FORWARDED, MergedRegistry
from omni_common.server import ServerConfig, serve
from omni_common.shm_arena import ShmArena, sweep_stale
from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc

logger = logging.getLogger("decoder_svc")
SERVICE_NAME = decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name
# At shutdown, how long running requests may go on before their streams end
# with UNAVAILABLE.
DRAIN_S = 2.0
# At start, how long the decoder waits for its code2wav workers (their
# vocoders built) before it serves anyway (their requests' audio then waits).
CODE2WAV_READY_S = 120.0


def shm_prefix_for(deployment: str) -> str:
    return f"omni-{deployment}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=os.environ.get("OMNI_DECODER_LISTEN", "unix:///tmp/omni-serving/decoder.sock"),
                   help="address to serve on: unix:///path.sock or host:port")
    p.add_argument("--materializer", default=os.environ.get("OMNI_MATERIALIZER_TARGET", ""),
                   help="materializer target (unix:///path.sock); empty = build payloads in-process")
    p.add_argument("--deployment", default=os.environ.get("OMNI_DEPLOYMENT", "default"),
                   help="deployment name; shared-memory segments are named omni-<deployment>-*")
    p.add_argument("--profile", default=os.environ.get("OMNI_PROFILE", "auto"),
                   help=f"deploy profile: one of {available_profiles()}, a YAML path, or auto (the model's "
                        "own: omni for Qwen3-Omni, tts for Qwen3-TTS)")
    p.add_argument("--engine", choices=("vllm", "fake", "reference"), default=os.environ.get("OMNI_ENGINE", "vllm"),
                   help="vllm (default: the model) or fake (a deterministic test double, not a model; "
                        "'reference' is its deprecated name)")
    p.add_argument("--model", default=os.environ.get("OMNI_MODEL", ""),
                   help="a Qwen3-Omni-MoE or Qwen3-TTS checkpoint directory (vllm engine; read only); "
                        "default: a tiny random-weight Qwen3-Omni, created in the model cache on first run")
    p.add_argument("--voice-dir", default=os.environ.get("OMNI_VOICE_DIR", ""),
                   help="the voice registry's directory (a voice-clone model's registered voices; never inside "
                        "the model's directory; several replicas may share it); default: voices/ in the model cache")
    p.add_argument("--arena-slots", type=int, default=int(os.environ.get("OMNI_ARENA_SLOTS", "16")),
                   help="shared-memory slots (max steps in flight to the materializer)")
    p.add_argument("--arena-slot-bytes", type=int, default=int(os.environ.get("OMNI_ARENA_SLOT_BYTES", str(4 * 2**20))),
                   help="bytes per slot (one step's routed tensors)")
    p.add_argument("--inline-transport", action="store_true", help="send tensors as bytes instead of shm handles")
    p.add_argument("--materializer-stall-timeout-s", type=float,
                   default=_env_float("OMNI_MATERIALIZER_STALL_TIMEOUT_S", 3.0),
                   help="the materializer is dropped (payloads built in-process, reconnecting in the "
                        "background) when it leaves steps unanswered this long or falls this far behind "
                        "(default 3)")
    p.add_argument("--in-process-builder", action="store_true",
                   help="without --materializer: build payloads on a background thread (the in-process baseline)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="max requests per decode step, every AR stage (the same as --engine-set max_num_seqs=N; "
                        "default: the profile's engine settings, 64)")
    p.add_argument("--engine-set", action="append", default=[], metavar="[STAGE.]KEY=VALUE",
                   help="an engine setting of one AR stage (STAGE.KEY) or of every one (KEY), over the profile's "
                        f"and ${ENV_VAR}'s (comma-separated items); repeatable. Keys: {', '.join(ENGINE_KEYS)} "
                        "(docs/profiles.md, \"Engine settings\")")
    p.add_argument("--default-audio-seconds", type=float,
                   default=_env_float("OMNI_DEFAULT_AUDIO_SECONDS"),
                   help=f"audio cap of a request that sets no max_audio_seconds "
                        f"(default {lengths.DEFAULT_AUDIO_SECONDS:g}, at most --max-audio-seconds)")
    p.add_argument("--max-audio-seconds", type=float, default=_env_float("OMNI_MAX_AUDIO_SECONDS"),
                   help="largest max_audio_seconds a request may ask for (default: what the talker's "
                        f"context holds, at most {lengths.MAX_AUDIO_SECONDS_CEILING:g}; never beyond the context)")
    p.add_argument("--default-text-tokens", type=int, default=_env_int("OMNI_DEFAULT_TEXT_TOKENS"),
                   help=f"text tokens of a request that sets no max_tokens (profiles with a thinker; "
                        f"default {lengths.DEFAULT_TEXT_TOKENS}, within the thinker's context)")
    p.add_argument("--max-input-audio-parts", type=int,
                   default=_env_int("OMNI_MAX_INPUT_AUDIO_PARTS", lengths.DEFAULT_INPUT_AUDIO_PARTS),
                   help="audio parts a request's messages may carry, where the first stage reads audio "
                        f"(0 = no audio input; default {lengths.DEFAULT_INPUT_AUDIO_PARTS})")
    p.add_argument("--max-input-audio-seconds", type=float,
                   default=_env_float("OMNI_MAX_INPUT_AUDIO_SECONDS", lengths.DEFAULT_INPUT_AUDIO_SECONDS),
                   help=f"longest audio part accepted, in seconds (default {lengths.DEFAULT_INPUT_AUDIO_SECONDS:g})")
    p.add_argument("--max-input-image-parts", type=int,
                   default=_env_int("OMNI_MAX_INPUT_IMAGE_PARTS", lengths.DEFAULT_INPUT_IMAGE_PARTS),
                   help="image parts a request's messages may carry, where the first stage reads images "
                        f"(0 = no image input; default {lengths.DEFAULT_INPUT_IMAGE_PARTS})")
    p.add_argument("--max-input-image-pixels", type=int,
                   default=_env_int("OMNI_MAX_INPUT_IMAGE_PIXELS", lengths.DEFAULT_INPUT_IMAGE_PIXELS),
                   help=f"most pixels of an image part as sent (default {lengths.DEFAULT_INPUT_IMAGE_PIXELS})")
    p.add_argument("--repetition-window-s", type=float,
                   default=_env_float("OMNI_REPETITION_WINDOW_S", lengths.DEFAULT_REPETITION_WINDOW_S),
                   help="runaway guard: end a request whose last this-many seconds of codec frames are one "
                        "short cycle repeated (finish reason 'repetition'); 0 = off "
                        f"(default {lengths.DEFAULT_REPETITION_WINDOW_S:g})")
    p.add_argument("--repetition-max-period", type=int,
                   default=_env_int("OMNI_REPETITION_MAX_PERIOD", lengths.DEFAULT_REPETITION_MAX_PERIOD),
                   help="runaway guard: the longest cycle, in codec frames, that counts as a loop "
                        f"(default {lengths.DEFAULT_REPETITION_MAX_PERIOD})")
    p.add_argument("--code2wav-workers", default=os.environ.get("OMNI_CODE2WAV_WORKERS", "auto"),
                   help="code2wav (the vocoder) in this many worker processes; 0 = on a thread of the "
                        "decoder; auto = one per 8 cores this process may use, 1 to 4 (default auto)")
    p.add_argument("--stage-processes", choices=("auto", "on", "off"),
                   default=os.environ.get("OMNI_STAGE_PROCESSES", "auto"),
                   help="run each AR stage's engine in a process of its own (engines side by side, the "
                        "decode loops off this process's interpreter); auto = on with the vllm engine, "
                        "off with the fake one (default auto)")
    p.add_argument("--stage-threads", default=os.environ.get("OMNI_STAGE_THREADS", "auto"),
                   help="intra-op threads of each AR stage's engine process (OMP_NUM_THREADS at its "
                        "start; an OMP_NUM_THREADS of this process's environment wins); auto = the CPUs this "
                        "process may use, less one per code2wav worker and one for the other services, split "
                        "between the stage processes, at least 1 each (default auto; docs/decoder.md, 'Threads')")
    p.add_argument("--omp-wait-policy", choices=("auto", "passive", "active"),
                   default=os.environ.get("OMNI_OMP_WAIT_POLICY", "auto"),
                   help="OMP_WAIT_POLICY of each AR stage's engine process: passive = an idle OpenMP "
                        "thread sleeps at once, active = it spins; auto = OpenMP's default (spin a while, "
                        "then sleep) (default auto; docs/decoder.md, 'Threads')")
    p.add_argument("--stall-after-s", type=float, default=_env_float("OMNI_STALL_AFTER_S", 30.0),
                   help="a decode loop with work waiting that makes no progress for this long (or for "
                        f"{DEFAULT_FACTOR:g} of its recent steps, if longer) is stuck: a stage process is "
                        "restarted, a loop in this process fails its requests and the decoder reports not "
                        "ready (default 30)")
    p.add_argument("--liveness-grace-s", type=float, default=_env_float("OMNI_LIVENESS_GRACE_S", 120.0),
                   help=f"a part stuck this long makes the health entry {LIVENESS_SERVICE!r} NOT_SERVING "
                        "(the supervisor restarts the decoder); at least --stall-after-s (default 120)")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("OMNI_DECODER_METRICS_PORT", "-1")),
                   help="serve Prometheus /metrics on this port (0 = any free port, -1 = off)")
    p.add_argument("--metrics-host", default=os.environ.get("OMNI_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--log-level", default=os.environ.get("OMNI_LOG_LEVEL", "INFO"))


def _env_float(name: str, default: float | None = None) -> float | None:
    raw = os.environ.get(name, "")
    return float(raw) if raw else default


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw else default


def length_options(args: argparse.Namespace) -> lengths.Options:
    return lengths.Options(
        default_audio_seconds=args.default_audio_seconds,
        max_audio_seconds=args.max_audio_seconds,
        default_text_tokens=args.default_text_tokens,
        repetition_window_s=args.repetition_window_s,
        repetition_max_period=args.repetition_max_period,
        max_input_audio_parts=args.max_input_audio_parts,
        max_input_audio_seconds=args.max_input_audio_seconds,
        max_input_image_parts=args.max_input_image_parts,
        max_input_image_pixels=args.max_input_image_pixels,
    )


def stall_limits(args: argparse.Namespace) -> StallLimits:
    """The watchdog's limits from the options (InvalidArgumentError naming the option)."""
    try:
        return StallLimits(floor_s=args.stall_after_s, factor=DEFAULT_FACTOR, grace_s=args.liveness_grace_s)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"--{exc.field.replace('_', '-')}", str(exc).split(": ", 1)[-1]) from exc


def materializer_stall_timeout(args: argparse.Namespace) -> float:
    """--materializer-stall-timeout-s (InvalidArgumentError naming the option)."""
    value = args.materializer_stall_timeout_s
    if not value > 0:
        raise InvalidArgumentError("--materializer-stall-timeout-s", f"must be > 0 seconds, got {value}")
    return value


def code2wav_workers(args: argparse.Namespace, cores: int | None = None) -> int:
    """--code2wav-workers: an integer >= 0, or auto (one worker per 8 of the
    cores this process may run on, at least 1 and at most 4: each worker's
    torch runs one thread, and the AR stages keep the rest); an
    InvalidArgumentError names the option."""
    raw = str(args.code2wav_workers).strip()
    if raw == "auto":
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(4, cores // 8))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgumentError("--code2wav-workers", f"must be auto or an integer >= 0, got {raw!r}")
    return value


def stage_threads(args: argparse.Namespace, stages: int = 1, cores: int | None = None,
                  reserved: int = 1) -> tuple[int, str]:
    """(OMP_NUM_THREADS, OMP_WAIT_POLICY) for each of `stages` stage
    processes, from --stage-threads and --omp-wait-policy ("": OpenMP's
    default policy). --stage-threads auto: the cores this process may run on,
    less `reserved` (one per code2wav worker, and one for this process, the
    materializer and the gateway), split between the stage processes, at
    least one thread each. Measured on a 2-core host (bench threads), one
    thread per stage process beat every core per process for both shipped
    profiles (docs/decoder.md "Threads"). An InvalidArgumentError names the
    option."""
    raw = str(getattr(args, "stage_threads", "auto")).strip()
    if raw == "auto":
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, (cores - reserved) // max(1, stages))
    else:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise InvalidArgumentError("--stage-threads", f"must be auto or an integer >= 1, got {raw!r}")
    policy = str(getattr(args, "omp_wait_policy", "auto")).strip().lower()
    if policy not in ("auto", "passive", "active"):
        raise InvalidArgumentError("--omp-wait-policy", f"must be auto, passive or active, got {policy!r}")
    return threads, "" if policy == "auto" else policy


def deployed_profile(args: argparse.Namespace):
    """The profile with the deployment's engine settings: ``OMNI_ENGINE_SET``
    (applied by load_profile), then ``--max-num-seqs`` and ``--engine-set``."""
    items = [f"max_num_seqs={args.max_num_seqs}"] if args.max_num_seqs is not None else []
    items += list(args.engine_set)
    name = args.profile
    if name == "auto":
        name = families.family_for(args.engine, args.model).default_profile
    profile = load_profile(name).with_engine_overrides(parse_overrides(items, "--engine-set"), "--engine-set")
    check_placement([(s.name, s.engine, s.tensor_parallel_size) for s in profile.ar_stages],
                    own_processes=stage_processes_on(args))
    return profile


def stage_processes_on(args: argparse.Namespace) -> bool:
    mode = getattr(args, "stage_processes", "off")
    return mode == "on" or (mode == "auto" and args.engine == "vllm")


def _launch_stage_processes(args: argparse.Namespace, profile, model: str) -> dict:
    """One engine process per AR stage (decoder_svc.stage), ready."""
    from decoder_svc.stage.launch import launch_stages, stage_specs

    threads, wait_policy = stage_threads(args, len(profile.ar_stages), reserved=code2wav_workers(args) + 1)
    specs = stage_specs(
        profile,
        torch_threads=threads,
        omp_wait_policy=wait_policy,
        engine="fake" if args.engine in ("fake", "reference") else "vllm",
        model=model,
        shm_prefix=shm_prefix_for(args.deployment),
        arena_slots=args.arena_slots,
        arena_slot_bytes=args.arena_slot_bytes,
        materializer_target=args.materializer or "",
        inline_transport=args.inline_transport,
        in_process_builder=args.in_process_builder,
        stall_timeout_s=args.materializer_stall_timeout_s,
        log_level=args.log_level,
    )
    one_by_one = False
    if args.engine == "vllm" and len(specs) > 1:
        from decoder_svc.vllm_engine.engine_factory import engine_platform

        one_by_one = share_a_device([s.engine.device for s in profile.ar_stages], engine_platform())
    try:
        return launch_stages(specs, one_by_one=one_by_one)
    except OmniError as exc:
        logger.error("cannot start the AR stages: %s", exc)
        raise SystemExit(f"decoder: {exc}") from exc


def build_engine(args: argparse.Namespace, profile) -> tuple[dict, dict]:
    """(backends by stage name, extra Pipeline arguments: vocoder, prepare, voice_store).

    The model family (``decoder_svc.families``) comes from ``--engine`` and
    the checkpoint's config. With stage processes the backends are
    ``StageProcess`` es (each engine built in its own process) and this
    process opens the checkpoint only for the vocoder and the prompts."""
    if args.engine == "reference":
        logger.warning("--engine reference is a deprecated name of --engine fake (the test double)")
    family = families.family_for(args.engine, args.model)
    try:
        impl = family.load()
    except ImportError as exc:  # the `cpu`/`cuda` extra is not installed
        raise SystemExit(f"--engine vllm needs vLLM (pip install 'omni-serving[cpu]'): {exc}") from exc
    launch = None
    if stage_processes_on(args):
        def launch(model: str) -> dict:
            return _launch_stage_processes(args, profile, model)
    try:
        parts = impl.build_engine(profile, args.model, max_num_seqs=None, launch=launch,
                                  code2wav_workers=code2wav_workers(args), voice_dir=args.voice_dir)
    except families.UnservableModel as exc:
        logger.error("cannot serve the model: %s", exc)
        raise SystemExit(f"decoder: cannot serve the model: {exc}") from exc
    return parts.backends, {"vocoder": parts.vocoder, "prepare": parts.prepare, "voice_store": parts.voices}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decoder_svc", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, service="decoder")
    try:
        limits = stall_limits(args)
        materializer_stall_timeout(args)
        workers = code2wav_workers(args)
        stage_threads(args)
        profile = deployed_profile(args)
    except InvalidArgumentError as exc:
        raise SystemExit(f"decoder: {exc}") from exc
    # its own series and its stage processes' (decoder_svc.stage.proxy forwards them)
    start_metrics_server(args.metrics_port, args.metrics_host, MergedRegistry(FORWARDED))
    prefix = shm_prefix_for(args.deployment)
    sweep_stale(prefix)
    # the step arena: this process's, unless each stage process has its own
    arena = None if stage_processes_on(args) else ShmArena(prefix, args.arena_slots, args.arena_slot_bytes)
    try:
        backends, engine_parts = build_engine(args, profile)
        try:
            pipeline = Pipeline(
                profile,
                backends,
                **engine_parts,
                options=length_options(args),
                materializer_target=args.materializer or None,
                shm_prefix=prefix,
                arena=arena,
                inline_transport=args.inline_transport,
                in_process_builder=args.in_process_builder,
                stall_timeout_s=args.materializer_stall_timeout_s,
                code2wav_workers=workers,
            )
        except InvalidArgumentError as exc:
            for backend in backends.values():
                backend.close()
            raise SystemExit(f"decoder: {exc}") from exc
        pipeline.start()
        # SERVING once the first request can be served at speed: its audio
        # would otherwise wait for a code2wav worker still starting
        if not pipeline.wait_ready(CODE2WAV_READY_S):
            logger.warning("code2wav workers not ready after %.0f s: serving; audio waits for them", CODE2WAV_READY_S)
        config = ServerConfig(address=args.listen, service_name=SERVICE_NAME,
                              reflection_service_names=[SERVICE_NAME])
        health = HealthFromWatchdog(config.health_names, log=logger)
        watchdog = health.bind(Watchdog(limits, name="decoder-watchdog"))
        watch_stages(pipeline, watchdog)
        watchdog.start()
        servicer = DecoderServicer(pipeline, engine=args.engine, materializer_target=args.materializer,
                                   watchdog=watchdog)

        def register(server: grpc.aio.Server) -> None:
            decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server)
            # At shutdown (SIGTERM/SIGINT) the server's grace period would keep
            # Generate streams open until it ran out and then cancel them
            # without a word. Instead: running requests get DRAIN_S to finish,
            # the rest end with UNAVAILABLE ("shutting down"), then the server stops.
            stop = server.stop

            async def drain_then_stop(grace: float | None) -> None:
                await servicer.drain(min(DRAIN_S, grace or 0.0))
                await stop(grace)

            server.stop = drain_then_stop  # type: ignore[method-assign]

        async def on_shutdown() -> None:
            # Blocking joins (bounded: a few seconds at most, even with the
            # materializer dead): off the event loop.
            watchdog.stop()
            await asyncio.to_thread(pipeline.stop)

        asyncio.run(serve(config, register, on_shutdown=on_shutdown, on_started=health.started))
    finally:
        if arena is not None:
            arena.close()
