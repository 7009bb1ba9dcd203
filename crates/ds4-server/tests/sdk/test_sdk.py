"""The official openai and anthropic Python SDKs against `ds4 serve` on the tiny synthetic
model, through every endpoint, streaming and not. Random weights give random text, so the
tool-call and reasoning tests write the server's --test-force-output file first; the
sampled path is tested with it empty. Run through run.sh (it starts the server)."""

import json
import os
import sys
import traceback

import anthropic
import openai

BASE = os.environ["DS4_BASE"]  # http://127.0.0.1:PORT
KEY = os.environ["DS4_KEY"]
FORCE = os.environ["DS4_FORCE_FILE"]

oa = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
an = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)

TOOL_OUT = (
    "Need the file.</think>Reading.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="read_file">\n'
    '<｜DSML｜parameter name="path" string="true">src/main.rs</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="limit" string="false">25</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
ARGS = {"path": "src/main.rs", "limit": 25}
OA_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                           "limit": {"type": "integer"}}}}}]
AN_TOOLS = [{"name": "read_file", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
USER = [{"role": "user", "content": "Show me src/main.rs"}]


def force(text):
    with open(FORCE, "w", encoding="utf-8") as f:
        f.write(text)


TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


@test
def openai_models():
    ids = [m.id for m in oa.models.list()]
    assert ids == ["deepseek-v4-flash"], ids


@test
def openai_chat_sampled():
    force("")
    r = oa.chat.completions.create(model="deepseek-chat", messages=USER, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length", r
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens > 5
    chunks = list(oa.chat.completions.create(model="deepseek-chat", messages=USER, max_tokens=5,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content, (text, r.choices[0].message.content)
    assert chunks[-1].usage.completion_tokens == 5
    r = oa.chat.completions.create(model="deepseek-chat", messages=USER, max_tokens=3, temperature=0,
                                   logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp), lp
    assert lp[0].logprob == lp[0].top_logprobs[0].logprob  # greedy picks the best


@test
def openai_chat_tool_call_and_reasoning():
    force(TOOL_OUT)
    r = oa.chat.completions.create(model="deepseek-v4-flash", messages=USER, tools=OA_TOOLS)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.content == "Reading."
    assert m.model_extra["reasoning_content"] == "Need the file."
    tc = m.tool_calls[0]
    assert tc.id.startswith("call_") and tc.function.name == "read_file"
    assert json.loads(tc.function.arguments) == ARGS
    # Streaming: deltas accumulate into the same call.
    args, name, reasoning, content, finish = "", None, "", "", None
    for c in oa.chat.completions.create(model="x", messages=USER, tools=OA_TOOLS, stream=True):
        d = c.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            name = t.function.name or name
            args += t.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert (reasoning, content, name, finish) == ("Need the file.", "Reading.", "read_file", "tool_calls")
    assert json.loads(args) == ARGS
    # Next turn with the tool result: reuses the live session (cached tokens).
    force("ok</think>25 lines.")
    r2 = oa.chat.completions.create(model="x", tools=OA_TOOLS, messages=USER + [
        {"role": "assistant", "content": "Reading.", "reasoning_content": "Need the file.",
         "tool_calls": [{"id": tc.id, "type": "function",
                         "function": {"name": "read_file", "arguments": tc.function.arguments}}]},
        {"role": "tool", "tool_call_id": tc.id, "content": "fn main() {}"}])
    assert r2.choices[0].message.content == "25 lines."
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


@test
def openai_completions():
    force("")
    r = oa.completions.create(model="deepseek-v4-flash", prompt="Once upon", max_tokens=4, seed=7)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4, r
    force("one two STOP three")
    r = oa.completions.create(model="m", prompt="count", stop=["STOP"], max_tokens=50)
    assert r.choices[0].text == "one two " and r.choices[0].finish_reason == "stop", r
    text = "".join(c.choices[0].text for c in oa.completions.create(
        model="m", prompt="count", stop="STOP", max_tokens=50, stream=True) if c.choices)
    assert text == "one two ", text


@test
def openai_responses():
    force(TOOL_OUT)
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]
    r = oa.responses.create(model="deepseek-v4-flash", input="Show me src/main.rs", tools=tools,
                            reasoning={"effort": "high", "summary": "auto"})
    assert r.status == "completed"
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message", "function_call"], kinds
    assert r.output_text == "Reading."
    assert json.loads(r.output[2].arguments) == ARGS
    events = list(oa.responses.create(model="m", input="Show me", tools=tools, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Reading."
    force("")
    r = oa.responses.create(model="m", input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.usage.output_tokens == 3


@test
def openai_errors():
    try:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 5000}])
        raise AssertionError("expected a context-length error")
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", e.body
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("expected 401")
    except openai.AuthenticationError:
        pass


@test
def anthropic_messages():
    force(TOOL_OUT)
    m = an.messages.create(model="deepseek-v4-flash", max_tokens=300, messages=USER, tools=AN_TOOLS,
                           thinking={"type": "enabled", "budget_tokens": 100})
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "Need the file."
    assert m.content[1].text == "Reading."
    assert m.content[2].input == ARGS and m.content[2].id.startswith("toolu_")
    with an.messages.stream(model="m", max_tokens=300, messages=USER, tools=AN_TOOLS) as s:
        text = "".join(s.text_stream)
        fm = s.get_final_message()
    assert text == "Reading."
    assert [b.type for b in fm.content] == ["thinking", "text", "tool_use"]
    assert fm.content[2].input == ARGS and fm.stop_reason == "tool_use"
    # Tool result turn.
    force("ok</think>Done.")
    m2 = an.messages.create(model="m", max_tokens=300, tools=AN_TOOLS, messages=USER + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[2].id,
                                      "content": "fn main() {}"}]}])
    assert m2.content[-1].text == "Done.", m2
    assert m2.usage.cache_read_input_tokens > 0
    force("")
    m3 = an.messages.create(model="m", max_tokens=4, messages=USER, thinking={"type": "disabled"})
    assert m3.stop_reason == "max_tokens" and m3.usage.output_tokens == 4, m3
    assert m3.content[0].type == "text"


@test
def anthropic_count_tokens_and_errors():
    n = an.messages.count_tokens(model="m", messages=USER, tools=AN_TOOLS).input_tokens
    n0 = an.messages.count_tokens(model="m", messages=USER).input_tokens
    assert n > n0 > 0, (n, n0)
    try:
        an.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "word " * 5000}])
        raise AssertionError("expected 400")
    except anthropic.BadRequestError as e:
        assert "context size" in str(e), e
    bad = anthropic.Anthropic(base_url=BASE, api_key="wrong", max_retries=0)
    try:
        bad.messages.create(model="m", max_tokens=1, messages=USER)
        raise AssertionError("expected 401")
    except anthropic.AuthenticationError:
        pass


def main():
    passed = failed = 0
    for t in TESTS:
        try:
            t()
            passed += 1
            print(f"ok     {t.__name__}")
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAILED {t.__name__}")
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
