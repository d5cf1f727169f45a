"""The HTTP surface, answering as ``vllm serve`` with ``extract_hidden_states`` does for the requests
speculators' clients send (``speculators/data_generation/vllm_client.py``):

    POST /v1/completions        prompt: token ids or text; max_tokens 1
    POST /v1/chat/completions   messages, rendered with the tokenizer's chat template
                                (add_generation_prompt, continue_final_message)
    GET  /v1/models, GET /health
    GET / DELETE /<file>.safetensors   a file under --hidden-states-path, for a trainer on another
                                host (what speculators' ``http`` hidden-states backend asks of
                                its ``scripts/serve_hs.py``)

A completion answers with ``choices[0].prompt_token_ids`` (chat: ``prompt_token_ids`` at the top)
when ``return_token_ids`` is asked, one sampled token, and ``kv_transfer_params:
{"hidden_states_path": ...}``. Errors are OpenAI-shaped: a request that cannot be served as sent
is a 400 naming the problem, a capture that failed its checks a 500 for that request only, a dead
engine a 503 (``/health`` too).
"""

# (no ``from __future__ import annotations``: FastAPI reads the handlers' annotations, and Request
# is imported inside build_app)
import time
import uuid

from ..errors import CaptureError
from .service import RequestError, Served, Service


def build_app(service: Service):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="speculators-compat serve")
    error = _error

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise RequestError(f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != service.model_name:
            raise RequestError(f"the model `{model}` does not exist: this server serves `{service.model_name}`")
        n = body.get("max_tokens")
        if n is not None and n != 1:
            raise RequestError(f"max_tokens must be 1 (prefill states and one sampled token), not {n!r}")
        return body

    async def answer(request: Request, chat: bool) -> JSONResponse:
        if service.loop.dead is not None:
            return error(503, f"the engine failed: {service.loop.dead}", "ServiceUnavailableError")
        try:
            body = await body_of(request)
            ids = service.chat_ids(body) if chat else service.prompt_ids(body.get("prompt"))
            served = await service.serve(ids, request.is_disconnected)
        except RequestError as e:
            return error(400, str(e), "BadRequestError")
        except CaptureError as e:
            return error(500, f"this request's capture failed its checks: {e}", "InternalServerError")
        except RuntimeError as e:  # the loop's EngineDead, or the engine failing under this request
            return error(503, str(e), "ServiceUnavailableError")
        return JSONResponse(_response(service, served, chat, bool(body.get("return_token_ids"))))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": service.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "speculators-compat",
            "max_model_len": service.max_len + 1,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if service.loop.dead is not None:
            return error(503, f"the engine failed: {service.loop.dead}", "ServiceUnavailableError")
        return {"status": "ok", "in_flight": service.loop.in_flight, "served": service.loop.served}

    _file_routes(app, service)
    return app


def _file_routes(app, service: Service) -> None:
    """GET / DELETE of a finished file under --hidden-states-path (a trainer on another host)."""
    from fastapi.responses import FileResponse, Response

    @app.get("/{name}")
    async def get_file(name: str):
        path = service.file(name)
        if path is None:
            return _error(404, f"no hidden-states file {name!r} here", "NotFoundError")
        return FileResponse(path, media_type="application/octet-stream")

    @app.delete("/{name}")
    async def delete_file(name: str):
        path = service.file(name)
        if path is not None:
            service.delete(path)
        return Response(status_code=204)


def _error(status: int, message: str, kind: str):
    """An OpenAI-shaped error answer."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _response(service: Service, s: Served, chat: bool, token_ids: bool) -> dict:
    text = service.text(s.token)
    usage = {"prompt_tokens": len(s.prompt), "completion_tokens": 1, "total_tokens": len(s.prompt) + 1}
    common = {
        "created": int(time.time()),
        "model": service.model_name,
        "usage": usage,
        "kv_transfer_params": {"hidden_states_path": s.path},
    }
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        if token_ids:
            choice["token_ids"] = [s.token]
        out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "choices": [choice], **common}
        if token_ids:
            out["prompt_token_ids"] = s.prompt
        return out
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    if token_ids:
        choice.update(token_ids=[s.token], prompt_token_ids=s.prompt)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "choices": [choice], **common}
