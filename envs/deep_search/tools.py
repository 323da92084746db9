"""The deep-search tools that run on the workers: ``search`` and ``open`` over a search API.

Each call is one request of the ``web-search`` API (``api=`` on the tool), so a quota in the server's
settings spaces the calls of every trainer out; the scheduler names the key (``ctx.api_key``) and the
worker supplies its secret (``TANGRAM_API_KEY_<NAME>``). A 429 raises :class:`~tangram_env.ApiThrottled`
with the service's ``Retry-After``: the orchestrator requeues the call, the agent never sees it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pydantic import BaseModel, Field, field_validator

from tangram_env.errors import ApiThrottled
from tangram_env.kinds import ActionContext, api_secret_variable, tool

API = "web-search"
MAX_QUERY = 512


class SearchArgs(BaseModel):
    """Search the encyclopaedia."""

    query: str = Field(min_length=1, max_length=MAX_QUERY, description="words to search for")
    k: int = Field(5, ge=1, le=10, description="results to return")
    endpoint: str = Field("", max_length=256, description="service URL (a worker's TANGRAM_SEARCH_URL wins)")

    @field_validator("query")
    @classmethod
    def _has_words(cls, query: str) -> str:
        if not query.strip():  # the service refuses it (400): the agent's mistake, not the service's
            raise ValueError("the query is blank: give words to search for")
        return query


class OpenArgs(BaseModel):
    """Read one article in full."""

    doc_id: str = Field(min_length=1, max_length=256, description="an article id from search results")
    endpoint: str = Field("", max_length=256, description="service URL (a worker's TANGRAM_SEARCH_URL wins)")


def call_api(endpoint: str, path: str, params: dict[str, Any], ctx: ActionContext) -> Any:
    """GET ``endpoint + path`` with the granted key; 429 raises :class:`ApiThrottled`.

    A worker whose operator set ``TANGRAM_SEARCH_URL`` searches there whatever the payload says (the
    operator decides where workers send requests and secrets); otherwise the env's ``endpoint``.
    """
    base = (os.environ.get("TANGRAM_SEARCH_URL") or endpoint).rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError("no search service: pass the env a search_url, or set TANGRAM_SEARCH_URL")
    headers = {"Accept": "application/json"}
    if ctx.api_key is not None:
        secret = os.environ.get(api_secret_variable(ctx.api_key))
        if secret:
            headers["X-Api-Key"] = secret
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    request = urllib.request.Request(url, headers=headers)
    timeout = max(1.0, min(30.0, ctx.remaining() - 0.5))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        body = _json_body(exc)
        if exc.code == 429:
            retry = body.get("retry_after_s") if isinstance(body, dict) else None
            if not isinstance(retry, int | float):
                try:
                    retry = float(exc.headers.get("Retry-After", "1"))
                except ValueError:
                    retry = 1.0
            raise ApiThrottled(
                f"{API} answered 429 on key {ctx.api_key!r}", retry_after_s=float(retry)
            ) from None
        if exc.code == 404 and path == "/open":
            return {"error": body.get("error", "no such document") if isinstance(body, dict) else "not found"}
        detail = body.get("error", "") if isinstance(body, dict) else ""
        hint = (
            f" (set {api_secret_variable(ctx.api_key)} on the workers)"
            if exc.code == 401 and ctx.api_key
            else ""
        )
        raise RuntimeError(f"{API} answered {exc.code} {detail}{hint}") from None


def _json_body(exc: urllib.error.HTTPError) -> Any:
    try:
        return json.loads(exc.read() or b"{}")
    except (ValueError, OSError):
        return {}


@tool(name="deep_search.search", api=API, cpu=0.05, mem_mb=64, timeout_s=30)
def search(args: SearchArgs, ctx: ActionContext) -> dict[str, Any]:
    """Search the encyclopaedia; returns the best articles' ids, titles and snippets."""
    reply = call_api(args.endpoint, "/search", {"q": args.query, "k": args.k}, ctx)
    return {"query": args.query, "results": reply.get("results", [])}


@tool(name="deep_search.open", api=API, cpu=0.05, mem_mb=64, timeout_s=30)
def open_article(args: OpenArgs, ctx: ActionContext) -> dict[str, Any]:
    """Open an article by id; returns its full text."""
    reply: dict[str, Any] = call_api(args.endpoint, "/open", {"id": args.doc_id}, ctx)
    return reply
