"""Chat templates the shipped folders lack: Gemma 3 270M ships as the base model, without one.
This is the template of Gemma 3's instruction-tuned models (google/gemma-3-270m-it's
tokenizer_config.json), text content only: a system message is folded into the first user turn,
the assistant is called "model", contents are trimmed, and roles must alternate."""

GEMMA3_IT = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
