"""OpenAI-compatible HTTP server (FastAPI) in front of `clover.engine.Engine`.

`create_app(engine, tokenizer, model_name)` builds the app; `add_serve_arguments` / `run_serve`
implement `clover serve`. Imported lazily so that `clover` works without fastapi installed.
"""


def create_app(*args, **kwargs):
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)


def add_serve_arguments(parser):
    from .cli import add_serve_arguments as _add

    return _add(parser)


def run_serve(args):
    from .cli import run_serve as _run

    return _run(args)


__all__ = ["create_app", "add_serve_arguments", "run_serve"]
