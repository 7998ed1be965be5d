"""Checkpoint formats other than an HF directory, turned into one.

    builtin.py           built-in model names (``smollm2``) -> a GGUF file an
                         installed package ships
    gguf_file.py         read a GGUF file: checks, metadata, HF-named fp32 tensors
    gguf_convert.py      GGUF -> cached HF directory (config, tokenizer, safetensors)
    safetensors_stream.py  write a safetensors file one tensor at a time

``workers.loader.resolve_model_path`` is the only caller: whatever the user
names, the engine loads an HF directory.
"""
