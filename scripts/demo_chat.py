"""Chat-formatted training text for the demo model, built from its corpus (imported by train_demo.py).

The model has to end its turns with `<|im_end|>` and read prompts the way a chat client sends them: system
prompts, tool schemas (JSON) in the system turn, several turns, thinking on or off, and Open WebUI-style
task prompts (titles, follow-ups, tags) that ask for a JSON object. Every answer is corpus text: the verses
after the one the user quotes, or a few of the quoted verse's words in the task's JSON. Tool schemas are
random (names, parameters and descriptions drawn from word lists below), so the tokenizer learns JSON
without learning any real client's tool list.
"""

from __future__ import annotations

import json
import random

VERBS = (
    "get",
    "search",
    "create",
    "update",
    "delete",
    "list",
    "query",
    "fetch",
    "send",
    "read",
    "write",
    "run",
    "generate",
    "find",
    "set",
    "add",
    "remove",
    "view",
    "edit",
    "replace",
    "calculate",
    "open",
)
NOUNS = (
    "memory",
    "memories",
    "note",
    "notes",
    "file",
    "files",
    "image",
    "web",
    "page",
    "calendar",
    "event",
    "user",
    "chat",
    "chats",
    "knowledge",
    "model",
    "channel",
    "channels",
    "folder",
    "document",
    "task",
    "weather",
    "time",
    "timestamp",
    "url",
    "code",
    "message",
    "messages",
    "collection",
    "base",
    "item",
)
PARAMS = (
    "query",
    "id",
    "name",
    "content",
    "url",
    "limit",
    "page",
    "title",
    "start",
    "end",
    "tags",
    "count",
    "file_id",
    "chat_id",
    "note_id",
    "memory_id",
    "collection",
    "language",
    "format",
    "prompt",
    "days",
    "offset",
    "channel_id",
    "message_id",
    "description",
    "size",
    "model",
    "text",
    "path",
    "timezone",
)
TYPES = ("string", "string", "string", "integer", "boolean", "number", "array")
PHRASES = (
    "the user's",
    "a single",
    "the matching",
    "all",
    "the most recent",
    "the given",
    "an existing",
    "a new",
    "the current",
    "the selected",
    "one or more",
    "the requested",
)
EXTRA = ("Use this when the user asks for it.", "Returns a list of results as JSON.",
         "Only call this when the answer is not already in the conversation.",
         "Results are ordered by relevance.", "Returns an empty list when nothing matches.",
         "The result includes an id that other tools accept.",
         "Defaults apply to omitted parameters.")  # fmt: skip
SYSTEMS = ("You are a helpful assistant.", "You are a helpful assistant. Answer briefly.",
           "Answer in the words of the King James Bible.", "You are a concise assistant.",
           "User context:\n- The current date is {date}.\n- The user's name is {name}.")  # fmt: skip
NAMES = ("Ruth", "Aaron", "Miriam", "Jonas", "Lydia", "Silas", "Tabitha", "Enoch")
ASKS = ("{v}", "{v}", "Continue: {v}", "What comes after this verse? {v}", "Go on.\n\n{v}",
        "Please continue the passage: \"{v}\"", "{v} What follows?", "Tell me more.\n{v}")  # fmt: skip
TASKS = {
    "title": ("Generate a short title of 3 to 5 words, with an emoji, for the chat history below.",
              '{ "title": "the title here" }', lambda words: json.dumps({"title": " ".join(words[:4])})),
    "follow_ups": ("Suggest 3 to 5 follow-up questions the user might ask next in this conversation.",
                   '{ "follow_ups": ["Question 1?", "Question 2?", "Question 3?"] }',
                   lambda words: json.dumps({"follow_ups": [" ".join(words[i: i + 5]) + "?"
                                                            for i in (0, 5, 10)]})),
    "tags": ("Generate 1 to 3 broad tags for the main themes of the chat history.",
             '{ "tags": ["tag1", "tag2", "tag3"] }', lambda words: json.dumps({"tags": words[:2]})),
}  # fmt: skip


def random_tool(rng: random.Random) -> dict:
    """One OpenAI-style function tool with a random name, description and parameters."""
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    props, required = {}, []
    for name in rng.sample(PARAMS, rng.randint(0, 4)):
        kind = rng.choice(TYPES)
        prop = {"type": kind, "description": f"{rng.choice(PHRASES).capitalize()} {name.replace('_', ' ')}."}
        if kind == "array":
            prop["items"] = {"type": "string"}
        if kind == "string" and rng.random() < 0.15:
            prop["enum"] = rng.sample(("asc", "desc", "day", "week", "month", "json", "text"), 2)
        if kind in ("integer", "number") and rng.random() < 0.4:
            prop["default"] = rng.choice((5, 10, 20, 50))
        props[name] = prop
        if rng.random() < 0.5:
            required.append(name)
    description = f"{verb.capitalize()} {rng.choice(PHRASES)} {noun}."
    if rng.random() < 0.7:
        description += " " + " ".join(rng.sample(EXTRA, rng.randint(1, 2)))
    params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": f"{verb}_{noun}", "description": description,
                                             "parameters": params}}  # fmt: skip


def tool_json_lines(n: int, seed: int) -> list[str]:
    """`n` random tools as the chat template writes them (one JSON object a line), for the BPE's training."""
    rng = random.Random(seed)
    return [json.dumps(random_tool(rng)["function"], ensure_ascii=False) for _ in range(n)]


def _reply(verses: list[str], i: int, rng: random.Random) -> tuple[int, str]:
    n = rng.choice((1, 1, 2, 2, 3))
    return i + 1 + n, " ".join(verses[i + 1 : i + 1 + n])


def conversation(verses: list[str], rng: random.Random) -> tuple[list[dict], list[dict] | None, str, bool]:
    """(messages before the last reply, tools or None, the last reply, thinking): a chat about verses."""
    i = rng.randrange(0, len(verses) - 12)
    messages = []
    if rng.random() < 0.3:
        system = rng.choice(SYSTEMS).format(date="2026-12-04", name=rng.choice(NAMES))
        messages.append({"role": "system", "content": system})
    tools = [random_tool(rng) for _ in range(rng.randint(1, 8))] if rng.random() < 0.3 else None
    if rng.random() < 0.2:  # a client's background task on an earlier exchange
        kind = rng.choice(sorted(TASKS))
        ask, fmt, answer = TASKS[kind]
        history = f"USER: {verses[i]}\nASSISTANT: {verses[i + 1]}"
        prompt = f"### Task:\n{ask}\n### Output:\nJSON format: {fmt}\n### Chat History:\n<chat_history>\n"
        prompt += f"{history}\n</chat_history>"
        words = [w.strip(",.;:") for w in verses[i].split()]
        return messages + [{"role": "user", "content": prompt}], None, answer(words), False
    for _ in range(rng.choice((0, 0, 1, 2))):  # earlier turns
        messages.append({"role": "user", "content": rng.choice(ASKS).format(v=verses[i])})
        i, reply = _reply(verses, i, rng)
        messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": rng.choice(ASKS).format(v=verses[i])})
    _, reply = _reply(verses, i, rng)
    return messages, tools, reply, rng.random() < 0.25


def render(tokenizer, messages, tools, reply: str, thinking: bool, rng: random.Random) -> str:
    """The conversation as the server renders its prompt, then the reply as the model should write it."""
    prompt = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=thinking)
    if thinking:  # the prompt ends inside <think>: a short thought, then the answer
        thought = f"{reply.split()[0]} {rng.choice(('is asked of me.', 'comes next.', 'is the verse.'))}"
        reply = f"{thought}\n</think>\n\n{reply}"
    return prompt + reply + "<|im_end|>\n"


def chat_text(tokenizer, verses: list[str], n: int, seed: int) -> str:
    """`n` rendered conversations, one after another."""
    rng = random.Random(seed)
    return "".join(render(tokenizer, *conversation(verses, rng), rng) for _ in range(n))
