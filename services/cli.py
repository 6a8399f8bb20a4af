"""`specmesh` command line: models prepare, up, serve SERVICE, generate PROMPT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from services.common.env import Settings, read_settings

SERVICES = ("router", "target", "draft", "cache")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = read_settings(**_overrides(args))
        return args.func(args, settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specmesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="convert the default Gemma 3 270M GGUF into a "
                                    "cached Hugging Face directory (once)")
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    _common_flags(prepare)
    prepare.set_defaults(func=_cmd_prepare)

    up = sub.add_parser("up", help="start all four services on loopback")
    up.add_argument("--base-port", dest="port", type=int,
                    help="router port; target, draft and cache take the next three (default 50051..50054)")
    _common_flags(up)
    _engine_flags(up)
    up.set_defaults(func=_cmd_up)

    serve = sub.add_parser("serve", help="run one service (what compose.yaml uses)")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--target-address", dest="target_address")
    serve.add_argument("--cache-backend", dest="cache_backend", choices=("memory", "redis"))
    serve.add_argument("--redis-url", dest="redis_url")
    _common_flags(serve)
    _engine_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("prompt")
    gen.add_argument("--address", dest="router_address", help="router address (host:port)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--token", help="bearer token (default: SPECMESH_TOKEN or the dev token)")
    gen.set_defaults(func=_cmd_generate)
    return parser


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="'default' or a local Hugging Face model directory")
    p.add_argument("--model-cache", dest="model_cache", help="where prepared models are cached")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculation", dest="speculation_method",
                   choices=("off", "prompt_lookup", "suffix", "draft_model", "dynamic_tree"),
                   help="speculative decoding method the router plans (default prompt_lookup)")
    p.add_argument("--speculation-depth", dest="speculation_depth", type=int)
    p.add_argument("--draft-model", dest="draft_model",
                   help="draft LM for draft_model / dynamic_tree ('default' or a local HF directory)")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--kv-dtype", dest="kv_dtype", help="auto | bfloat16 | float32 | fp8")
    p.add_argument("--kernels", choices=("auto", "triton", "reference"))
    p.add_argument("--num-blocks", dest="num_blocks", type=int)


def _overrides(args: argparse.Namespace) -> dict:
    names = {"host", "port", "model", "model_cache", "dtype", "kv_dtype", "kernels", "num_blocks",
             "target_address", "cache_backend", "redis_url", "router_address", "token",
             "speculation_method", "speculation_depth", "draft_model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


# ---- commands ---------------------------------------------------------------
def _cmd_prepare(args, settings: Settings) -> int:
    from services.common.models.prepare import prepare_default_model

    path = prepare_default_model(_default_model_dir(settings), force=args.force, progress=True)
    print(path)
    return 0


def _cmd_up(args, settings: Settings) -> int:
    from services.common.builders import run_all
    return asyncio.run(run_all(settings))


def _cmd_serve(args, settings: Settings) -> int:
    from services.common.builders import run_one
    return asyncio.run(run_one(args.service, settings))


def _cmd_generate(args, settings: Settings) -> int:
    from services.common.client import stream_generate
    return asyncio.run(stream_generate(settings, args))


def _default_model_dir(settings: Settings) -> Path:
    return Path(settings.model_cache).expanduser() / "gemma-3-270m"


if __name__ == "__main__":
    sys.exit(main())
