"""The model: where a checkpoint comes from (checkpoint.py: folder, .gguf file or hub id), its
config (config.py), its tensors (weights.py: safetensors; gguf_file.py: GGUF, quantized blocks kept),
the packed weights (pack.py), the transformer (transformer.py: the readable forward_ref and the
compiled forward of forward.py), the KV cache (cache.py) and the memory checks (memory.py)."""
