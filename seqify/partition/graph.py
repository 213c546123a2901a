"""The layer dataflow graph: carried values and skips as edges, for the bytes live across cuts and clean cuts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import networkx as nx

from seqify.skip.layout import SkipRoute
from seqify.skip.namespace import SkipKey

__all__ = ["dataflow", "live_bytes", "crossing", "clean_cuts"]

def dataflow(
    n: int,
    routes: Sequence[SkipRoute],
    output_bytes: Sequence[int],
    skip_bytes: Mapping[SkipKey, int],
) -> nx.MultiDiGraph:
    """Nodes are layer indices; edge ``i -> i+1`` is the carried value, edge ``stash -> pop`` each skip.

    Every edge has ``bytes`` (0 where unknown), ``kind`` (``carried`` or ``skip``) and ``name``.
    """
    g = nx.MultiDiGraph()
    g.add_nodes_from(range(n))
    for i in range(n - 1):
        g.add_edge(i, i + 1, key="carried", kind="carried", name="carried", bytes=int(output_bytes[i]))
    for j, route in enumerate(routes):
        g.add_edge(
            route.stash, route.pop, key=f"skip{j}", kind="skip", name=route.name,
            bytes=int(skip_bytes.get(route.key, 0)),
        )
    return g


def live_bytes(g: nx.MultiDiGraph) -> list[int]:
    """Bytes crossing every cut (liveness): index ``c`` is the weight of the graph cut between layers
    ``0..c-1`` and ``c..n-1``, i.e. the carried value plus every skip with ``stash < c <= pop``.

    One sweep in topological order: passing node ``v`` ends the edges into it and starts the edges out
    of it, so O(n + E) in all (``nx.cut_size`` of each cut gives the same, in O(n (n + E))). Entries 0
    and n (no cut) are 0.
    """
    live = [0]
    held = 0
    for v in nx.topological_sort(g):
        held -= sum(d for _, _, d in g.in_edges(v, data="bytes"))
        held += sum(d for _, _, d in g.out_edges(v, data="bytes"))
        live.append(held)
    live[-1] = 0
    return live


def crossing(g: nx.MultiDiGraph, c: int) -> list[str]:
    """Names of the skips live across cut ``c``, in stash order."""
    n = g.number_of_nodes()
    nodes = list(range(n))
    edges = nx.edge_boundary(g, nodes[:c], nodes[c:], data=True)
    return [d["name"] for _, _, d in sorted(edges, key=lambda e: (e[0], e[1])) if d["kind"] == "skip"]


def clean_cuts(g: nx.MultiDiGraph) -> list[int]:
    """Cuts that only the carried value crosses: those whose carried edge is a bridge of the undirected
    multigraph (a skip spanning the cut, even one parallel to the carried edge, closes a cycle over it)."""
    undirected = nx.MultiGraph(g)
    return sorted(max(u, v) for u, v in nx.bridges(undirected) if abs(u - v) == 1)
