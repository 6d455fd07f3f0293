"""Serving model files to fellows, with HTTP Range so a broken download resumes where it stopped.

Starlette's ``FileResponse`` (1.x) already implements RFC 9110 ranges: ``bytes=N-`` and ``bytes=N-M`` answer 206 with
Content-Range, a start past the end answers 416 with ``Content-Range: bytes */SIZE``, several ranges answer
multipart/byteranges, and If-Range is honoured. This module only adds what the leader knows and Starlette does not:
the file's sha256 as its ETag (stable across copies and mtimes, unlike Starlette's mtime+size digest), a 304 for a
matching If-None-Match, and a plain 404 instead of Starlette's RuntimeError for a missing file.

Authentication stays with the caller: the route checks the fellow's node credential before calling this.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response


def file_response(path: Path, request: Request, sha256: str | None = None) -> Response:
    """A response for GET/HEAD of the model file at ``path``, honouring Range; ETag is ``sha256`` when given."""
    try:
        stat_result = os.stat(path)
    except OSError:
        stat_result = None
    if stat_result is None or not stat.S_ISREG(stat_result.st_mode):
        return PlainTextResponse(f"the leader has no file {Path(path).name}; re-import the model.", status_code=404)

    headers = {"cache-control": "no-cache"}
    if sha256:
        etag = f'"{sha256}"'
        headers["etag"] = etag
        if request.headers.get("range") is None and etag in _etags(request.headers.get("if-none-match")):
            return Response(status_code=304, headers=headers)
    return FileResponse(path, headers=headers, media_type="application/octet-stream", stat_result=stat_result)


def _etags(header: str | None) -> list[str]:
    if not header:
        return []
    return [tag.strip().removeprefix("W/") for tag in header.split(",")]
