"""The playground at `/`: three static files shipped in the package (playground/), served as they are.

The files hold nothing secret, so they load without the API key (a browser cannot send a Bearer token
when it opens a page); the Host check applies to them as to every route, and every call the page makes
goes to the API, which needs the key: the page asks for it when the API answers 401. The
Content-Security-Policy keeps the page to this server's own scripts and styles (nothing from a CDN).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/playground/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/playground/style.css": ("style.css", "text/css; charset=utf-8")}
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def add_playground(app: FastAPI) -> None:
    folder = resources.files("clover.server") / "playground"
    for path, (name, media_type) in FILES.items():
        body = (folder / name).read_bytes()

        async def serve(body=body, media_type=media_type):
            return Response(body, media_type=media_type, headers=HEADERS)
        app.add_api_route(path, serve, methods=["GET"], include_in_schema=False)
