"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's bodies and answers),
served with ``--enable-runtime-lora-updating`` only (else the routes do not exist: 404).

Loading checks the adapter's folder and configuration at once (a 400 naming the field at fault) and
gives it the next integer id (ids are never reused, so the engine never confuses two adapters); its
weights are read by the engine on its first request. Unloading removes the name at once: new requests
naming it get a 404, requests already running with it finish with it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.field_checks import check_fields
from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.errors import RequestError
from pagedllm.lora.peft_config import read_adapter_config
from pagedllm.lora_request import LoRARequest

router = APIRouter()


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _modules(raw_request: Request) -> dict[str, LoRARequest]:
    modules: dict[str, LoRARequest] = raw_request.app.state.serving.completion.lora_modules
    return modules


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    check_fields(request)
    modules = _modules(raw_request)
    name = request.lora_name.strip()
    served = raw_request.app.state.serving.served_model_names
    if not name:
        raise OpenAIError("lora_name must not be empty.", param="lora_name")
    if name in modules or name in served:
        raise OpenAIError(
            f"The lora adapter '{name}' has already been loaded (or is the base model's name).",
            param="lora_name",
        )
    if not request.lora_path:
        raise OpenAIError("lora_path must name the adapter's folder.", param="lora_path")
    state = raw_request.app.state
    next_id = getattr(state, "next_lora_id", max((m.lora_int_id for m in modules.values()), default=0) + 1)
    lora = LoRARequest(name, next_id, request.lora_path)
    try:
        read_adapter_config(lora, raw_request.app.state.serving_settings.max_lora_rank)
    except RequestError as exc:
        raise OpenAIError(exc.message, param="lora_path") from None
    state.next_lora_id = next_id + 1
    modules[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    check_fields(request)
    modules = _modules(raw_request)
    lora = modules.get(request.lora_name)
    if lora is None:
        raise OpenAIError(
            f"The lora adapter '{request.lora_name}' cannot be found.",
            status_code=404,
            param="lora_name",
            code="model_not_found",
        )
    if request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id:
        raise OpenAIError(
            f"The lora adapter '{request.lora_name}' has id {lora.lora_int_id}, not {request.lora_int_id}.",
            param="lora_int_id",
        )
    del modules[request.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
