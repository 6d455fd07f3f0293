"""Spot checks over HTTP (swarm.leader.serving.verify), for admins.

- ``GET /api/v1/verification``: the fraction of passes checked, checks and failures so far, suspects, and the alerts
  of fellows taken out of service, each with the requests (ids, users) served through the bad stage since its last
  good check.
- ``PUT /api/v1/verification`` ``{"fraction": 0.02}``: the admin switch (0: off); kept across restarts.
  SWARM_SERVE_VERIFY, when set, wins.
"""

from __future__ import annotations

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from swarm.errors import BadRequest, Forbidden
from swarm.leader.api.auth import current_user
from swarm.leader.api.http_errors import json_body
from swarm.leader.api.rest import handles_errors
from swarm.leader.serving.verify import VERIFY


class VerifyRoutes:
    def __init__(self, leader):
        self.leader = leader
        self.store = leader.store

    @handles_errors
    async def verification(self, request: Request):
        user = await current_user(request, self.store)
        if not user.is_admin:
            raise Forbidden("this needs an admin account.")
        verifier = self.leader.serving.verifier
        if request.method == "PUT":
            body = await json_body(request)
            fraction = body.get("fraction")
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise BadRequest('send {"fraction": F}, F the share of passes checked from 0 (off) to 1, such as '
                                 "0.02.", "invalid_fraction")
            await trio.to_thread.run_sync(self.store.set_setting, VERIFY, float(fraction))
            verifier.stored_fraction = float(fraction)
            await verifier.cover_all()  # checkers for the models already serving
        view = verifier.view()
        names = await trio.to_thread.run_sync(self._user_names, view["alerts"])
        for alert in view["alerts"]:
            alert["requests"] = [{**r, "user": names.get(r["user_id"])} for r in alert["requests"]]
        return JSONResponse(view)

    def _user_names(self, alerts: list[dict]) -> dict:
        ids = {r["user_id"] for a in alerts for r in a["requests"] if r["user_id"] is not None}
        users = (self.store.get_user(i) for i in ids)
        return {u.id: u.name for u in users if u is not None}


def verify_routes(leader) -> list[Route]:
    routes = VerifyRoutes(leader)
    return [Route("/api/v1/verification", routes.verification, methods=["GET", "PUT"])]
