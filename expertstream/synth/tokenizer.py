"""A small byte-level BPE with the Qwen special tokens and a ChatML template, for synthetic checkpoints.

The BPE is trained (deterministically) on a short built-in English text; special tokens follow it in Qwen's
order, so ids differ from the real 248k vocabulary but names, roles and template behaviour are the same.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

BPE_VOCAB = 384
# (content, special): Qwen marks the tool and think tags non-special so they survive skip_special_tokens
SPECIAL_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

CORPUS = """\
The user asked the assistant a question, and the assistant answered it. The system message sets the rules.
A tool is a function the assistant may call; the tool returns a result, and the assistant reads the result.
Think step by step. First, read the question. Then, work out the answer. Finally, write the answer clearly.
The weather today is sunny with a light wind. Tomorrow it will rain in the morning and clear up by noon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000. Two plus two is four. Ten times ten is one hundred.
The quick brown fox jumps over the lazy dog. A small model streams its experts from a fast disk.
Hello, world! How are you? I am fine, thank you. What is the capital of France? Paris is the capital.
She wrote a short story about a river, a mountain and a city. He read the story and liked the ending.
In the beginning there was only text; then there were tokens, embeddings, layers, experts and logits.
Please find the file, open it, and tell me what it says. The function returns a list of names and values.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} returns {"temperature": 21}.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n
"""

CHAT_TEMPLATE = r"""{%- set effort_notes = {
    'xhigh': 'Reason as thoroughly as the problem needs before you answer.',
    'medium': '',
    'low': 'Keep your reasoning short and answer quickly.'} -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else '' -%}
{%- if effort and effort not in effort_notes -%}
{{- raise_exception('reasoning_effort must be one of xhigh, medium, low; got ' ~ effort) -}}
{%- endif -%}
{%- set effort_note = effort_notes[effort] if effort else '' -%}
{%- set thinking = enable_thinking is not defined or enable_thinking -%}
{%- set keep_all_reasoning = preserve_thinking is not defined or preserve_thinking -%}
{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{- content -}}
{%- else -%}
{%- for part in content -%}
{%- if part.type == 'image' or part.image is defined -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'video' or part.video is defined -%}<|vision_start|><|video_pad|><|vision_end|>
{%- elif part.text is defined -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- set system_text = render_content(messages[0].content) if has_system else '' -%}
{%- if system_text or effort_note or tools -%}
{{- '<|im_start|>system\n' -}}
{{- system_text -}}
{%- if effort_note -%}{{- ('\n\n' if system_text else '') ~ effort_note -}}{%- endif -%}
{%- if tools -%}
{{- ('\n\n' if system_text or effort_note else '')
    ~ '# Tools\n\nYou may call one or more of these functions:\n\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' ~ ((tool.function if tool.function is defined else tool) | tojson) -}}
{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, reply with nothing after the call, in exactly this form:\n\n'
    ~ '<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n'
    ~ '</function>\n</tool_call>\n\n'
    ~ 'Give every required parameter; values that are not strings are written as JSON.' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) -%}
{%- set ns.last_query = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- if not loop.first -%}{{- raise_exception('a system message is only allowed first') -}}{%- endif -%}
{%- elif m.role == 'user' -%}
{{- '<|im_start|>user\n' ~ render_content(m.content) ~ '<|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set content = render_content(m.content) -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if not reasoning and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
{%- set content = content.split('</think>')[-1] -%}
{%- endif -%}
{%- set reasoning = reasoning.strip('\n') -%}
{%- set content = content.lstrip('\n') -%}
{{- '<|im_start|>assistant\n' -}}
{%- if reasoning and (keep_all_reasoning or loop.index0 > ns.last_query) -%}
{{- '<think>\n' ~ reasoning ~ '\n</think>\n\n' -}}
{%- endif -%}
{{- content -}}
{%- for call in (m.tool_calls or []) -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- ('\n\n' if content or not loop.first else '') ~ '<tool_call>\n<function=' ~ fn.name ~ '>\n' -}}
{%- for arg_name, arg_value in (fn.arguments or {}) | items -%}
{{- '<parameter=' ~ arg_name ~ '>\n' ~ (arg_value if arg_value is string else arg_value | tojson)
    ~ '\n</parameter>\n' -}}
{%- endfor -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' ~ render_content(m.content) ~ '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- raise_exception('unknown role ' ~ m.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' ~ ('<think>\n' if thinking else '<think>\n\n</think>\n\n') -}}
{%- endif -%}
"""


def build_tokenizer(lines: list[str] | None = None, vocab_size: int = BPE_VOCAB) -> Tokenizer:
    """Train the byte-level BPE on `lines` (default: CORPUS) and append the special tokens (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS.splitlines() if lines is None else lines, trainer)
    tok.add_special_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])
    return tok


def tokenizer_files(
    model_max_length: int, lines: list[str] | None = None, vocab_size: int = BPE_VOCAB
) -> tuple[dict[str, str], dict[str, int]]:
    """Files of the tokenizer (trained on `lines`, default CORPUS) and the ids of its special tokens.

    Returns:
        ({"tokenizer.json": ..., "tokenizer_config.json": ..., "chat_template.jinja": ...},
         {token content: id} for SPECIAL_TOKENS).
    """
    tok = build_tokenizer(lines, vocab_size)
    ids = {t: tok.token_to_id(t) for t, _ in SPECIAL_TOKENS}
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for t, s in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    files = {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "chat_template.jinja": CHAT_TEMPLATE,
    }
    return files, ids
