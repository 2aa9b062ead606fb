"""The mirror's file server (SPEC MIR-2): verified files to holders of the cluster's credentials.

``GET|HEAD /files/MODEL/VERSION/FILE`` with ``Range`` (206 and ``Content-Range``, by aiohttp's
``FileResponse``), ``GET /files/`` a listing, ``/healthz`` open. Only files whose checksum
matched are ever handed out: a name is looked up in what the mirror verified, never joined onto
a path as given, so neither a partial download nor ``../`` can be reached.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from llmgw.events.folds.mirror import FileState
from llmgw.services.mirror.rules import valid_name


class Holdings(Protocol):
    """What a file server hands out: a mirror's own fold, or a peer's view of its copies (MIR-4)."""

    def verified(self, model: str, version: str, name: str) -> FileState | None: ...

    def rows(self) -> list[dict[str, Any]]: ...


def _denied() -> web.Response:
    return web.json_response(
        {"error": {"message": "the mirror serves its files to the cluster only: send its token as a bearer token"}},
        status=401,
        headers={"WWW-Authenticate": 'Bearer realm="llmgw-mirror"'},
    )


def file_server(state: Holdings, root: Path, token: Callable[[], str | None]) -> web.Application:
    """The app; ``state`` is the service's follower, ``token`` the bearer token it accepts."""

    def allowed(request: web.Request) -> bool:
        expected = token()
        given = request.headers.get("Authorization", "")
        if not expected or not given.startswith("Bearer "):
            return False
        return hmac.compare_digest(given[7:].strip().encode(), expected.encode())

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def listing(request: web.Request) -> web.Response:
        if not allowed(request):
            return _denied()
        files = []
        for row in state.rows():
            for f in row["files"]:
                if f["verified"]:
                    path = f"{row['model']}/{row['version']}/{f['name']}"
                    files.append(
                        {
                            "model": row["model"],
                            "version": row["version"],
                            "file": f["name"],
                            "size": f["size"],
                            "sha256": f["sha256"],
                            "repo": row["repo"],
                            "commit": row["commit"],
                            "url": f"/files/{path}",
                        }
                    )
        return web.json_response({"files": files})

    async def one(request: web.Request) -> web.StreamResponse:
        if not allowed(request):
            return _denied()
        model, version, name = (request.match_info[k] for k in ("model", "version", "file"))
        f = state.verified(model, version, name) if all(valid_name(x) for x in (model, version, name)) else None
        path = root / model / version / name if f is not None else None
        if f is None or path is None or not path.is_file():
            return web.json_response(
                {"error": {"message": f"this mirror holds no {model}/{version}/{name}"}}, status=404
            )
        return web.FileResponse(path, headers={"X-Llmgw-Sha256": f.sha256 or "", "Cache-Control": "no-cache"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/files/", listing)
    app.router.add_get("/files", listing)
    app.router.add_get("/files/{model}/{version}/{file}", one)
    return app
