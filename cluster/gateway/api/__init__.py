"""The API surface beside the generation routes.

    config.py               ApiConfig: served model names, chat template, generation defaults
    generation_defaults.py  sampling defaults from the checkpoint's generation_config.json
    tokenize.py             POST /tokenize and POST /detokenize (vLLM's shapes)
    openapi.py              the /openapi.json document, built from the request structs
    admin.py                POST /admin/drain and /admin/undrain (--admin-api-key)

Nothing here is on the per-token path.
"""
