"""``chat_template`` (``--chat-template FILE`` on the server): a template of the operator's choosing
replaces the model's own, offline and in the server; a missing file or a template that does not parse
is an error naming the field, and other engines keep the model's template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.server import SMALL_ENGINE_ARGS, TOOL_TEMPLATE, RemoteServer
from pagedllm import SamplingParams

TEMPLATE = (
    "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "[SYSTEM] Be brief.\n[USER] Hi there\n[ASSISTANT]"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "plain.jinja"
    path.write_text(TEMPLATE)
    return path


def test_offline_chat_uses_the_given_template(make_llm: Any, default_llm: Any, template_file: Path) -> None:
    llm = make_llm(chat_template=str(template_file), num_kv_blocks=64, max_model_len=512)
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == RENDERED
    # The template can also be given inline; the default engine keeps the model's own.
    inline = make_llm(chat_template=TEMPLATE, num_kv_blocks=64, max_model_len=512)
    assert inline.llm_engine.apply_chat_template(CHAT) == RENDERED
    assert default_llm.llm_engine.apply_chat_template(CHAT) != RENDERED
    assert "<|im_start|>" in default_llm.llm_engine.apply_chat_template(CHAT)
    # The default model's own template has no tools section: conversations with tools are rendered
    # with the shipped one, exactly as an engine given that template renders them; a template given
    # with chat_template replaces the model's and gets no shipped one.
    shipped = make_llm(chat_template=str(TOOL_TEMPLATE), num_kv_blocks=16, max_model_len=512)
    with_tools = default_llm.llm_engine.apply_chat_template(CHAT, tools=TOOLS)
    assert with_tools == shipped.llm_engine.apply_chat_template(CHAT, tools=TOOLS)
    assert '"name": "get_weather"' in with_tools and "<tools>" in with_tools
    with pytest.raises(ValueError, match="tools: the chat template does not render tools"):
        llm.llm_engine.apply_chat_template(CHAT, tools=TOOLS)
    llm.llm_engine.check_idle()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("/nonexistent/template.jinja", "chat_template: no such file"),
        ("{% for m in messages %}{{ m.content }}", "chat_template does not parse"),
    ],
)
def test_bad_templates_name_the_field(make_llm: Any, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_llm(chat_template=value, num_kv_blocks=16, max_model_len=512)


@pytest.mark.slow
def test_server_flag(template_file: Path) -> None:
    args = [*SMALL_ENGINE_ARGS, "--chat-template", str(template_file)]
    with RemoteServer([*args, "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]) as srv:
        # Tool flags with a template that cannot render tools: a warning at start-up, 400s on tools.
        assert "requests with tools will be refused" in srv.log_tail(200)
        refused = httpx.post(
            srv.url("/v1/chat/completions"),
            json={"messages": CHAT, "tools": TOOLS, "max_tokens": 1},
            timeout=60,
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
        want = httpx.post(srv.url("/tokenize"), json={"prompt": RENDERED}, timeout=30).json()["tokens"]
        got = httpx.post(srv.url("/tokenize"), json={"messages": CHAT}, timeout=30).json()["tokens"]
        assert got == want
        reply = httpx.post(
            srv.url("/v1/chat/completions"), json={"messages": CHAT, "max_tokens": 1}, timeout=60
        ).json()
        assert reply["usage"]["prompt_tokens"] == len(want)
