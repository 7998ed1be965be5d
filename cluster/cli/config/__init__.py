"""``tandem serve``'s configuration: one typed tree (``tree.py``), its settings
by key (``keys.py``), the command line generated from it (``args.py``), YAML
and flags resolved onto it (``load.py``) and the reference page
(``reference.py``)."""

from tandem.cluster.cli.config.tree import SECTION_TITLES, SecurityConfig, ServeConfig, ServerConfig

__all__ = ["SECTION_TITLES", "SecurityConfig", "ServeConfig", "ServerConfig"]
