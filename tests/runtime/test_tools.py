"""Tool calling (runtime/tools.py): OpenAI's tools and tool_choice through the chat template, as transformers
renders them; calls parsed into OpenAI's form; ``required`` and a named function constrained so that the call always
parses, and exact for every draft source, alone and in a batch, streamed or not; one sentence for bad input."""

from __future__ import annotations

import json

import httpx
import pytest
from decode_checks import concurrently
from serving import Server
from specdeploy.runtime import load
from specdeploy.runtime.bundle import TokenizerInfo
from specdeploy.runtime.text import TextCodec
from specdeploy.runtime.tools import ToolCallParser, ToolError, ToolSpec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CONVERT = {"type": "function", "function": {
    "name": "convert_currency", "description": "Convert an amount between currencies.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["amount", "to"],
                   "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 9999},
                                  "to": {"enum": ["EUR", "USD", "JPY"]}}}}}
TOOLS = [WEATHER, CONVERT]
ASKS = ["What's the weather in Oslo?", "Convert 20 dollars to euros.", "Is it raining in Lima right now?"]

# Qwen2.5's chat template as its tokenizer_config.json carries it (the tools part and the tool messages).
QWEN_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.' }}\n    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more "
    "functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n"
    "    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == "
    "\"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n            {{- '\\n' + "
    "message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role "
    "!= \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}"
    "\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
HISTORY = [{"role": "user", "content": "Weather in Oslo and in Åre?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Åre"}'}}]},
           {"role": "tool", "tool_call_id": "a", "content": '{"temp": 3}'},
           {"role": "tool", "tool_call_id": "b", "content": '{"temp": -8}'},
           {"role": "assistant", "content": "Oslo is at 3, Åre at -8."},
           {"role": "user", "content": "Thanks!"}]


def test_bad_tools_and_choices_are_one_sentence_each():
    for tools, choice, match, param in [
        ([{"type": "function", "function": {"description": "no name"}}], None, "has no name", "tools"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "letters, digits", "tools"),
        ([WEATHER, WEATHER], None, "same function name", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, "an object",
         "tools"),
        ([{"type": "retrieval"}], None, "type 'function'", "tools"),
        (TOOLS, {"type": "function", "function": {"name": "send_email"}}, "'send_email', which is not", "tool_choice"),
        (TOOLS, "sometimes", "is not one of", "tool_choice"),
        (None, "required", "needs tools", "tool_choice"),
    ]:
        with pytest.raises(ToolError, match=match) as err:
            ToolSpec.parse(tools, choice)
        assert err.value.param == param and str(err.value).endswith(".") and ". " not in str(err.value)
    assert ToolSpec.parse(None, None) is None and ToolSpec.parse([], "auto") is None
    spec = ToolSpec.parse(TOOLS, {"type": "function", "function": {"name": "convert_currency"}})
    assert spec.forced and [t["function"]["name"] for t in spec.allowed()] == ["convert_currency"]
    assert not ToolSpec.parse(TOOLS, "none").shown and ToolSpec.parse(TOOLS).choice == "auto"


def test_calls_parse_into_openai_form_and_streamed_text_stops_before_them():
    hermes = ToolCallParser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "convert_currency", "arguments": {"amount": 3, "to": "EUR"}}\n</tool_call>')
    content, calls = hermes.parse(text)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "convert_currency"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"amount": 3, "to": "EUR"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    for cut in range(len(text) + 1):  # whatever has streamed so far, nothing of a call is content
        assert hermes.content_end(text[:cut]) <= len(content)
    assert hermes.content_end("Sunny all day.") == len("Sunny all day.") and hermes.content_end("Sunny <tool") == 5
    assert hermes.parse("No tools needed.") == ("No tools needed.", ())
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert hermes.parse(broken) == (broken, ())  # what does not parse stays content
    cut_off = text[: text.rindex('"to"')]  # the length limit cut the second call: the first is kept
    assert [c["function"]["name"] for c in hermes.parse(cut_off)[1]] == ["get_weather"]
    llama = ToolCallParser("llama3-json")
    content, calls = llama.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}')
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima"}
    assert llama.content_end("{\"na") == 0 and llama.content_end("It is sunny.") == len("It is sunny.")
    assert ToolCallParser("hermes", forced=True).content_end("<tool_call>\n{") == 0


def test_a_template_with_tools_renders_them_as_transformers_does(smol_tokenizer_dir):
    """Qwen2.5's template (tools, earlier calls with their arguments, tool results) through the lean runtime's
    jinja2, against transformers' apply_chat_template; SmolLM2's has no tools and gets the generic rendering."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    info = TokenizerInfo(**{**vars(_smol_info(smol_tokenizer_dir)), "chat_template": QWEN_TEMPLATE})
    qwen = TextCodec(smol_tokenizer_dir, info, {"tools": None, "documents": None}, "hermes")
    assert qwen.renders_tools and qwen.tool_call_format == "hermes"
    hf_history = [m | {"tool_calls": [{"type": "function", "function": {
        "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]}
        if m.get("tool_calls") else m for m in HISTORY]
    for tools in (TOOLS, None):
        want = ref.apply_chat_template(hf_history, tools=tools, chat_template=QWEN_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
        got = qwen.render_tool_chat(HISTORY, ToolSpec.parse(tools))
        assert got == want
    assert '"name": "get_weather", "arguments": {"city": "Åre"}' in got  # key order and non-ASCII kept

    smol = TextCodec(smol_tokenizer_dir, _smol_info(smol_tokenizer_dir), {"tools": None}, "llama3-json")
    assert not smol.renders_tools and smol.tool_call_format == "hermes"
    text = smol.render_tool_chat(HISTORY, ToolSpec.parse(TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(CONVERT, ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Åre"}}\n</tool_call>' in text
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response>\n<tool_response>\n{\"temp\": -8}"
            "\n</tool_response><|im_end|>") in text
    assert smol.render_tool_chat(HISTORY[:1], ToolSpec.parse(TOOLS, "none")) == smol.render_chat(HISTORY[:1])


def _smol_info(tokenizer_dir) -> TokenizerInfo:
    template = (tokenizer_dir / "chat_template.jinja").read_text()
    return TokenizerInfo(file="tokenizer.json", chat_template=template, bos_token=None, eos_token="<|im_end|>")


def test_required_and_named_calls_always_parse_and_stay_exact(tiny_bundle):
    """The random model answers with calls that parse, name an allowed function and match its schema, whatever
    it would say unconstrained; speculation, batching and streaming leave them token for token the same."""
    msgs = [[{"role": "user", "content": a}] for a in ASKS]
    named = {"type": "function", "function": {"name": "convert_currency"}}
    runs = [("required", True), ("required", False), (named, True)]
    with load(tiny_bundle, draft=None) as plain:
        want = {str(c): [plain.generate(messages=m, tools=TOOLS, tool_choice=c, parallel_tool_calls=p,
                                        max_new_tokens=64) for m in msgs] for c, p in runs}
        free = plain.generate(messages=msgs[0], tools=TOOLS, max_new_tokens=24)
    assert free.tool_calls == () and free.finish_reason == "length"  # auto: the random model's text, no call
    for (choice, parallel), (key, answers) in zip(runs, want.items()):
        for a in answers:
            assert a.finish_reason in ("tool_calls", "length") and a.tool_calls and a.text == "", a
            for call in a.tool_calls[: 1 if a.finish_reason == "length" else None]:
                args = json.loads(call["function"]["arguments"])
                if choice is named:
                    assert call["function"]["name"] == "convert_currency"
                if call["function"]["name"] == "convert_currency":
                    assert set(args) <= {"amount", "to"} and args["to"] in ("EUR", "USD", "JPY")
                else:
                    assert set(args) <= {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 24
            if not parallel or choice is named:
                assert len(a.tool_calls) == 1
    for draft, max_batch in (("prompt-lookup", 1), ("auto", 1), ("auto", 4)):
        with load(tiny_bundle, draft=draft, max_batch=max_batch) as spec:
            for choice, parallel in runs:
                kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel, "max_new_tokens": 64}
                got = concurrently(spec, msgs, msgs, **kw) if max_batch > 1 else \
                    [spec.generate(messages=m, **kw) for m in msgs]
                assert [g.token_ids for g in got] == [w.token_ids for w in want[str(choice)]], (draft, choice)
                assert [[c["function"] for c in g.tool_calls] for g in got] == \
                    [[c["function"] for c in w.tool_calls] for w in want[str(choice)]]
            stream = spec.stream(messages=msgs[1], tools=TOOLS, tool_choice="required", max_new_tokens=64)
            assert "".join(stream) == "" and stream.completion.token_ids == want["required"][1].token_ids


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    srv = Server(tiny_bundle, tmp_path_factory.mktemp("serve_tools") / "server.log", "--draft", "auto")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_the_openai_client_gets_tool_calls_streamed_or_not(server, tiny_bundle):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = tiny_bundle.name
    kw = {"model": model, "messages": [{"role": "user", "content": ASKS[0]}], "tools": TOOLS, "max_tokens": 64,
          "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "convert_currency")
    json.loads(call.function.arguments)
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if not chunk.choices:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or ():
            entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == choice.finish_reason
    assert streamed == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    # the call and its result go back through the template: a request with the whole history is served
    history = [*kw["messages"], {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 4}'}]
    answer = client.chat.completions.create(**{**kw, "messages": history, "tool_choice": "none"})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


def test_bad_tool_requests_are_400_with_one_sentence(server, tiny_bundle):
    body = {"model": tiny_bundle.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}
    for extra, param, words in [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
         "Missing required parameter"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among the request's tools"),
        ({"tools": [bad_schema], "tool_choice": "required"}, "tools", "parameters schema cannot be used"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id", "without a tool_call_id"),
    ]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body | extra, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and words in err["message"], (extra, err)
        assert err["message"].count(". ") == 0, err["message"]


def test_clients_users_have_get_parsed_objects_unchanged(server, tiny_bundle):
    """The OpenAI SDK's ``parse()`` with a pydantic model (a strict json_schema) and instructor, both in its
    default tools mode (a named tool_choice) and its JSON-schema mode: each returns a validated object."""
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel, ConfigDict, Field

    class City(BaseModel):
        model_config = ConfigDict(extra="forbid")  # else a random model may add keys until max_tokens
        name: str = Field(max_length=8)
        population: int = Field(ge=0, le=9999)
        capital: bool

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Describe Oslo as JSON."}]
    parsed = client.chat.completions.parse(model=tiny_bundle.name, messages=msgs, response_format=City,
                                           max_tokens=160, temperature=0).choices[0].message.parsed
    assert isinstance(parsed, City) and len(parsed.name) <= 8
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        city = instructor.from_openai(client, mode=mode).chat.completions.create(
            model=tiny_bundle.name, messages=msgs, response_model=City, max_tokens=160, temperature=0, max_retries=0)
        assert isinstance(city, City) and 0 <= city.population <= 9999, mode
