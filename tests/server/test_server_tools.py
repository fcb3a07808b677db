"""Tools through ``localchat serve``: a tiny model whose chat template offers tools, replies
scripted to call one (``scripted_serve.py``), the official clients on both APIs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving import post
from tiny import build_tiny_model

from localchat.store.database import Store

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\nTo call one, answer "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content }}{% for tool_call in message.tool_calls %}"
    "{% set tool_call = tool_call.function %}<tool_call>\n{\"name\": \"{{ tool_call.name }}\", "
    "\"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seoul"}}\n</tool_call>'
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tiny_tool_model(folder: Path) -> Path:
    """The tiny llama at ``folder`` with a chat template that offers tools (mlx-lm's JSON tool
    parser)."""
    folder = build_tiny_model(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    return tiny_tool_model(tmp_path_factory.mktemp("tools") / "tiny-tools")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_calls_and_results(server, tool_model, tmp_path, stream):
    s = server(model=tool_model, scripted=["Let me look. " + CALL, "It is sunny in Seoul."])
    client = s.openai()
    history = [{"role": "user", "content": "What is the weather in Seoul?"}]
    if stream:
        text, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(model="localchat", messages=history,
                                                    tools=WEATHER, stream=True, temperature=0):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for c in delta.tool_calls or []:
                calls[c.index] = c
            finish = chunk.choices[0].finish_reason or finish
        assert "<tool_call>" not in text and text.strip() == "Let me look."
        (call,) = calls.values()
    else:
        one = client.chat.completions.create(model="localchat", messages=history,
                                             tools=WEATHER, temperature=0)
        finish, (call,) = one.choices[0].finish_reason, one.choices[0].message.tool_calls
        assert one.choices[0].message.content.strip() == "Let me look."
    assert finish == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Seoul"}
    history += [{"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": call.id, "type": "function", "function": {
                        "name": "get_weather", "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    two = client.chat.completions.create(model="localchat", messages=history, tools=WEATHER,
                                         temperature=0)
    assert two.choices[0].message.content == "It is sunny in Seoul."
    assert two.choices[0].finish_reason == "stop"
    # The request continued the same conversation, from its cache.
    assert two.usage.prompt_tokens_details.cached_tokens > 0.6 * two.usage.prompt_tokens
    s.stop()
    store = Store.open(tmp_path / "home" / "localchat.db")
    (conv,) = store.list()
    roles = [(m.role, bool(m.extra)) for m in store.messages(conv)]
    assert roles == [("user", False), ("assistant", True), ("tool", True), ("assistant", False)]


def test_anthropic_tool_use_and_results(server, tool_model, tmp_path):
    s = server(model=tool_model, scripted=[CALL, "It is sunny in Seoul."])
    client = s.anthropic()
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    history = [{"role": "user", "content": "What is the weather in Seoul?"}]
    with client.messages.stream(model="localchat", max_tokens=256, tools=tools,
                                messages=history, extra_body={"temperature": 0}) as stream:
        one = stream.get_final_message()
    assert one.stop_reason == "tool_use"
    use = next(b for b in one.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Seoul"}
    history += [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                                   "name": use.name, "input": use.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": "sunny, 21 C"}]}]
    two = client.messages.create(model="localchat", max_tokens=256, tools=tools,
                                 messages=history, extra_body={"temperature": 0})
    assert two.content[0].text == "It is sunny in Seoul." and two.stop_reason == "end_turn"
    assert two.usage.cache_read_input_tokens > 0
    s.stop()


def test_tools_for_a_model_without_tool_calling_are_refused(server):
    s = server("llama")
    status, body = post(f"{s.url}/v1/chat/completions", json.dumps({
        "model": "localchat", "tools": WEATHER,
        "messages": [{"role": "user", "content": "hi"}]}))
    assert status == 400 and "has no tool calling" in body["error"]["message"]
    s.stop()
