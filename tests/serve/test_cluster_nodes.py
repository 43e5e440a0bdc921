"""`dynalm serve --replicas` over two Ray nodes: Ray's own multi-node harness
(`ray.cluster_utils.Cluster`: a head and a second node, each its own raylet and 2 CPUs,
both on 127.0.0.1), joined as ``--ray-address`` joins a cluster. 4 replicas of one CPU land
2 on each node; each node has its own store (a directory per node id: a node's own disk),
and the model is named by its Hub reference (a fake Hub on 127.0.0.1), so each node pulls
it on first use: once per node, not once per replica (the replicas of a node start together
and take turns at its store). Greedy answers from every replica equal the single process's,
and the replicas place their weights as the driver's settings say (`--weight-pages`, set
after the nodes started)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serving import MODEL, LiveServer, live_cluster, live_server

from dynalm.core import weight_pages
from dynalm.models.loader import LoadedModel, load_model
from dynalm.runtime.engine.config import EngineConfig
from dynalm.runtime.serve.models import ModelService
from dynalm.store.catalog import ModelStore

try:
    import ray
    from ray.cluster_utils import Cluster

    from dynalm.runtime.serve import cluster, routing
except ImportError as e:  # printed by -rs: never a silent skip
    pytest.skip(
        f"Ray Serve is not installed ({e}): pip install '.[cluster]'", allow_module_level=True
    )

sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "store"))  # the fake Hub
from test_catalog import Hub, hub  # noqa: E402, F401 (the fixture)
from test_hub import publish  # noqa: E402

CONFIG = {"ctx": 512, "max_num_seqs": 2}
NODES, CPUS_PER_NODE = 2, 2
REPLICAS = NODES * CPUS_PER_NODE  # one CPU each: two on each node
REF = "hf.co/acme/smol-GGUF:q4_1"
FILE = "smol-Q4_1.gguf"


@dataclass
class _OnNode:
    """A replica's model: its node's store resolves (pulls on first use) the Hub reference,
    as `serve`'s ``prepare`` does for a model it was given by name; each load is marked."""

    root: str

    def load(self) -> ModelService:
        from dynalm.core.cpu_device import CpuDevice
        from dynalm.runtime.engine.engine import Engine

        node = ray.get_runtime_context().get_node_id()
        store = ModelStore(Path(self.root) / node, catalog={})
        path = store.resolve(REF)
        pages = os.environ.get(weight_pages.VARIABLE)
        (store.root / f"loaded-by-{ray.get_runtime_context().get_actor_id()}").write_text(
            f"{pages}"
        )
        model = load_model(path)
        engine = Engine(model, CpuDevice(threads=1), EngineConfig(**CONFIG))
        return ModelService(engine, model, [MODEL])


@dataclass
class NodePrepare:
    root: str

    def __call__(self, name: str) -> _OnNode:
        return _OnNode(self.root)


@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A head and a worker node; this process joins it as a driver (``--ray-address``)."""
    # Ray turns a bootstrap address of 127.0.0.1 into the host's outward address (where
    # nothing of these nodes listens), unless it is told there is no cluster beyond this host
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    if ray.is_initialized():  # this process's local cluster (ray_local): one at a time
        cluster.shutdown()
    nodes = Cluster()
    args = {"num_cpus": CPUS_PER_NODE, "node_ip_address": "127.0.0.1",
            "object_store_memory": 80 * 1024 * 1024}  # fmt: skip
    try:
        nodes.add_node(**args, include_dashboard=False)
        nodes.add_node(**args)
        nodes.wait_for_nodes(timeout=60)
        yield nodes
    finally:
        if ray.is_initialized():
            cluster.shutdown()
        nodes.shutdown()


def test_replicas_on_two_nodes_pull_once_per_node_and_answer_as_one_process(
    two_nodes: Cluster,
    hub: Hub,  # noqa: F811
    tmp_path: Path,
    smollm2: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t0 = time.monotonic()
    publish(hub, "acme/smol-GGUF", {"README.md": b"# smol\n", FILE: smollm2.path.read_bytes()})
    monkeypatch.setenv(weight_pages.VARIABLE, "mapped")  # `serve --weight-pages mapped`
    cluster.connect(two_nodes.address, 1)  # as --ray-address does; HF_* go to the replicas
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # the ingress tokenizes: `serve` resolves the model in this (the head) node's store first
    head = ray.get_runtime_context().get_node_id()
    front = load_model(ModelStore(tmp_path / head, catalog={}).resolve(REF))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    with live_cluster(front, replicas=REPLICAS, router="round-robin",
                      prepare=NodePrepare(str(tmp_path)), **CONFIG) as clustered:  # fmt: skip
        answers = [answer(clustered, chat) for _ in range(REPLICAS)]
        routed = dict(routing.STATS[cluster.APP].routed)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    with live_server(smollm2, **CONFIG) as single:
        expected = answer(single, chat)
    # round-robin: each replica answered once, all as the single process does
    assert len(routed) == REPLICAS and set(routed.values()) == {1}, routed
    assert answers == [expected] * REPLICAS
    # the replicas: two on each node (each node's store saw two loads)
    loads = {d.name: len(list(d.glob("loaded-by-*"))) for d in tmp_path.iterdir() if d.is_dir()}
    assert len(nodes) == NODES and set(loads) == nodes, (nodes, loads)
    assert list(loads.values()) == [CPUS_PER_NODE] * NODES, loads
    # each placed its weights as this process says, though its node started without that
    pages = [p.read_text() for p in tmp_path.glob("*/loaded-by-*")]
    assert pages == ["mapped"] * REPLICAS, pages
    # the model's file came from the Hub once per node: the head's (the ingress) and the other's
    cdn = [p for p in hub.paths() if p.startswith("/cdn/")]
    assert len(cdn) == NODES, hub.paths()
    assert time.monotonic() - t0 < 240


def answer(server: LiveServer, body: dict) -> str:
    r = server.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]
