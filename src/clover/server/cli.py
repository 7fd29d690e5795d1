"""`clover serve`: load a model directory, start the engine, run the app under uvicorn.

`add_serve_arguments(parser)` declares the options, `run_serve(args)` checks them and binds the port
first (a busy port is reported at once, not after minutes of model loading), then loads the model and
runs until SIGINT/SIGTERM, then shuts down gracefully: uvicorn stops accepting connections and waits
up to `--graceful-timeout` seconds for open requests; the engine then finishes what is left or ends
it with an error event. A mistake in the options or a port that cannot be bound is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path


class ServeError(ValueError):
    """A problem with the options or the address: printed as one line, no traceback."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model` "
                        "(default: the model directory's name, or clover-demo)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="weights dtype (auto: bf16 with the native kernels on CPU where they build, else as stored)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="on a CUDA device, run every forward eagerly (default: decode and block steps "
                             "replayed as CUDA graphs)")
    parser.add_argument("--max-batch", type=int, default=16,
                        help="requests computed per step; more run in turn (default 16)")
    parser.add_argument("--max-sequences", type=int, default=None,
                        help="requests running at once, their state kept in the pool (default 4 × --max-batch, or "
                             "--max-batch on a GPU too small for that)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting to start (past --max-sequences or the pool) before 429")
    parser.add_argument("--stream-buffer-tokens", type=int, default=64,
                        help="a stream is paused while this many of its tokens wait for its client (default 64)")
    parser.add_argument("--stream-idle-timeout", type=float, default=60.0,
                        help="seconds a stream's client may read nothing before it is closed (default 60)")
    parser.add_argument("--max-cache-gb", type=float, default=None,
                        help="the state pool (K/V pages, GDN states) of the running batch; default on a GPU: 90%% "
                             "of the memory free after the weights less 6 GiB, on the CPU 2 GiB (virtual until used) "
                             "or what --max-sequences requests' GDN states need")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-block-size", type=int, default=None,
                        help="largest block_size a request may ask for (default: the model's "
                             "generation_config.json max_block_size, else 1024)")
    parser.add_argument("--graceful-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish at shutdown")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                             "CLOVER_API_KEY environment variable, which keeps the key out of `ps`; unset: no auth)")
    parser.add_argument("--allowed-host", action="append", dest="allowed_hosts", metavar="NAME", default=None,
                        help="accept only requests whose Host header is NAME (repeatable; '*.example.com' "
                             "matches subdomains): defeats DNS rebinding against a loopback server")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection may take to send a request's headers (default 10)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request body may take to arrive, else 408 (default 30)")
    parser.add_argument("--keep-alive-timeout", type=int, default=5,
                        help="seconds an idle keep-alive connection stays open (default 5)")
    parser.add_argument("--max-connections", type=int, default=256,
                        help="open connections past which new requests get 503 (default 256)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def check_args(args) -> None:
    """ServeError for options that would otherwise fail later with a traceback."""
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must lie in 0..65535, got {args.port}")
    for name in ("max_batch", "max_connections", "max_body_bytes", "keep_alive_timeout", "stream_buffer_tokens"):
        if getattr(args, name) < 1:
            raise ServeError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        raise ServeError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_sequences is not None and args.max_sequences < 1:
        raise ServeError(f"--max-sequences must be at least 1, got {args.max_sequences}")
    for name in ("header_timeout", "body_timeout", "graceful_timeout", "stream_idle_timeout"):
        if not getattr(args, name) > 0:
            raise ServeError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.max_block_size is not None and args.max_block_size < 1:
        raise ServeError(f"--max-block-size must be at least 1, got {args.max_block_size}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise ServeError(f"no model at {args.model} (expected a directory with config.json)")


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening: bound before the (slow) model load, so that
    a busy port fails at once, but refusing connections until the server is ready for them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def build(args):
    """(app, engine) from parsed arguments; nothing listens yet."""
    import torch

    import clover
    from clover.engine import Engine
    from clover.server.app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else clover.DEMO_MODEL_DIR
    model = _load_model(args)
    tokenizer = clover.load_tokenizer(args.tokenizer or path)
    try:                                                  # (the state pool's size is checked here)
        if model.runner.ranks > 1:  # rank 0 of several: the followers mirror its steps
            from clover.distributed.serving import ControlChannel, LeaderEngine

            engine = LeaderEngine(model, engine_options(args), channel=ControlChannel(model.runner.parallel))
        else:
            engine = Engine(model, engine_options(args))
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    app = create_app(engine, tokenizer, served_name(args), max_body_bytes=args.max_body_bytes,
                     shutdown_timeout=args.graceful_timeout, max_block_size=args.max_block_size,
                     api_key=args.api_key or os.environ.get("CLOVER_API_KEY") or None,
                     allowed_hosts=args.allowed_hosts, body_timeout=args.body_timeout,
                     stream_buffer_tokens=args.stream_buffer_tokens, stream_idle_timeout=args.stream_idle_timeout)
    app.state.body_worker.start()       # spawned now (in the background), not when the first large body comes
    return app, engine


def _load_model(args):
    """The model: the fast path (bf16 + native kernels on CPU) in one process; this rank's shard on the
    reference backend when torchrun started several."""
    import torch

    import clover
    from clover.distributed.launch import launched_tensor_parallel

    path = Path(args.model) if args.model else clover.DEMO_MODEL_DIR
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if launched_tensor_parallel():
        try:
            return clover.load(path, dtype=dtype, device=args.device, backend="reference", tensor_parallel=True)
        except RuntimeError as exc:
            raise ServeError(str(exc)) from None
    return clover.load(path, dtype=dtype, device=args.device, cuda_graphs=args.cuda_graphs)


def engine_options(args):
    from clover.engine import EngineOptions

    budget = None if args.max_cache_gb is None else int(args.max_cache_gb * (1 << 30))
    return EngineOptions(max_batch=args.max_batch, max_sequences=args.max_sequences, max_queue=args.max_queue,
                         max_cache_bytes=budget)


def run_follower(args) -> int:
    """A rank other than 0 under torchrun: load this rank's shard, then run rank 0's steps until it stops."""
    import torch
    import torch.distributed as dist

    from clover.distributed.serving import ControlChannel, follow

    check_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _load_model(args)
    try:
        return follow(model, engine_options(args), ControlChannel(model.runner.parallel))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def served_name(args) -> str:
    """The `model` clients must pass: --served-model-name, else the model directory's name."""
    if args.served_model_name:
        return args.served_model_name
    return "clover-demo" if args.model is None else Path(args.model).resolve().name


def run_serve(args) -> int:
    from clover.distributed.launch import launched_rank, launched_tensor_parallel

    from .limits import DrainingServer, install_repeat_filter, uvicorn_config

    if launched_tensor_parallel() and launched_rank() != 0:
        return run_follower(args)
    check_args(args)
    sock = bind_socket(args.host, args.port)        # before the (slow) model load: a busy port fails now
    try:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        app, engine = build(args)
        config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                graceful_timeout=args.graceful_timeout, header_timeout=args.header_timeout,
                                keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections)
        install_repeat_filter()
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        # Listen before saying where to connect: a client that connects on reading the line below is
        # queued until uvicorn accepts, rather than refused while uvicorn starts up.
        sock.listen(config.backlog)
        # uvicorn does not print its address when handed a socket: say where clients should go.
        logging.getLogger("clover.server").info("serving '%s' on http://%s:%d/v1%s", served_name(args), shown, port,
                                                " (API key required)" if app.state.api_key else "")
        try:
            DrainingServer(config, app.state.begin_drain).run(sockets=[sock])
        finally:
            engine.shutdown(graceful=False)       # under torchrun this also stops the other ranks
    finally:
        sock.close()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    parser = add_serve_arguments(argparse.ArgumentParser(prog="clover serve", description=__doc__))
    try:
        return run_serve(parser.parse_args(argv))
    except ServeError as exc:
        print(f"clover serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # uvicorn has already drained and shut down; it re-raises Ctrl-C afterwards so that the
        # caller sees it: the exit status says so, a traceback would say nothing more.
        return 130
