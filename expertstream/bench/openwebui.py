"""What Open WebUI sends for one chat turn, as `bench serve` replays it: its built-in tools and task prompts.

Open WebUI attaches its 36 built-in tools (about 26 KB of JSON) to every chat message, sends a title task
(non-streaming, `max_tokens` 1000) about two seconds before the chat request, and a follow-ups task and a
tags task (no token limit) after each reply. The tools here are a representative list written for this
bench: the same count, the same kinds of names, parameters and descriptions, about the same size; the task
prompts have the same parts (task, guidelines, output format, chat history).
"""

from __future__ import annotations

import json

# name -> (description, {parameter: (JSON type, description)}, required parameters)
_TOOLS: dict[str, tuple[str, dict[str, tuple[str, str]], tuple[str, ...]]] = {
    "search_web": ("Search the public web and return the top results with their titles, links and snippets.",
                   {"query": ("string", "The search query, in the user's words or a refined form of them."),
                    "count": ("integer", "How many results to return (1 to 10).")}, ("query",)),
    "fetch_url": ("Fetch a web page and return its readable text, without scripts, styles or navigation.",
                  {"url": ("string", "The absolute http or https address of the page.")}, ("url",)),
    "query_knowledge_files": ("Search the files of the knowledge bases attached to this chat and return the "
                              "passages that best match the query, with the file each comes from.",
                              {"query": ("string", "What to look for in the files."),
                               "knowledge_ids": ("array", "Knowledge base ids to search; all attached when "
                                                 "omitted."),
                               "count": ("integer", "Passages to return.")}, ("query",)),
    "list_knowledge_bases": ("List the knowledge bases the user can read, with their ids, names and file "
                             "counts.", {}, ()),
    "view_knowledge_file": ("Return the full text of one file of a knowledge base.",
                            {"file_id": ("string", "The file's id, as a search result gives it.")},
                            ("file_id",)),
    "search_memories": ("Search what the assistant remembers about the user (preferences, facts the user "
                        "asked it to keep) and return the matching memories with their ids.",
                        {"query": ("string", "What to look for."),
                         "count": ("integer", "Memories to return.")}, ("query",)),
    "add_memory": ("Remember a fact about the user for later chats. Only store what the user asked to keep "
                   "or clearly wants remembered.", {"content": ("string", "The fact, as one sentence.")},
                   ("content",)),
    "replace_memory_content": ("Replace the text of one stored memory.",
                               {"memory_id": ("string", "The memory's id."),
                                "content": ("string", "The new text.")}, ("memory_id", "content")),
    "delete_memory": ("Forget one stored memory.", {"memory_id": ("string", "The memory's id.")},
                      ("memory_id",)),
    "list_memories": ("List every stored memory about the user, newest first.", {}, ()),
    "search_notes": ("Search the user's notes by title and content and return the matches with their ids "
                     "and a short excerpt of each.", {"query": ("string", "What to look for."),
                                                      "count": ("integer", "Notes to return.")},
                     ("query",)),
    "view_note": ("Return the full content of one note as markdown.",
                  {"note_id": ("string", "The note's id.")}, ("note_id",)),
    "write_note": ("Create a note, or replace the content of an existing one when an id is given.",
                   {"title": ("string", "The note's title."),
                    "content": ("string", "The note's content, in markdown."),
                    "note_id": ("string", "An existing note to overwrite.")}, ("title", "content")),
    "search_chats": ("Search the user's earlier chats by title and messages and return the matching chats "
                     "with their ids, titles and dates.", {"query": ("string", "What to look for."),
                                                           "count": ("integer", "Chats to return.")},
                     ("query",)),
    "view_chat": ("Return the messages of one earlier chat, oldest first.",
                  {"chat_id": ("string", "The chat's id.")}, ("chat_id",)),
    "list_folders": ("List the user's chat folders with their ids and names.", {}, ()),
    "move_chat_to_folder": ("Move a chat into a folder.", {"chat_id": ("string", "The chat's id."),
                                                           "folder_id": ("string", "The folder's id.")},
                            ("chat_id", "folder_id")),
    "generate_image": ("Generate an image from a text description and show it in the chat.",
                       {"prompt": ("string", "A detailed description of the image: subject, style, "
                                   "lighting, composition."),
                        "size": ("string", "Width x height in pixels, such as 1024x1024.")}, ("prompt",)),
    "edit_image": ("Edit an image of this chat following an instruction.",
                   {"image_id": ("string", "The image's id."),
                    "prompt": ("string", "What to change.")}, ("image_id", "prompt")),
    "get_current_timestamp": ("Return the current date and time in the user's time zone, in ISO 8601.",
                              {}, ()),
    "calculate_timestamp": ("Add or subtract days, weeks or months from a date and return the result.",
                            {"date": ("string", "The start date in ISO 8601; now when omitted."),
                             "days": ("integer", "Days to add (negative to subtract)."),
                             "weeks": ("integer", "Weeks to add."),
                             "months": ("integer", "Months to add.")}, ()),
    "list_channels": ("List the channels the user belongs to, with their ids, names and descriptions.", {},
                      ()),
    "search_channel_messages": ("Search the messages of the user's channels and return the matches with "
                                "their channel, author and time.",
                                {"query": ("string", "What to look for."),
                                 "channel_id": ("string", "Only this channel."),
                                 "count": ("integer", "Messages to return.")}, ("query",)),
    "view_channel_message": ("Return one channel message and its thread.",
                             {"message_id": ("string", "The message's id.")}, ("message_id",)),
    "post_channel_message": ("Post a message to a channel on the user's behalf. Ask the user first.",
                             {"channel_id": ("string", "The channel's id."),
                              "content": ("string", "The message, in markdown.")}, ("channel_id", "content")),
    "list_models": ("List the models the user can chat with, with their ids and descriptions.", {}, ()),
    "ask_model": ("Ask another model a question and return its answer.",
                  {"model_id": ("string", "The model's id."), "prompt": ("string", "The question.")},
                  ("model_id", "prompt")),
    "run_code": ("Run Python code in a sandbox and return its standard output, errors and any files it "
                 "wrote. The sandbox has no network and common scientific packages.",
                 {"code": ("string", "The Python source to run."),
                  "timeout": ("integer", "Seconds before the run is stopped.")}, ("code",)),
    "list_files": ("List the files uploaded to this chat with their ids, names and sizes.", {}, ()),
    "read_file": ("Return the text of a file uploaded to this chat, or a page range of a PDF.",
                  {"file_id": ("string", "The file's id."),
                   "pages": ("string", "Pages to read, such as 1-3; all when omitted.")}, ("file_id",)),
    "create_calendar_event": ("Add an event to the user's calendar.",
                              {"title": ("string", "The event's title."),
                               "start": ("string", "Start time in ISO 8601."),
                               "end": ("string", "End time in ISO 8601."),
                               "description": ("string", "Details of the event.")}, ("title", "start")),
    "list_calendar_events": ("List the user's calendar events between two dates.",
                             {"start": ("string", "From this date (ISO 8601)."),
                              "end": ("string", "Until this date (ISO 8601).")}, ("start", "end")),
    "get_weather": ("Return the current weather and a three-day forecast for a place.",
                    {"location": ("string", "A city, optionally with its country."),
                     "units": ("string", "metric or imperial.")}, ("location",)),
    "translate_text": ("Translate text into another language and return only the translation.",
                       {"text": ("string", "The text."),
                        "target_language": ("string", "The language to translate into.")},
                       ("text", "target_language")),
    "summarize_url": ("Fetch a web page and return a summary of it in a few paragraphs.",
                      {"url": ("string", "The page's address."),
                       "length": ("string", "short, medium or long.")}, ("url",)),
    "set_chat_title": ("Give this chat a new title.", {"title": ("string", "The new title.")}, ("title",)),
}  # fmt: skip

# what Open WebUI's prompts add to every tool's description and parameters (usage notes)
_NOTE = (
    " Call it only when the request needs it and the answer is not already in the conversation; the result "
    "comes back as a tool message, which the answer should use and cite. Do not call it again with the same "
    "arguments in one turn. When it fails, say so and answer from what is known, or ask the user for what "
    "is missing."
)
_PARAM_NOTE = " Optional: leave it out to use the default, which suits most requests."


def openwebui_tools() -> list[dict]:
    """The 36 built-in tools as an OpenAI `tools` list."""
    tools = []
    for name, (description, params, required) in _TOOLS.items():
        props = {}
        for p, (kind, text) in params.items():
            props[p] = {"type": kind, "description": text + ("" if p in required else _PARAM_NOTE)}
            if kind == "array":
                props[p]["items"] = {"type": "string"}
        schema = {"type": "object", "properties": props, "required": list(required)}
        tools.append({"type": "function", "function": {"name": name, "description": description + _NOTE,
                                                       "parameters": schema}})  # fmt: skip
    return tools


def tools_bytes() -> int:
    return len(json.dumps(openwebui_tools()).encode())


def task_prompt(kind: str, history: list[dict]) -> str:
    """A background task's user message (`title`, `follow_ups` or `tags`) over the chat so far."""
    asks = {
        "title": ("Generate a concise title of 3 to 5 words, with an emoji, that sums up the chat history.",
                  '{ "title": "your concise title here" }'),
        "follow_ups": ("Suggest 3 to 5 relevant follow-up questions the user could ask next, from the user's "
                       "point of view, to continue or deepen the discussion.",
                       '{ "follow_ups": ["Question 1?", "Question 2?", "Question 3?"] }'),
        "tags": ("Generate 1 to 3 broad tags for the main themes of the chat history, then 1 to 3 more "
                 "specific subtopic tags.", '{ "tags": ["tag1", "tag2", "tag3"] }'),
    }  # fmt: skip
    ask, fmt = asks[kind]
    guidelines = (
        "- Write in the chat's primary language; default to English.\n"
        "- Keep it clear and simple; accuracy over creativity.\n"
        "- Reply with the JSON object only: no markdown fences, no text before or after it."
    )
    chat = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in history)
    return (
        f"### Task:\n{ask}\n### Guidelines:\n{guidelines}\n### Output:\nJSON format: {fmt}\n"
        f"### Chat History:\n<chat_history>\n{chat}\n</chat_history>"
    )
