"""The OpenAPI document (/openapi.json) with the real request schemas.

Routes read their bodies by hand (convert.parse_request, for OpenAI-shaped 400s and to keep the
raw ASGI receive for disconnect detection), so FastAPI cannot see the body models; this adds
them: each route's ``requestBody`` refers to its pydantic model's JSON schema, placed with its
nested models under ``components/schemas``. Response schemas come from the routes'
``response_model`` / ``responses`` (services/gateway/schemas.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def _add_model(components: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template=REF)
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def install_openapi(app: FastAPI, bodies: dict[str, list[type[BaseModel]]], version: str) -> None:
    """``bodies``: route path -> the model(s) its POST body may be (several: any of them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=version,
            description="OpenAI-compatible API of kvflow (vLLM's request fields and extras).",
            routes=app.routes,
        )
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, models in bodies.items():
            refs = [_add_model(components, m) for m in models]
            schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
