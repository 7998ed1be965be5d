"""The gateway's API settings: one typed place, checked at construction.

--served-model-name NAME [NAME ...]   names clients may send as ``model``
                                      (the first is the one responses carry
                                      when a request names none); default: --model
--chat-template FILE                  Jinja template for chat requests (replaces
                                      the tokenizer's)
--generation-config auto|vllm|DIR     sampling defaults (generation_defaults.py)
--enable-auto-tool-choice             tool_choice "auto": the model may call tools
--tool-call-parser NAME               how its tool calls are read (cluster/gateway/tools/)
"""

from __future__ import annotations

import dataclasses
import os

from tandem.cluster.gateway.api.generation_defaults import (
    GenerationDefaults,
    load_generation_defaults,
)
from tandem.cluster.gateway.protocol import ProtocolError
from tandem.wire.config_fields import option


@dataclasses.dataclass(frozen=True)
class ApiConfig:
    served_model_names: tuple[str, ...] = ()  # empty: the backend's model name
    chat_template: str | None = None  # the template's text (read from --chat-template)
    generation_defaults: GenerationDefaults = dataclasses.field(default_factory=GenerationDefaults)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        for name in self.served_model_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"--served-model-name: names must be non-empty, got {name!r}")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"--served-model-name: repeated names in {self.served_model_names}")

    @classmethod
    def from_settings(cls, settings: ApiSettings, model_path: str | None) -> ApiConfig:
        """From the serve configuration's API section; ``model_path``: the
        checkpoint directory that ``generation_config: auto`` reads. ValueError
        names the flag."""
        template = None
        if settings.chat_template:
            path = os.path.expanduser(settings.chat_template)
            try:
                with open(path, encoding="utf-8") as f:
                    template = f.read()
            except OSError as exc:
                raise ValueError(f"--chat-template: cannot read {path}: {exc}") from None
            if not template.strip():
                raise ValueError(f"--chat-template: {path} is empty")
        defaults = load_generation_defaults(settings.generation_config, model_path)
        return cls(
            tuple(settings.served_model_name),
            template,
            defaults,
            settings.enable_auto_tool_choice,
            settings.tool_call_parser,
        )


@dataclasses.dataclass(frozen=True)
class ApiSettings:
    """What ``ApiConfig`` is made from: a section of the serve configuration
    (files are read, and checkpoint defaults loaded, when the gateway starts)."""

    served_model_name: tuple[str, ...] = option(
        (),
        default_text="--model",
        help="model names clients may send (the first is reported)",
    )
    chat_template: str | None = option(
        None, help="Jinja chat template file (replaces the tokenizer's)"
    )
    generation_config: str = option(
        "auto",
        help="sampling defaults: 'auto' (the checkpoint's generation_config.json), "
        "'vllm' (ignore it) or a directory holding one",
    )

    enable_auto_tool_choice: bool = option(
        False,
        help='tool_choice "auto": the model may call the request\'s tools itself '
        "(needs --tool-call-parser)",
    )
    tool_call_parser: str | None = option(
        None, help='how tool calls are read in the model\'s text with tool_choice "auto": hermes'
    )

    def __post_init__(self) -> None:
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        names = self.served_model_name
        if isinstance(names, str):
            object.__setattr__(self, "served_model_name", (names,))
        ApiConfig(tuple(self.served_model_name))  # ValueError naming --served-model-name
        if not self.generation_config:
            object.__setattr__(self, "generation_config", "auto")


def check_tool_flags(enable_auto: bool, parser: str | None) -> None:
    """ValueError naming the flag."""
    from tandem.cluster.gateway.tools.parsers import PARSERS

    if parser is not None and parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if enable_auto and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


class ServedModels:
    """Which ``model`` values the gateway accepts, and the name to answer with."""

    def __init__(self, names: tuple[str, ...], fallback: str) -> None:
        self.names = names or (fallback,)

    def resolve(self, requested: str | None) -> str:
        """The name a response carries; 404 ``model_not_found`` (OpenAI's and
        vLLM's answer) for a name this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested in self.names:
            return requested
        served = ", ".join(f"`{n}`" for n in self.names)
        raise ProtocolError(
            f"The model `{requested}` does not exist; this server serves {served}.",
            status_code=404,
            param="model",
            code="model_not_found",
        )
