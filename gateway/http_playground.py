"""The playground: a static page, served by the HTTP facade, that speaks through it.

``GET /`` serves ``gateway/playground/index.html``; ``GET /playground/{name}``
serves the page's script and style sheet. The files are package data (no
build step) and reference nothing outside the gateway: the
``Content-Security-Policy`` header limits the page to its own origin, so
the browser itself refuses any other URL.

The page holds no data: everything it shows comes from the API routes it
calls (``/v1/models``, ``/v1/audio/speech``) with the token the user types
in. That is why `is_page_path` lets the bearer-token middleware serve these
paths (GET and HEAD only) without a token, while every API route still needs it.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

PLAYGROUND_DIR = Path(__file__).resolve().parent / "playground"
PAGE_ROUTE = "/"
STATIC_PREFIX = "/playground/"

# The only files served; anything else under /playground/ is a 404.
_CONTENT_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
_PAGE_METHODS = ("GET", "HEAD")
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_page_path(method: str, path: str) -> bool:
    """True for a GET/HEAD of the page or one of its files (served without a token)."""
    if method not in _PAGE_METHODS:
        return False
    if path == PAGE_ROUTE:
        return True
    return path.startswith(STATIC_PREFIX) and path[len(STATIC_PREFIX) :] in _CONTENT_TYPES


def _file_response(name: str) -> web.Response:
    content_type = _CONTENT_TYPES.get(name)
    if content_type is None:
        raise web.HTTPNotFound()
    try:
        body = (PLAYGROUND_DIR / name).read_bytes()
    except FileNotFoundError:
        raise web.HTTPNotFound() from None
    return web.Response(body=body, headers={"Content-Type": content_type, **_HEADERS})


async def page(request: web.Request) -> web.Response:
    return _file_response("index.html")


async def static_file(request: web.Request) -> web.Response:
    return _file_response(request.match_info["name"])


def add_playground_routes(router: web.UrlDispatcher) -> None:
    """Register ``GET /`` and ``GET /playground/{name}`` (HEAD comes with GET)."""
    router.add_get(PAGE_ROUTE, page)
    router.add_get(STATIC_PREFIX + "{name}", static_file)


__all__ = ["PLAYGROUND_DIR", "add_playground_routes", "is_page_path"]
