"""Benchmark the weight channels against a plain memcpy of the same tensors, in one run.

Run: python bench/weights.py --json        (one JSON line; about 15 s on 2 CPU cores)

For each transport, "publish-to-ready" is the wall time from ``publisher.publish(version, state_dict)``
until ``receiver.fetch()`` has returned tensors of that version, median over ``--repeats``:
- memcpy: ``copy_`` of every tensor into a preallocated flat buffer (the limit for any channel);
- shared_memory: publish into /dev/shm, fetch views (no checksum: the default);
- shared_memory_checksummed: the same with ``checksum=True`` and a verifying receiver;
- network_full / network_delta: gRPC on 127.0.0.1 in this process, checksums on both ends. The delta
  follows one AdamW step that trains only the last decoder layer (everything else frozen), the
  sparse case deltas are for; ``changed_fraction`` says how much of the buffer moved.
Bytes are what crossed the channel: the flat buffer, or the delta payload. Never asserts on time.

``--ray`` adds the choice the ray placement makes (rollbook/run/ray_cluster.py): the network channel against
Ray's object store, each measured from publish until a Ray actor has loaded the version into its own
copy of the model, with the actor on the publisher's node and on a second node of a two-node
``ray.cluster_utils.Cluster`` on this machine (so Ray moves the object between two object stores):
- ray_object_store_{same,other}_node: ``ray.put`` of the flat buffer, the actor ``ray.get``s it
  and loads it (the put and the transfer both inside the span);
- ray_network_full_{same,other}_node: ``NetworkPublisher.publish`` in the driver, the actor's
  ``NetworkReceiver.fetch`` (checksummed) and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per transport (median reported)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--ray", action="store_true", help="also Ray's object store against the network channel, into Ray actors")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from rollbook.language_models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=args.intermediate_size,
    )
    model = build_tiny_model(spec)
    result = {
        "bench": "weights",
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "load_avg_1m": os.getloadavg()[0],
    }  # other work on the host skews every timing
    state_dict = model.state_dict()
    result["memcpy"], result["shared_memory"], ratio = bench_local(state_dict, args.repeats * 3, checksum=False)
    _, result["shared_memory_checksummed"], _ = bench_local(state_dict, args.repeats, checksum=True)
    result["network_full"] = bench_network(model, args, delta=False)
    result["network_delta"] = bench_network(model, args, delta=True)
    if args.ray:
        result.update(bench_ray(spec, model, args))
    result["model_bytes"] = result["memcpy"]["bytes"]
    result["shm_over_memcpy"] = round(ratio, 3)
    if args.json:
        print(json.dumps(result), flush=True)
        return
    for name, row in result.items():
        if isinstance(row, dict):
            print(f"{name:28s} {row['seconds'] * 1e3:9.2f} ms {row['bytes'] / 2**20:9.2f} MiB")
    print(f"shm_over_memcpy {result['shm_over_memcpy']}")


def bench_local(state_dict, repeats: int, *, checksum: bool) -> tuple[dict, dict, float]:
    """memcpy and shared memory in alternating rounds (so load from elsewhere hits both alike).

    Returns their rows and the median over rounds of shm time / memcpy time.
    """
    import torch

    from rollbook.weights import SharedMemoryPublisher, SharedMemoryReceiver
    from rollbook.weights.base import Layout, tensor_views

    layout = Layout.from_state_dict(state_dict)
    views = tensor_views(layout, torch.zeros(layout.nbytes, dtype=torch.uint8).numpy())
    pairs = list({s.offset: (views[s.name], state_dict[s.name]) for s in layout.tensors}.values())
    name = f"rollbook-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    publisher = SharedMemoryPublisher(name, state_dict, checksum=checksum)
    receiver = SharedMemoryReceiver(name, verify=checksum)
    versions = iter(range(1_000_000))

    def memcpy() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def round_trip() -> None:
        v = next(versions)
        publisher.publish(v, state_dict)
        assert receiver.fetch().version == v

    try:
        for fn in (memcpy, round_trip, round_trip):  # first touch of every page is not steady state
            fn()
        copies, shms = [], []
        for _ in range(repeats):
            copies.append(_timed(memcpy))
            shms.append(_timed(round_trip))
    finally:
        receiver.close()
        publisher.close()
    ratio = statistics.median(s / c for s, c in zip(shms, copies))
    row = lambda times: {"seconds": statistics.median(times), "bytes": layout.nbytes}  # noqa: E731
    return row(copies), row(shms), ratio


def bench_network(model, args: argparse.Namespace, *, delta: bool) -> dict:
    """Full: every publish is an anchor. Delta: one sparse AdamW step between untimed publishes."""
    from rollbook.config import WeightStreamConfig
    from rollbook.weights import NetworkPublisher, NetworkReceiver, create_weight_server

    config = WeightStreamConfig(chunk_bytes=args.chunk_bytes, anchor_every=1_000_000 if delta else 1)
    publisher = NetworkPublisher(config)
    server, port = create_weight_server(publisher)
    server.start()
    receiver = NetworkReceiver(f"127.0.0.1:{port}")
    step = _sparse_adamw_step(model) if delta else (lambda: None)
    versions = iter(range(1_000_000))
    times, sizes, changed = [], [], []
    try:
        for _ in range(2):  # both ends recycle two buffers: fill them before timing
            step()
            publisher.publish(next(versions), model.state_dict())
            receiver.fetch()
        for _ in range(args.repeats):
            step()
            v, t0 = next(versions), time.perf_counter()
            publisher.publish(v, model.state_dict())
            snap = receiver.fetch()
            times.append(time.perf_counter() - t0)
            assert snap.version == v and receiver.last_kind == ("delta" if delta else "full")
            sizes.append(receiver.last_payload_bytes)
            changed.append(len(publisher.latest.delta.indices) * 4 / publisher.latest.layout.nbytes if delta else 1.0)
    finally:
        receiver.close()
        server.stop(None)
    row = {"seconds": statistics.median(times), "bytes": int(statistics.median(sizes))}
    if delta:
        row["changed_fraction"] = round(statistics.median(changed), 4)
        row["what_changed"] = "one AdamW step (lr 1e-4, wd 0.01) training only the last decoder layer"
    return row


class _RayReceiver:
    """A Ray actor holding its own copy of the model, as a rollout actor does."""

    def __init__(self, spec) -> None:
        import torch

        from rollbook.language_models import build_tiny_model

        torch.set_num_threads(1)
        self.model = build_tiny_model(spec)
        self.network = None

    def ready(self) -> bool:
        return True

    def from_object_store(self, refs: list, layout_json: bytes, version: int) -> int:
        import ray

        from rollbook.weights.base import Layout, WeightSnapshot, load_into, tensor_views

        flat = ray.get(refs[0])  # a read-only view of this node's object store (pulled here first if remote)
        load_into(self.model, WeightSnapshot(version, tensor_views(Layout.from_json(layout_json), flat), b""))
        return version

    def from_network(self, target: str) -> int:
        from rollbook.weights import NetworkReceiver
        from rollbook.weights.base import load_into

        if self.network is None:
            self.network = NetworkReceiver(target)
        snapshot = self.network.fetch()
        load_into(self.model, snapshot)
        return snapshot.version


def bench_ray(spec, model, args: argparse.Namespace) -> dict:
    """Object store against network channel, into an actor on this node and on another node."""
    import numpy as np
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from rollbook.config import WeightStreamConfig
    from rollbook.environment import prepare_local_ray
    from rollbook.weights import NetworkPublisher, create_weight_server
    from rollbook.weights.base import Layout, pack_into, tensor_views

    prepare_local_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"here": 1}})
    cluster.add_node(num_cpus=1, resources={"there": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    publisher = NetworkPublisher(WeightStreamConfig(chunk_bytes=args.chunk_bytes, anchor_every=1))
    server, port = create_weight_server(publisher)
    server.start()
    state_dict = model.state_dict()
    layout = Layout.from_state_dict(state_dict)
    flat = np.zeros(layout.nbytes, dtype=np.uint8)
    views = tensor_views(layout, flat)
    versions = iter(range(1_000_000))
    out: dict = {}
    try:
        for node in ("here", "there"):
            actor = ray.remote(_RayReceiver).options(num_cpus=0.5, resources={node: 1}).remote(spec)
            ray.get(actor.ready.remote())
            where = "same_node" if node == "here" else "other_node"

            def object_store(actor=actor) -> None:
                v = next(versions)
                pack_into(layout, state_dict, views)  # the trainer's tensors into one flat buffer
                ref = ray.put(flat)
                assert ray.get(actor.from_object_store.remote([ref], layout.to_json(), v)) == v
                del ref

            def network(actor=actor) -> None:
                v = next(versions)
                publisher.publish(v, state_dict)
                assert ray.get(actor.from_network.remote(f"127.0.0.1:{port}")) == v

            for name, fn in (("ray_object_store", object_store), ("ray_network_full", network)):
                with torch.no_grad():
                    for _ in range(2):  # first touch, buffers filled
                        fn()
                    times = [_timed(fn) for _ in range(args.repeats)]
                out[f"{name}_{where}"] = {"seconds": statistics.median(times), "bytes": layout.nbytes}
            ray.kill(actor)
    finally:
        server.stop(None)
        ray.shutdown()
        cluster.shutdown()
    for where in ("same_node", "other_node"):
        out[f"ray_object_store_over_network_{where}"] = round(
            out[f"ray_object_store_{where}"]["seconds"] / out[f"ray_network_full_{where}"]["seconds"], 3
        )
    return out


def _sparse_adamw_step(model):
    import torch

    last = f"layers.{len(model.model.layers) - 1}."
    params = [p for n, p in model.named_parameters() if last in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
