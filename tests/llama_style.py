"""A Llama 3.1-style tool template for tests.

JSON calls with "parameters", results as ipython turns, written with Qwen's special tokens so
that it runs on the pinned tokenizers. Like the real one it drops an assistant's content when
the message has tool calls.
"""

LLAMA_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call these functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}{% set f = c.function if c.function else c %}"
    '{{ \'{"name": "\' + f.name + \'", "parameters": \' + (f.arguments | tojson) + \'}\' }}'
    "{% if not loop.last %}; {% endif %}{% endfor %}<|im_end|>\n"
    "{% elif m.role in ('tool', 'ipython') %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
