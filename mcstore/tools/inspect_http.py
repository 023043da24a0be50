"""``mctier inspect serve``: the inspection API as an HTTP JSON server (FastAPI).

Binds 127.0.0.1 unless told otherwise. Endpoints (schema at ``/openapi.json``,
browsable at ``/docs``)::

    GET    /health                       liveness plus whether the master (RPC, admin API) answers
    GET    /summary                      objects and bytes per fingerprint and tier
    POST   /lookup                       {"prompt"|"tokens"|"messages", "fingerprint"?, "cache_salt"?}
                                         (default key space: the engine named at start-up)
    GET    /keys?prefix=&limit=          keys with size and tiers
    GET    /stats                        master metrics, engine connector counters
    DELETE /fingerprints/{fingerprint}   remove a fingerprint's objects (bearer token)

Destructive calls need ``Authorization: Bearer <token>`` with the token given at
start-up (``--token`` or ``MCTIER_INSPECT_TOKEN``); without a configured token
they are refused. Malformed input answers 4xx (400/422), an unreachable master
503 (also: the named engine's key space not published yet), an unknown fingerprint 404,
several published key spaces fitting the engine named at start-up 409 (pass a fingerprint).
"""

# No ``from __future__ import annotations``: FastAPI resolves the handlers' annotations at run
# time, and the request model is local to create_app.
import hmac
from typing import Any

import msgspec

from kvcore.errors import ConfigError
from mcstore.tools.inspect import Inspector, NotFound, Unavailable
from mcstore.tools.published import AmbiguousKeySpace


def create_app(insp: Inspector, token: str | None):
    from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

    app = FastAPI(title="mctier store inspection", version="1",
                  description="What the Mooncake store holds for mctier engines.")

    class LookupBody(BaseModel):
        model_config = ConfigDict(extra="forbid")
        prompt: str | None = None
        tokens: list[NonNegativeInt] | None = Field(default=None, max_length=1 << 20)
        messages: list[dict[str, Any]] | None = None
        add_generation_prompt: bool = True
        fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{16}([0-9a-fA-F]{48})?$")
        cache_salt: str | None = None

    def ok(obj) -> Response:
        return Response(msgspec.json.encode(obj), media_type="application/json")

    def status(code: int):
        async def handler(_req: Request, e: Exception):
            return JSONResponse({"detail": str(e)}, status_code=code)
        return handler

    # Bad input 400, unknown fingerprint 404, several key spaces for the engine 409, store or tool
    # set-up unusable 503 (ConfigError is a ValueError, AmbiguousKeySpace a ConfigError: Starlette
    # picks the handler of the most specific class).
    for exc, code in ((ValueError, 400), (NotFound, 404), (AmbiguousKeySpace, 409), (Unavailable, 503),
                      (ConfigError, 503)):
        app.add_exception_handler(exc, status(code))

    def authorized(authorization: str | None = Header(default=None)) -> None:
        if not token:
            raise HTTPException(403, "destructive operations are disabled: the server was started without --token")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    # Sync handlers: FastAPI runs them in its thread pool, so slow master calls never block the loop.
    @app.get("/health")
    def health():
        return {"status": "ok", **insp.health(), "master_addr": insp.master,
                "key_space": insp.meta.fingerprint[:16] if insp.meta else None}

    @app.get("/summary")
    def summary():
        return ok(insp.summary())

    @app.post("/lookup")
    def lookup(body: LookupBody):
        toks = insp.tokens_of(prompt=body.prompt, tokens=body.tokens, messages=body.messages,
                              add_generation_prompt=body.add_generation_prompt, fingerprint=body.fingerprint)
        return ok(insp.lookup(toks, fingerprint=body.fingerprint, cache_salt=body.cache_salt))

    @app.get("/keys")
    def keys(prefix: str | None = Query(default=None, max_length=1024),
             limit: int = Query(default=1000, ge=0, le=100000)):
        return ok(insp.keys(prefix, limit))

    @app.get("/stats")
    def stats():
        return ok(insp.stats())

    @app.delete("/fingerprints/{fingerprint}", dependencies=[Depends(authorized)])
    def remove(fingerprint: str = Path(pattern=r"^[0-9a-fA-F]{16}([0-9a-fA-F]{48})?$"),
               force: bool = False, timeout: float = Query(default=12.0, ge=0, le=120)):
        return ok(insp.remove(fingerprint, force=force, timeout=timeout))

    return app


def serve(insp: Inspector, host: str = "127.0.0.1", port: int = 9400, token: str | None = None) -> int:
    """Serve ``insp`` until interrupted (then close it)."""
    import uvicorn

    app = create_app(insp, token)
    space = (insp.meta.fingerprint[:16] if insp.meta else "the named engine's, read on first use" if insp.query
             else "none")
    print(f"mctier inspect serving http://{host}:{port} (master {insp.master}, admin "
          f"{insp.admin_url or 'published/default'}, key space {space}, "
          f"destructive calls {'need the token' if token else 'disabled'})", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        insp.close()
    return 0
