"""Text: tokenizers (tokenizer.py: tokenizer.json; gguf_tokenizer.py: a GGUF file's vocabulary),
chat templates (chat.py, sandboxed jinja2) and text as it streams (stream.py: UTF-8-safe pieces,
stop strings)."""
