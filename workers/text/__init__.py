"""Text in and out, for the gateway and the offline ``LLM``: tokenizer
loading, prompt encoding and chat templates (``tokenizer.py``), incremental
detokenization with stop strings (``detokenizer.py``).

May import transformers and tokenizers, never torch code of ours
(``workers.engine``, ``workers.runner``, ``kernels``): the gateway imports
this package. This ``__init__`` imports nothing.
"""
