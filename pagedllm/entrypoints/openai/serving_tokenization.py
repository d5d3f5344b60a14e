"""``POST /tokenize`` and ``POST /detokenize`` with the served model's tokenizer."""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """Tokenizes prompts and chat conversations exactly as the generation endpoints do."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        self.check_fields(request)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Exactly one of prompt and messages must be given.", param="prompt")
        if request.messages is not None:
            tokens = await self.preprocessor.encode_chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
                add_special_tokens=bool(request.add_special_tokens),
            )
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            (tokens,) = await self.preprocessor.encode(
                [request.prompt or ""], add_special_tokens=add_special, param="prompt"
            )
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.check_fields(request)
        text = await self.preprocessor.decode(request.tokens, self.engine.info.vocab_size)
        return DetokenizeResponse(prompt=text)
