"""Finding and loading a model's checkpoint.

    loader.py            resolve_model_path: a built-in name, a GGUF file, a local
                         directory or a hub id -> a local HF directory; load_model
    tiny.py              the built-in ``tiny`` model, written once to the cache
    builtin.py           built-in model names (``smollm2``) -> a GGUF file an
                         installed package ships
    gguf_file.py         read a GGUF file: checks, metadata, HF-named fp32 tensors
    gguf_convert.py      GGUF -> cached HF directory (config, tokenizer, safetensors)
    safetensors_stream.py  write a safetensors file one tensor at a time

Whatever the user names, ``loader.resolve_model_path`` makes it an HF
directory, and the engine loads that. May import ``workers.models`` and
transformers; imports torch. This ``__init__`` imports nothing.
"""
