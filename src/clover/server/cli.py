"""`clover serve`: load a model directory, start the engine, run the app under uvicorn.

`add_serve_arguments(parser)` declares the options, `run_serve(args)` runs until SIGINT/SIGTERM, then
shuts down gracefully: uvicorn stops accepting connections and waits up to `--graceful-timeout`
seconds for open requests; the engine then finishes what is left or ends it with an error event.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model` "
                        "(default: the model directory's name, or clover-demo)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="weights dtype (auto: as stored)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    parser.add_argument("--max-cache-gb", type=float, default=None, help="cache budget of the running batch")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-block-size", type=int, default=None,
                        help="largest block_size a request may ask for (default: the model's "
                             "generation_config.json max_block_size, else 1024)")
    parser.add_argument("--graceful-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish at shutdown")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def build(args):
    """(app, engine) from parsed arguments; nothing listens yet."""
    import torch

    import clover
    from clover.engine import Engine, EngineOptions
    from clover.server.app import create_app
    from clover.tokenization import CloverTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else clover.DEMO_MODEL_DIR
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = clover.load(path, dtype=dtype, device=args.device, pack=True)   # no-op unless bf16 on CPU
    tokenizer = CloverTokenizer.from_dir(args.tokenizer or path)
    budget = None if args.max_cache_gb is None else int(args.max_cache_gb * (1 << 30))
    engine = Engine(model, EngineOptions(max_batch=args.max_batch, max_queue=args.max_queue, max_cache_bytes=budget))
    name = args.served_model_name or ("clover-demo" if args.model is None else path.resolve().name)
    app = create_app(engine, tokenizer, name, max_body_bytes=args.max_body_bytes,
                     shutdown_timeout=args.graceful_timeout, max_block_size=args.max_block_size)
    return app, engine


def run_serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, engine = build(args)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.graceful_timeout)
    finally:
        engine.shutdown(graceful=False)
    return 0


def main(argv=None) -> int:
    parser = add_serve_arguments(argparse.ArgumentParser(prog="clover serve", description=__doc__))
    return run_serve(parser.parse_args(argv))
