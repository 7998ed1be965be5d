"""UCX under NIXL: the environment the connector sets (``env.py``) and the
transport UCX actually picks, read from a probe transfer (``probe.py``,
``proto_info.py``)."""
