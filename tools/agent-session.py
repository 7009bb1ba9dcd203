#!/usr/bin/env python3
"""A coding agent's session against `ds4 serve`, timed (stdlib only: runs where nothing is installed).

Each turn resends the whole conversation, as Claude Code does: a long system prompt, one tool,
the earlier turns, then a new user message carrying a "tool output". Turns go to /v1/messages
(stream=true, Anthropic SSE); `--openai` sends the last one again to /v1/chat/completions. It prints
one line per request: prompt tokens, tokens reused from the KV cache (live session or disk),
time to the first streamed token and in total. `--save F` writes the request the next turn would
send; `--replay F` sends it (e.g. after restarting the server: the disk KV cache at work).

    python3 tools/agent-session.py --base http://127.0.0.1:8000 --system-words 12000 --turns 3
"""

import argparse
import json
import sys
import time
import urllib.request

PARA = (
    "You are a coding agent working in a large repository. Read files before editing them, "
    "keep changes small, run the tests after every change and report what you ran. "
    "Never invent file contents; when unsure, look. Prefer the project's own helpers. "
)
TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command in the repository and return its output.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    }
]


def system_prompt(words):
    base = PARA.split()
    out = []
    i = 0
    while len(out) < words:
        # Numbered rules so the text is not one period repeated (tokenizers merge those).
        if i % len(base) == 0:
            out.append(f"Rule {i // len(base)}:")
        out.append(base[i % len(base)])
        i += 1
    return " ".join(out)


def tool_output(turn, words):
    lines = [f"test_{turn}_{k} ... ok ({k * 7 % 13} ms)" for k in range(max(1, words // 5))]
    return "\n".join(lines)


def post(base, path, body, stream, timeout):
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer dsv4-local"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def anthropic_turn(args, messages):
    """One streamed /v1/messages request: (assistant content blocks, stats)."""
    body = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "stream": True,
        "system": args.system,
        "tools": TOOLS,
        "messages": messages,
        "thinking": {"type": "disabled"},
    }
    t0 = time.time()
    first = None
    blocks = []
    usage = {}
    with post(args.base, "/v1/messages", body, True, args.timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            ty = ev.get("type")
            if ty == "message_start":
                usage.update(ev["message"].get("usage", {}))
            elif ty == "content_block_start":
                cb = dict(ev["content_block"])
                cb["_json"] = ""
                blocks.append(cb)
            elif ty == "content_block_delta":
                if first is None:
                    first = time.time() - t0
                d = ev["delta"]
                b = blocks[-1]
                if d["type"] == "text_delta":
                    b["text"] += d["text"]
                elif d["type"] == "thinking_delta":
                    b["thinking"] += d["thinking"]
                elif d["type"] == "input_json_delta":
                    b["_json"] += d["partial_json"]
            elif ty == "message_delta":
                usage.update(ev.get("usage", {}))
            elif ty == "error":
                raise RuntimeError(f"server error event: {ev}")
    total = time.time() - t0
    content = []
    for b in blocks:
        j = b.pop("_json")
        if b["type"] == "tool_use":
            try:
                b["input"] = json.loads(j) if j else {}
            except json.JSONDecodeError:
                b["input"] = {}
        if b["type"] == "text" and not b["text"]:
            continue
        if b["type"] == "thinking":
            continue  # a client drops earlier turns' reasoning, as the chat template does
        content.append(b)
    prompt = usage.get("cache_read_input_tokens", 0) + usage.get("cache_creation_input_tokens", 0)
    stats = {
        "api": "anthropic",
        "prompt": prompt,
        "cached": usage.get("cache_read_input_tokens", 0),
        "output": usage.get("output_tokens", 0),
        "ttft_s": first,
        "total_s": total,
    }
    return content, stats


def openai_request(args, messages):
    """The same conversation as an OpenAI chat request (streamed), for its usage and timing."""
    msgs = [{"role": "system", "content": args.system}]
    for m in messages:
        if isinstance(m["content"], str):
            msgs.append({"role": m["role"], "content": m["content"]})
            continue
        text = "".join(b.get("text", "") for b in m["content"] if b["type"] == "text")
        calls = [b for b in m["content"] if b["type"] == "tool_use"]
        results = [b for b in m["content"] if b["type"] == "tool_result"]
        if m["role"] == "assistant":
            a = {"role": "assistant", "content": text or None}
            if calls:
                a["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": json.dumps(c["input"])}}
                    for c in calls
                ]
            msgs.append(a)
        else:
            for res in results:
                msgs.append({"role": "tool", "tool_call_id": res["tool_use_id"],
                             "content": res["content"]})
            if text:
                msgs.append({"role": "user", "content": text})
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    body = {"model": "deepseek-chat", "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "messages": msgs, "tools": tools}
    t0 = time.time()
    first = None
    usage = {}
    with post(args.base, "/v1/chat/completions", body, True, args.timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                d = ch.get("delta", {})
                if first is None and (d.get("content") or d.get("tool_calls")
                                      or d.get("reasoning_content")):
                    first = time.time() - t0
    return {
        "api": "openai",
        "prompt": usage.get("prompt_tokens", 0),
        "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "output": usage.get("completion_tokens", 0),
        "ttft_s": first,
        "total_s": time.time() - t0,
    }


def next_user(turn, content, words):
    """The user message after an assistant turn: a tool result when it called the tool, else
    text that carries the same kind of output."""
    out = tool_output(turn, words)
    calls = [b for b in content if b["type"] == "tool_use"]
    if calls:
        return {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c["id"], "content": out} for c in calls]}
    return {"role": "user", "content": [
        {"type": "text", "text": f"I ran the tests myself; output:\n{out}\nWhat next?"}]}


def show(label, s):
    ttft = "-" if s["ttft_s"] is None else f"{s['ttft_s']:.2f}"
    print(f"{label:<12} api={s['api']:<9} prompt={s['prompt']:>7} cached={s['cached']:>7} "
          f"output={s['output']:>4} first_token_s={ttft:>6} total_s={s['total_s']:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--system-words", type=int, default=12000,
                    help="words in the system prompt (~1.2-1.4 tokens a word)")
    ap.add_argument("--tool-words", type=int, default=400, help="words of each tool output")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--openai", action="store_true",
                    help="also send the last turn's request to /v1/chat/completions (the two APIs\n"
                         "render tools differently, as the reference does: no reuse across them)")
    ap.add_argument("--save", help="write the next turn's request (system + messages) here")
    ap.add_argument("--replay", help="send a request saved by --save")
    ap.add_argument("--json", help="append one JSON line per request to this file")
    ap.add_argument("--check", action="store_true",
                    help="exit 2 unless every request after the first reuses at least the whole\n"
                         "previous request's prompt (a replay: the saving run's last prompt)")
    args = ap.parse_args()

    rows = []
    if args.replay:
        with open(args.replay) as f:
            conv = json.load(f)
        args.system = conv["system"]
        _, s = anthropic_turn(args, conv["messages"])
        show("next turn", s)
        rows.append(s)
        need = [(s, conv.get("last_prompt", 0))]
    else:
        need = []
        last_prompt = 0
        args.system = system_prompt(args.system_words)
        messages = [{"role": "user", "content": "Find why the build fails and fix it."}]
        for t in range(args.turns):
            content, s = anthropic_turn(args, messages)
            show(f"turn {t + 1}", s)
            if t > 0:
                need.append((s, last_prompt))
            last_prompt = s["prompt"]
            rows.append(s)
            if t + 1 == args.turns and args.openai:
                s = openai_request(args, messages)
                show("openai", s)
                rows.append(s)
            messages.append({"role": "assistant",
                             "content": content or [{"type": "text", "text": "..."}]})
            messages.append(next_user(t + 1, content, args.tool_words))
        if args.save:
            # The request the next turn would send (the last answer and a new tool output).
            with open(args.save, "w") as f:
                json.dump({"system": args.system, "messages": messages,
                           "last_prompt": last_prompt}, f)
    if args.check:
        for s, prev in need:
            if s["cached"] < prev:
                print(f"agent-session: check failed: {s['cached']} tokens reused, the previous "
                      f"prompt had {prev}", file=sys.stderr)
                sys.exit(2)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one clear line, not a traceback, when the server is away
        print(f"agent-session: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
