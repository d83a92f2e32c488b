"""GET /healthz, /readyz and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from memlm.api import Health
from service.deps import State
from service.errors import error_responses

router = APIRouter(tags=["health"])


@router.get(
    "/healthz", response_model=Health, response_model_exclude_none=True, summary="The process is up"
)
async def healthz() -> Health:
    # async: answered on the event loop itself, never behind the model queue or the
    # thread pool that busy requests fill
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses=error_responses(503),
    summary="Model and index loaded",
)
def readyz(state: State) -> Response:
    if state.engine is None:
        reason = "model failed to load" if state.load_error else "model loading"
        return JSONResponse({"error": "unavailable", "detail": reason}, status_code=503)
    encoder = getattr(state.engine, "encoder", None)  # test fakes have none
    body = Health(
        status="ready",
        model=state.settings.model,
        index_version=state.served_version,
        calibrator_version=state.calibrator_version,
        device=None if encoder is None else str(encoder.device),
        precision=getattr(encoder, "precision", None),
    )
    return JSONResponse(body.model_dump())


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
