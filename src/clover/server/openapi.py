"""The request bodies in the served OpenAPI spec (`/openapi.json`).

The POST routes read their JSON themselves (`transport.read_body`: content type, size, read
deadline; `prompts.parse_json`: depth, surrogates) and only then validate it with the pydantic
models of `protocol.py`, so FastAPI cannot see what they take and the spec would show bodiless
operations. This writes each
model's JSON schema, self-contained, into its route's `requestBody`: what API clients and schema
fuzzers (schemathesis, `tests/test_openapi_fuzz.py`) read. The models allow extra fields, and the
schema says so; the block-diffusion extras are listed in docs/serving.md.
"""

from __future__ import annotations

from pydantic import BaseModel


def document_request_bodies(app, bodies: dict[str, tuple[type[BaseModel], dict]], served_model: str) -> None:
    """Give the routes at the paths in `bodies` a required JSON request body: the model's schema, its
    `model` field the one name this server answers to (any other is a 404), and an example body."""
    for route in app.routes:
        model, example = bodies.get(getattr(route, "path", None), (None, None))
        if model is not None:
            schema = inline_schema(model)
            schema["properties"]["model"] = {**schema["properties"]["model"], "enum": [served_model]}
            route.openapi_extra = {"requestBody": {"required": True, "content": {"application/json": {
                "schema": schema, "example": {"model": served_model, **example}}}}}


def inline_schema(model: type[BaseModel]) -> dict:
    """`model`'s JSON schema with every `#/$defs/…` reference replaced by the definition itself (the
    spec's components then need nothing from us; the request models are not recursive)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node, seen=()):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                name = ref.rsplit("/", 1)[1]
                if name in seen:
                    raise ValueError(f"{model.__name__}: recursive schema through {name}")
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**resolve(defs[name], seen + (name,)), **resolve(rest, seen)}
            return {k: resolve(v, seen) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, seen) for v in node]
        return node

    return resolve(schema)
