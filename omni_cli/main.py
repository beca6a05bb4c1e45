"""omni-serving: run the services, the whole stack, and clients."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _cmd_up(args: argparse.Namespace) -> int:
    from omni_stack.config import config_from_args
    from omni_stack.errors import ConfigError
    from omni_stack.up import run_up

    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"omni-serving up: error: {exc}", file=sys.stderr)
        return 2
    return run_up(cfg)


def _cmd_restart(args: argparse.Namespace) -> int:
    from omni_stack.running import run_restart_materializer

    return run_restart_materializer(args.deployment, args.runtime_dir, args.timeout)


def _read_token(path: str) -> str | None:
    """The bearer token in a file (None: the client falls back to OMNI_GATEWAY_TOKEN)."""
    return Path(path).read_text().strip() if path else None


def _cmd_speak(args: argparse.Namespace) -> int:
    from omni_cli.speak_client import SpeakClientError, speak

    try:
        speak(
            args.target,
            args.text,
            Path(args.output),
            voice=args.voice,
            seed=args.seed,
            http_url=args.http_url if args.http else None,
            progress=not args.quiet,
            token=_read_token(args.token_file),
            tls_ca=args.tls_ca or None,
            tls_server_name=args.tls_server_name or None,
        )
    except SpeakClientError as exc:
        print(f"omni-serving speak: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_models_create(args: argparse.Namespace) -> int:
    if args.family == "qwen3-tts":
        from omni_cli.tts_models import create

        return create(args)
    from decoder_svc.qwen3_omni.cache import default_model_dir, released_model_dir
    from decoder_svc.qwen3_omni.released import create_released_checkpoint
    from decoder_svc.qwen3_omni.tiny import create_tiny_checkpoint

    def fail(message: str, code: int = 2) -> int:
        print(f"omni-serving models create: {message}", file=sys.stderr)
        return code

    def say(message: str) -> None:
        print(f"omni-serving models create: {message}", file=sys.stderr, flush=True)

    released = args.preset == "released"
    if args.layers is not None and not released:
        return fail("--layers goes with --preset released")
    layers = 1 if args.layers is None else args.layers
    if layers < 1:
        return fail(f"--layers: at least 1, got {layers}")
    try:
        if args.out is None:
            if args.seed not in (None, 0):
                return fail("--seed needs --out (the model cache's checkpoints are written with seed 0)")
            path = released_model_dir(layers, progress=say) if released else default_model_dir()
        else:
            out = Path(args.out)
            if out.exists() or out.is_symlink():
                return fail(f"{out} exists; give a new directory (an existing one is left untouched)")
            if released:
                path = create_released_checkpoint(out, layers=layers, seed=args.seed or 0, progress=say)
            else:
                path = create_tiny_checkpoint(out, seed=args.seed or 0)
    except FileExistsError as exc:  # created by someone else meanwhile
        return fail(str(exc))
    except OSError as exc:  # no space, no permission: nothing is left behind
        return fail(str(exc), 1)
    print(path)
    return 0


def _cmd_models_check(args: argparse.Namespace) -> int:
    from omni_cli.tts_models import check, is_tts_dir

    if is_tts_dir(args.dir):
        return check(args.dir)
    from decoder_svc.qwen3_omni.checkpoint import CheckpointError, OmniCheckpoint
    from decoder_svc.qwen3_omni.views import TALKER_PREFIX, check_view, talker_view

    try:
        ckpt = OmniCheckpoint.open(args.dir)
        # the view the decoder's talker loads, built and checked as the decoder builds it
        view = talker_view(ckpt)
        check_view(view, ckpt, TALKER_PREFIX)
    except CheckpointError as exc:
        print(f"omni-serving models check: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omni-serving models check: cannot write the talker's view into the model cache: {exc}",
              file=sys.stderr)
        return 1
    for label, value in _checkpoint_summary(ckpt):
        print(f"{label + ':':<12} {value}")
    print(f"{'talker view:':<12} {view.path} ({len(view.shards)} shards, {view.tensors} tensors)")
    return 0


def _cmd_models_plan(args: argparse.Namespace) -> int:
    """The memory plan of a checkpoint (or of the released one's configuration)
    on this host or another: what the decoder prints and checks before any
    engine starts, nothing loaded."""
    from decoder_svc.engine_settings import _bytes, check_placement, parse_overrides
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.checkpoint import CheckpointError, OmniCheckpoint
    from decoder_svc.qwen3_omni.family import memory_plan
    from decoder_svc.qwen3_omni.memory_plan import PlanRefused
    from decoder_svc.qwen3_omni.presets import ConfigCheckpoint, released_config
    from omni_common.errors import InvalidArgumentError

    def fail(message: str, code: int = 2) -> int:
        print(f"omni-serving models plan: {message}", file=sys.stderr)
        return code

    if (args.dir is None) == (args.preset is None):
        return fail("give a checkpoint directory or --preset released, not both")
    if args.layers is not None and args.preset is None:
        return fail("--layers goes with --preset")
    try:
        if args.preset is not None:
            ckpt = ConfigCheckpoint(released_config(args.layers))
        else:
            ckpt = OmniCheckpoint.open(args.dir)
        profile = load_profile(args.profile).with_engine_overrides(
            parse_overrides([i.strip() for arg in args.engine_set for i in arg.split(",") if i.strip()],
                            "--engine-set"), "--engine-set")
        check_placement([(s.name, s.engine, s.tensor_parallel_size) for s in profile.ar_stages], own_processes=True)
        totals = None
        if args.gpus:
            if args.gpu_memory is None:
                return fail("--gpus needs --gpu-memory (each device's total memory, e.g. 141GB)")
            each = _bytes("--gpu-memory", args.gpu_memory)
            totals = {f"cuda:{i}": each for i in range(args.gpus)}
        host = None if args.host_memory is None else _bytes("--host-memory", args.host_memory)
        plan = memory_plan(ckpt, profile, code2wav_workers=args.code2wav_workers,
                           platform="cuda" if args.gpus else "cpu", device_totals=totals, host_memory=host)
    except (CheckpointError, InvalidArgumentError, ValueError) as exc:
        return fail(str(exc))
    except PlanRefused as exc:
        return fail(str(exc), 1)
    for line in plan.lines():
        print(line)
    return 0


def _checkpoint_summary(ckpt) -> list[tuple[str, str]]:
    th = ckpt.thinker_config["text_config"]
    tk = ckpt.talker_config
    tt, cp, c2w = tk["text_config"], tk["code_predictor_config"], ckpt.code2wav_config

    def experts(text: dict) -> int:
        return text.get("num_experts") or text.get("num_local_experts") or 0

    def text_model(text: dict) -> str:
        return (f"{text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
                f"vocab {text['vocab_size']}, {experts(text)} experts "
                f"({text['num_experts_per_tok']} per token)")

    shards = ckpt.shard_files()
    size = sum(p.stat().st_size for p in shards)
    speakers = ", ".join(f"{name} ({sid})" for name, sid in sorted(ckpt.talker_config["speaker_id"].items()))
    return [
        ("checkpoint", str(ckpt.path)),
        ("arch", ", ".join(ckpt.config.get("architectures", []))),
        ("thinker", text_model(th)),
        ("talker", text_model(tt)),
        ("predictor", f"{cp['num_hidden_layers']} layers, hidden {cp['hidden_size']}, "
                      f"{cp['num_code_groups']} code groups of {cp['vocab_size']} codes"),
        ("code2wav", f"{c2w['num_hidden_layers']} layers, hidden {c2w['hidden_size']}, "
                     f"{c2w['num_quantizers']} quantizers, codebook {c2w['codebook_size']}"),
        ("speakers", speakers),
        ("input", _media_input(ckpt)),
        ("shards", f"{len(shards)} ({', '.join(p.name for p in shards)}), "
                   f"{size / 2**20:.1f} MiB, {len(ckpt.weight_map)} tensors"),
        ("fingerprint", ckpt.fingerprint()),
    ]


def _media_input(ckpt) -> str:  # noqa: ANN001
    """What the thinker takes besides text (preprocessor_config.json)."""
    taken = ["text"]
    if ckpt.audio_input is not None:
        taken.append(f"audio ({ckpt.audio_input.rate} Hz)")
    if ckpt.image_input is not None:
        taken.append(f"images ({ckpt.image_input.patch * ckpt.image_input.merge} px per token side)")
    return ", ".join(taken)


def _cmd_conformance(args: argparse.Namespace) -> int:
    from materializer_svc.conformance import main as conformance_main

    return int(conformance_main(args.rest) or 0)


def _cmd_bench(args: argparse.Namespace) -> int:
    """`omni-serving bench ...` is `python -m bench ...`, run in this process's place (exec):
    the CLI never imports bench (bench imports the stack library, not the CLI).
    -P: the same import path as this command's, without the working directory."""
    argv = [sys.executable, "-P", "-m", "bench", *args.rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1  # not reached: execv returns only by raising


def _delegate(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(f"{module}.__main__").main(args.rest) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-serving", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser(
        "up",
        help="start decoder, materializer and gateway; Ctrl-C stops them",
        description="Start materializer, decoder and gateway as processes, wait until all three are "
        "healthy, print the endpoints; Ctrl-C or SIGTERM stops them. Options can also come from "
        "--config FILE (TOML or YAML, same keys); options given here win. See docs/configuration.md.",
    )
    from omni_stack.config import add_up_arguments

    add_up_arguments(up)
    up.set_defaults(func=_cmd_up)

    rs = sub.add_parser(
        "restart",
        help="rolling restart of a running `up`'s materializers, without failing a request",
        description="Find a running `omni-serving up` (by --deployment or --runtime-dir; alone, "
        "the only one) and ask it (SIGHUP) to restart each materializer in turn: a replacement "
        "starts on the same socket, and once it is healthy the old one gets SIGTERM and finishes "
        "its steps. Prints each step; exit 0 once done, 1 if it failed. See docs/configuration.md.",
    )
    rs.add_argument("service", choices=["materializer"], help="what to restart")
    where = rs.add_mutually_exclusive_group()
    where.add_argument("--deployment", default="", metavar="NAME",
                       help="the stack's deployment name (stacks whose runtime dir `up` created)")
    where.add_argument("--runtime-dir", default="", metavar="DIR", help="the stack's runtime directory")
    rs.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="seconds to follow the restart before giving up waiting (0 = do not wait; "
                    "default: 300)")
    rs.set_defaults(func=_cmd_restart)

    sp = sub.add_parser("speak", help="speak a text through the gateway and write a WAV")
    sp.add_argument("text")
    sp.add_argument("-o", "--output", default="out.wav")
    sp.add_argument("--target", default="127.0.0.1:50051", help="gateway gRPC address")
    sp.add_argument("--voice", default="")
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--http", action="store_true", help="use the HTTP facade instead of gRPC")
    sp.add_argument("--http-url", default="http://127.0.0.1:8000")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sp.add_argument("--token-file", default="", help="file holding the gateway's bearer token "
                    "(default: the OMNI_GATEWAY_TOKEN variable, if set)")
    sp.add_argument("--tls-ca", default="", help="CA certificate (PEM) of a TLS gateway "
                    "(default: the OMNI_GATEWAY_TLS_CA variable, if set)")
    sp.add_argument("--tls-server-name", default="", help="name to check the gateway's certificate against")
    sp.set_defaults(func=_cmd_speak)

    models = sub.add_parser("models", help="local model checkpoints")
    msub = models.add_subparsers(dest="models_command", required=True)
    mc = msub.add_parser(
        "create",
        help="write a random-weight Qwen3-Omni checkpoint in the released layout (tiny, or at the released widths)",
        description="Write a random-weight Qwen3-Omni-MoE checkpoint to a new directory and print its path. "
        "Default: the tiny one (the model cache's, which the decoder serves when no --model is given). "
        "--preset released: the released 30B-A3B's widths, special token ids and layout in bfloat16 shards, "
        "with --layers N layers per stack (N = 1: about 1.8 B parameters, 3.4 GiB); see docs/models.md.",
    )
    mc.add_argument("--out", metavar="DIR", default=None,
                    help="new directory to write (must not exist; default: the model cache's, written once)")
    mc.add_argument("--seed", type=int, default=None, help="weight seed, with --out (default: 0)")
    mc.add_argument("--preset", choices=["tiny", "released"], default="tiny",
                    help="tiny (default) or released (the released widths)")
    mc.add_argument("--layers", type=int, default=None, help="with --preset released: layers per stack (default: 1)")
    mc.add_argument("--family", choices=["qwen3-omni", "qwen3-tts"], default="qwen3-omni",
                    help="qwen3-omni (default) or qwen3-tts: a tiny Qwen3-TTS (12 Hz) checkpoint of --kind, with --out")
    mc.add_argument("--kind", choices=["custom_voice", "voice_design", "base"], default="custom_voice",
                    help="with --family qwen3-tts: custom_voice (named speakers, default), voice_design (a voice "
                         "described in words) or base (voices cloned from reference clips)")
    mc.set_defaults(func=_cmd_models_create)
    mk = msub.add_parser(
        "check",
        help="validate a Qwen3-Omni or Qwen3-TTS checkpoint directory and print a summary",
        description="Run the checks the decoder runs before serving a checkpoint (config, "
        "weights, tokenizer, chat template); exit 1 with the file and key of the first problem.",
    )
    mk.add_argument("dir", help="checkpoint directory (only read)")
    mk.set_defaults(func=_cmd_models_check)
    mp = msub.add_parser(
        "plan",
        help="print the memory plan of a checkpoint on this host or another (nothing loaded)",
        description="Compute the memory plan the decoder prints and checks before any engine starts "
        "(weights from the checkpoint's headers, KV, activations, per stage and device), for this host "
        "or for one with --gpus devices of --gpu-memory each; exit 1 with the refusal when it does not fit.",
    )
    mp.add_argument("dir", nargs="?", default=None, help="checkpoint directory (only read)")
    mp.add_argument("--preset", choices=["released"], default=None,
                    help="instead of a directory: the released Qwen3-Omni-30B-A3B's configuration")
    mp.add_argument("--layers", type=int, default=None, help="with --preset: layers per stack (default: as released)")
    mp.add_argument("--profile", default="omni", help="deployment profile (default: omni)")
    mp.add_argument("--engine-set", action="append", default=[], metavar="[STAGE.]KEY=VALUE",
                    help="engine settings over the profile's, as the decoder takes them (repeatable; "
                         "comma-separated items)")
    mp.add_argument("--gpus", type=int, default=0, help="CUDA devices of the host planned for (default: 0, CPU)")
    mp.add_argument("--gpu-memory", default=None, metavar="SIZE", help="each device's total memory (e.g. 141GB)")
    mp.add_argument("--host-memory", default=None, metavar="SIZE",
                    help="the host's memory available to the stack (default: this host's)")
    mp.add_argument("--code2wav-workers", type=int, default=1, help="code2wav worker processes (default: 1)")
    mp.set_defaults(func=_cmd_models_plan)

    bench = sub.add_parser("bench", help="benchmarks: step-gap, handoff, e2e (see --help)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)

    conf = sub.add_parser("conformance", help="run the materializer conformance kit (see --help)", add_help=False)
    conf.add_argument("rest", nargs=argparse.REMAINDER)
    conf.set_defaults(func=_cmd_conformance)

    for name, module in (("decoder", "decoder_svc"), ("materializer", "materializer_svc"), ("gateway", "gateway")):
        p = sub.add_parser(name, help=f"run {module} (arguments as `python -m {module} --help`)", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    return parser


# Subcommands that hand their whole argument list to another entry point
# (argparse's REMAINDER would swallow neither a leading --help nor options).
_PASS_THROUGH = {
    "bench": _cmd_bench,
    "conformance": _cmd_conformance,
    "decoder": _delegate("decoder_svc"),
    "materializer": _delegate("materializer_svc"),
    "gateway": _delegate("gateway"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _PASS_THROUGH:
        return int(_PASS_THROUGH[argv[0]](argparse.Namespace(rest=argv[1:])) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
