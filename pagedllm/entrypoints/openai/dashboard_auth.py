"""The dashboard's API key handling: a browser gives the key once (``/dashboard?key=KEY`` or the login
form) and keeps a cookie that the guard accepts on the dashboard's routes only.

The cookie holds an HMAC of a fixed label under the key, never the key itself; it is HttpOnly,
SameSite=Strict, and scoped by ``Path`` to the page (``/dashboard``) and its data (``/v1/engine``),
so no other route accepts it.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import secrets
from collections.abc import Sequence
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

COOKIE_NAME = "pagedllm_dashboard"
PAGE_PATH = "/dashboard"
LOGIN_PATH = "/dashboard/login"
DATA_PREFIX = "/v1/engine"
COOKIE_PATHS = (PAGE_PATH, DATA_PREFIX)  # one cookie per path: a cookie has a single Path
COOKIE_MAX_AGE_S = 12 * 3600


def is_dashboard_path(path: str) -> bool:
    """Whether the route is the dashboard's (the page, its files, its data), where the cookie counts."""
    return (
        path == PAGE_PATH
        or path.startswith(PAGE_PATH + "/")
        or path == DATA_PREFIX
        or path.startswith(DATA_PREFIX + "/")
    )


def cookie_token(api_key: str) -> str:
    """The cookie's value for ``api_key``."""
    return hmac.new(api_key.encode(), b"pagedllm-dashboard-v1", hashlib.sha256).hexdigest()


def key_matches(given: str, api_key: str) -> bool:
    return secrets.compare_digest(given.encode(), api_key.encode())


def matching_key(given: str, api_keys: Sequence[str]) -> str | None:
    """The key of ``api_keys`` that ``given`` is (each compared in constant time), or None."""
    found = None
    for key in api_keys:
        if key_matches(given, key):
            found = key
    return found


def bearer_key(authorization: str, api_keys: Sequence[str]) -> str | None:
    """The key of ``api_keys`` an ``Authorization: Bearer KEY`` header carries, or None."""
    scheme, _, given = authorization.partition(" ")
    return matching_key(given, api_keys) if scheme == "Bearer" else None


def dashboard_key(path: str, cookie_header: str | None, query: bytes, api_keys: Sequence[str]) -> str | None:
    """The key that authorizes a dashboard route without the bearer header: the one a valid cookie
    was made from, or (the page itself) a valid ``key`` query parameter, which the page then trades
    for the cookie; None when neither."""
    if not is_dashboard_path(path):
        return None
    if path == PAGE_PATH and query:
        given = parse_qs(query.decode("latin-1")).get("key")
        if given:
            key = matching_key(given[0], api_keys)
            if key is not None:
                return key
    if not cookie_header:
        return None
    cookie: SimpleCookie = SimpleCookie()
    try:
        cookie.load(cookie_header)
    except Exception:  # noqa: BLE001 - a malformed cookie header authorizes nothing
        return None
    morsel = cookie.get(COOKIE_NAME)
    if morsel is None:
        return None
    found = None
    for key in api_keys:
        if secrets.compare_digest(morsel.value.encode(), cookie_token(key).encode()):
            found = key
    return found


def set_cookie_headers(api_key: str) -> list[tuple[str, str]]:
    """The ``Set-Cookie`` headers that authorize this browser on the dashboard's routes."""
    token = cookie_token(api_key)
    return [
        (
            "set-cookie",
            f"{COOKIE_NAME}={token}; Path={path}; Max-Age={COOKIE_MAX_AGE_S}; HttpOnly; SameSite=Strict",
        )
        for path in COOKIE_PATHS
    ]


def login_page(message: str = "") -> str:
    """The HTML form shown (with status 401) to a browser that has not given the key."""
    note = f'<p class="error">{html.escape(message)}</p>' if message else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pagedllm dashboard: API key</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<style>body{{font:15px system-ui,sans-serif;margin:15vh auto;max-width:26em;color:#222}}
input{{font:inherit;padding:.4em;width:100%;box-sizing:border-box;margin:.5em 0}}
button{{font:inherit;padding:.4em 1.2em}}.error{{color:#b00020}}</style></head>
<body><h1>pagedllm dashboard</h1><p>This server needs its API key.</p>{note}
<form method="post" action="{LOGIN_PATH}"><label>API key
<input type="password" name="key" autocomplete="current-password" autofocus></label>
<button type="submit">Open the dashboard</button></form></body></html>
"""
