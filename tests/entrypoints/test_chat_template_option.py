"""``chat_template`` (``--chat-template FILE`` on the server): a template of the operator's choosing
replaces the model's own, offline and in the server; a missing file or a template that does not parse
is an error naming the field, and other engines keep the model's template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer
from pagedllm import SamplingParams

TEMPLATE = (
    "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "[SYSTEM] Be brief.\n[USER] Hi there\n[ASSISTANT]"


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
    with RemoteServer([*SMALL_ENGINE_ARGS, "--chat-template", str(template_file)]) as srv:
        want = httpx.post(srv.url("/tokenize"), json={"prompt": RENDERED}, timeout=30).json()["tokens"]
        got = httpx.post(srv.url("/tokenize"), json={"messages": CHAT}, timeout=30).json()["tokens"]
        assert got == want
        reply = httpx.post(
            srv.url("/v1/chat/completions"), json={"messages": CHAT, "max_tokens": 1}, timeout=60
        ).json()
        assert reply["usage"]["prompt_tokens"] == len(want)
