"""GET /v1/models: the one model the dense service serves."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from gateway.errors import ERROR_RESPONSES

router = APIRouter()
STARTED = int(time.time())


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    info = await request.app.state.client.info()
    return ModelList(data=[Model(id=info.name, created=STARTED, max_model_len=info.context_length)])
