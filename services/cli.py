"""`specmesh` command line: models prepare, up, serve SERVICE, generate PROMPT, draft train."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

from services.common.env import setting_fields
from services.settings import Settings, read_settings, setting_help

SERVICES = ("router", "target", "draft", "cache", "gateway")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own flags (services/bench/cli.py)
        return _cmd_bench(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = read_settings(**_flag_values(args))
        return args.func(args, settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specmesh: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a taken port, an unreadable file: one line, no traceback
        print(f"specmesh: error: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    from specmesh import __version__

    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specmesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="convert the default Gemma 3 270M GGUF into a "
                                    "cached Hugging Face directory (once)")
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    _common_flags(prepare)
    prepare.set_defaults(func=_cmd_prepare)

    up = sub.add_parser("up", help="start all four services on loopback",
                        usage="specmesh up [--port BASE] [--SETTING VALUE ...]")
    _setting_flags(up)
    up.set_defaults(func=_cmd_up)

    serve = sub.add_parser("serve", help="run one service (what compose.yaml uses)",
                           usage="specmesh serve SERVICE [--SETTING VALUE ...]")
    serve.add_argument("service", choices=SERVICES, help="which service to run")
    _setting_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    certs = sub.add_parser("certs", help="make a development CA and mutual-TLS certificates for "
                           "every service (use with --tls-dir / SPECMESH_TLS_DIR)")
    certs.add_argument("--out", default="certs", help="directory for ca.pem, SERVICE.pem and "
                       "SERVICE-key.pem (default ./certs)")
    certs.add_argument("--san", action="append", dest="cert_hosts", default=[], metavar="HOST",
                       help="extra DNS name (wildcards allowed) or IP address in every certificate, "
                       "or SERVICE=HOST for one service's (repeatable); each already has its "
                       "service name, localhost, 127.0.0.1 and ::1")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument("--force", action="store_true", help="replace certificates that exist")
    certs.set_defaults(func=_cmd_certs)

    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("prompt", help="the question (sent as one user chat message) or, with --raw, "
                     "the plain prompt")
    gen.add_argument("--address", dest="router_address", help=setting_help("router_address"))
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all")
    gen.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass; 0 = off")
    gen.add_argument("--seed", type=int, help="sampling seed (default: random)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--token", help=setting_help("token"))
    gen.add_argument("--raw", action="store_true", help="send PROMPT as a plain prompt, without the "
                     "model's chat template")
    gen.add_argument("--system", default="", help="a system message before the question (chat only)")
    _setting_flags(gen, ("config", "router_ca"))
    gen.set_defaults(func=_cmd_generate)

    status = sub.add_parser("status", help="health of every service, the router's pools and each "
                            "replica's KV use and queue", usage="specmesh status [--port BASE] [options]")
    status.add_argument("--address", dest="router_address", help=setting_help("router_address"))
    _setting_flags(status, ("config", "host", "port", "draft_address", "cache_address", "gateway_port",
                            "token", "router_ca", "tls_dir", "dev"))
    status.set_defaults(func=_cmd_status)

    draft = sub.add_parser("draft", help="draft heads")
    draft_sub = draft.add_subparsers(dest="draft_command", required=True)
    train = draft_sub.add_parser("train", help="train a feature head (eagle) for the target model on its own "
                                 "greedy and sampled continuations (resumable)")
    _common_flags(train)
    _train_flags(train)
    train.set_defaults(func=_cmd_draft_train)

    sub.add_parser("bench", add_help=False, help="open-loop load against a router: per-bucket "
                   "latency report and plots (`specmesh bench --help`); `specmesh bench compare A B`")
    return parser


def _train_flags(p: argparse.ArgumentParser) -> None:
    from services.draft.eagle.train_defaults import DEFAULTS
    p.add_argument("--out", help="the head's file (default MODEL_CACHE/heads/<model>.eagle.safetensors); "
                   "its checkpoint and recorded data go beside it")
    p.add_argument("--prompts", dest="prompts_file", help="prompts, one per line or JSON lines with "
                   "\"prompt\" (default: the built-in open-text set)")
    for name, (kind, help_text) in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                       help=help_text)
    p.add_argument("--no-resume", dest="resume", action="store_false", help="start afresh even if a "
                   "checkpoint exists")


def _common_flags(p: argparse.ArgumentParser) -> None:
    _setting_flags(p, ("config", "model", "model_cache"))


# Extra spellings of a few generated flags (kept from earlier releases).
_FLAG_ALIASES = {"port": ("--base-port",), "speculation_method": ("--speculation",)}


def _setting_flags(p: argparse.ArgumentParser, names=None) -> None:
    """One flag per setting (flat name), generated from its declaration in its group of the
    settings tree (services/settings.py).

    Defaults stay None so that an absent flag leaves the environment and config file in force."""
    fields = setting_fields(Settings)
    for name in names or fields:
        field = fields[name][1]
        kind, choices = field.annotation, None
        if get_origin(kind) is Literal:
            kind, choices = type(get_args(kind)[0]), get_args(kind)
        elif kind not in (int, float, bool):
            kind = str  # str, paths, optional values: the model validates the text
        flags = (f"--{name.replace('_', '-')}", *_FLAG_ALIASES.get(name, ()))
        if kind is bool:
            p.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=setting_help(name))
        else:
            p.add_argument(*flags, dest=name, type=kind, choices=choices, default=None,
                           metavar=name.upper() if choices is None else None, help=setting_help(name))


def _flag_values(args: argparse.Namespace) -> dict:
    fields = setting_fields(Settings)
    return {k: v for k, v in vars(args).items() if k in fields and v is not None}


# ---- commands ---------------------------------------------------------------
def _cmd_bench(argv: list[str]) -> int:
    from services.bench.cli import main as bench_main
    logging.basicConfig(level=logging.WARNING)
    try:
        return bench_main(argv, read_settings())
    except (ValueError, FileNotFoundError) as exc:
        print(f"specmesh bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _cmd_prepare(args, settings: Settings) -> int:
    from services.common.models.prepare import prepare_default_model

    path = prepare_default_model(_default_model_dir(settings), force=args.force, progress=True)
    print(path)
    return 0


def _cmd_up(args, settings: Settings) -> int:
    from services.builders import run_all
    return asyncio.run(run_all(settings))


def _cmd_serve(args, settings: Settings) -> int:
    from services.builders import run_one
    return asyncio.run(run_one(args.service, settings))


def _cmd_certs(args, settings: Settings) -> int:
    from services.common.tls import SERVICE_IDENTITIES, make_dev_certs

    if args.days <= 0:
        raise ValueError(f"--days must be > 0, got {args.days}")
    out = make_dev_certs(args.out, hosts=args.cert_hosts, days=args.days, force=args.force)
    print(f"mesh certificates for {', '.join(SERVICE_IDENTITIES)} in {out} "
          f"(start services with --tls-dir {out})")
    return 0


def _cmd_status(args, settings: Settings) -> int:
    from services.status import print_status
    return print_status(settings)


def _cmd_generate(args, settings: Settings) -> int:
    from services.common.client import stream_generate
    return asyncio.run(stream_generate(settings, args))


def _cmd_draft_train(args, settings: Settings) -> int:
    from services.builders import resolve_model
    from services.draft.eagle.train import TrainConfig, train_head
    from services.draft.eagle.train_defaults import DEFAULTS

    model_dir = resolve_model(settings)
    out = Path(args.out) if args.out else (Path(settings.model_cache).expanduser() / "heads"
                                           / f"{model_dir.name}.eagle.safetensors")
    given = {name: getattr(args, name) for name in DEFAULTS if getattr(args, name) is not None}
    config = TrainConfig(model_dir=model_dir, out=out, resume=args.resume,
                         chat_template=settings.target.chat_template,  # prompts rendered as the target serves chat
                         prompts_file=Path(args.prompts_file) if args.prompts_file else None, **given)
    flags = [f"--{name.replace('_', '-')} {value}" for name, value in given.items()]
    command = " ".join(["specmesh draft train --model", settings.model, "--out", str(out), *flags])
    result = train_head(config, command=command)
    first, last = result.losses[:1], result.losses[-1:]
    print(f"feature head for {model_dir} saved to {result.path} ({result.path.stat().st_size / 2**20:.1f} MiB; "
          f"{result.steps} steps on {result.num_tokens} tokens; loss {first and first[0]:.3f} -> {last and last[0]:.3f}; "
          f"data {result.data_seconds / 60:.1f} min, training {result.train_seconds / 60:.1f} min)")
    print(f"serve it with: specmesh up --speculation eagle --eagle-head {result.path}")
    return 0


def _default_model_dir(settings: Settings) -> Path:
    return Path(settings.model_cache).expanduser() / "gemma-3-270m"


if __name__ == "__main__":
    sys.exit(main())
