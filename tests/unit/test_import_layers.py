"""The project's import graph: no cycles, and every import points down.

    cluster.cli  ->  cluster.disagg  ->  cluster.engines, cluster.routing
                     cluster.gateway ->  cluster.observability
    (the Backend interface, cluster.gateway.backend, is imported from below)
    cluster  ->  workers  ->  kvtransfer, kernels  ->  scheduler, wire

Read from the source with ``ast`` by ``benchmarks/structure.py`` (nothing is imported): every ``import``,
also those inside functions (a lazy import that closes a circle is still a
circle), except under ``if TYPE_CHECKING:``. Installed, the folders are
``tandem.cluster``, ``tandem.scheduler``, ...; the graph names modules without the
``tandem.`` prefix.
"""

from __future__ import annotations

from benchmarks.structure import bare_imports, cycles, import_graph, source_files

# what each cluster package may import from the other cluster packages
# (a name allows that module or package and everything under it)
CLUSTER_ALLOWED = {
    "cluster.cli": {"cluster"},
    "cluster.gateway": {"cluster.observability"},
    "cluster.disagg": {"cluster.engines", "cluster.routing", "cluster.gateway.backend"},
    "cluster.engines": {"cluster.observability.logging_setup"},
    "cluster.routing": {"cluster.gateway.backend"},
    "cluster.observability": {"cluster.gateway.backend", "cluster.routing.metrics"},
    "cluster.planner": set(),  # the simulator and planner arithmetic: scheduler/ and wire/ only
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_lower_layers_never_import_cluster():
    bad = [
        (m, t)
        for m, targets in import_graph().items()
        if not _under(m, "cluster")
        for t in targets
        if _under(t, "cluster")
    ]
    assert bad == []


def test_cluster_packages_import_only_downwards():
    bad = []
    for module, targets in import_graph().items():
        owner = next((p for p in CLUSTER_ALLOWED if _under(module, p)), None)
        if owner is None:
            continue  # cluster/__init__, __main__, or outside cluster
        for t in targets:
            if not _under(t, "cluster") or _under(t, owner):
                continue
            if not any(_under(t, allowed) for allowed in CLUSTER_ALLOWED[owner]):
                bad.append((module, t))
    assert bad == []


def test_every_cluster_module_has_a_package():
    # a module added beside the packages would escape the rules above
    flat = [
        m
        for m in source_files()
        if m.count(".") == 1 and _under(m, "cluster") and m not in CLUSTER_ALLOWED
    ]
    assert sorted(flat) == ["cluster.__main__"]


def test_the_graph_sees_imports():
    # the checks above are only as good as the graph: spot-check known edges
    graph = import_graph()
    assert "cluster.gateway.backend" in graph["cluster.disagg.ray_backend"]
    assert "cluster.cli.settings" in graph["cluster.cli.check_config"]
    assert "cluster.engines.actor" in graph["cluster.engines.pools"]  # inside a function
    assert "cluster.cli.bench" in graph["cluster.cli.main"]  # from cluster.cli import bench


def test_every_import_goes_through_the_tandem_namespace():
    """``from scheduler import ...`` would work from a checkout's root (pytest puts it on
    ``sys.path``) and fail installed, or load a second copy of the module: every import
    of ours, in the packages, the tests and the benchmarks, says ``tandem.``."""
    assert bare_imports(extra=("tests", "benchmarks")) == []
