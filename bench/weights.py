"""Benchmark the weight channels against a plain memcpy of the same tensors, in one run.

Run: python bench/weights.py --json        (one JSON line; about 30 s on 2 CPU cores)
     python bench/weights.py --json --device cuda --dtype bfloat16 --model qwen2-0.5b \
         --cases memcpy,shared_memory,memcpy_device,shared_memory_loaded,cuda_ipc_loaded,awex_ipc_loaded
                                           (scripts/gpu_check.sh)

The published model is the tiny Llama of ``--vocab-size`` etc. (48 MiB in float32 by default) or, with
``--model qwen2-0.5b``, a Qwen2 of the 0.5B shape (bench/models.py), on ``--device`` in ``--dtype``.
For each transport, "publish-to-ready" is the wall time from ``publisher.publish(version, state_dict)``
until the receiving end has that version, median over ``--repeats``. In this process, ready is
``receiver.fetch()`` having returned tensors of that version:
- memcpy: ``copy_`` of every tensor into a preallocated flat host buffer (the limit for any channel
  through host memory);
- shared_memory: publish into /dev/shm, fetch views (no checksum: the default);
- shared_memory_checksummed: the same with ``checksum=True`` and a verifying receiver;
- network_full / network_delta: gRPC on 127.0.0.1 in this process, checksums on both ends. The delta
  follows one AdamW step that trains only the last decoder layer (everything else frozen), the
  sparse case deltas are for; ``changed_fraction`` says how much of the buffer moved.
On CUDA, ``memcpy_device``: the same copies into a flat buffer on the device (the limit for a channel
that stays on the device).

The ``*_loaded`` cases end in another process, as a rollout worker does: a spawned receiver holding its
own copy of the model on ``--device`` fetches the version and loads it (``load_into``, then
``synchronize``), and ready is its answer over a pipe (``pipe_roundtrip_s``, an empty exchange, is in
every such figure):
- shared_memory_loaded: ``SharedMemoryPublisher`` (no checksum); on CUDA the trainer's tensors go to
  host memory and the receiver copies them back up;
- cuda_ipc_loaded: ``CudaIpcPublisher`` (rollbook/weights/cuda_ipc.py); on CUDA a device-to-device copy
  into the shared buffer, then one out of it in the receiver; on the CPU the same code over torch's
  shared memory;
- awex_ipc_loaded (CUDA and the ``awex`` package only): the data path of awex's colocated mode
  (``NCCLWeightsWriter._write_weights_in_colocate_mode`` and its reader): per version, the tensors
  concatenated per dtype into new device buffers (``group_tensors_by_shape_and_dtype``), their CUDA
  IPC handles pickled (``cuda_ipc_serialize``) and sent, the receiver opening them
  (``reconstruct_ipc_weights``) and loading the views. awex's engine adapters (Megatron, vLLM,
  SGLang), its metadata server and its NCCL transfer plan are not in it: they need those engines.
  The buffers are freed after the answer, outside the span, as awex's writer does.
Bytes are what crossed the channel: the flat buffer, or the delta payload. A case that cannot run
here is a row ``{"skipped": reason}``. Never asserts on time.

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
import multiprocessing
import os
import pathlib
import statistics
import sys
import time
import traceback
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOST_CASES = ("memcpy", "shared_memory", "shared_memory_checksummed", "network_full", "network_delta")
LOADED_CASES = ("shared_memory_loaded", "cuda_ipc_loaded", "awex_ipc_loaded")  # awex last: it patches torch
CASES = (*HOST_CASES, "memcpy_device", *LOADED_CASES)
RECEIVER_START_S = 300.0  # a spawned receiver imports torch and builds its model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--model", default="tiny", choices=["tiny", "qwen2-0.5b"], help="tiny: the Llama of --vocab-size etc.")
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N: where the published model (and each receiver's) lives")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the published weights' dtype")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per transport (median reported)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--ray", action="store_true", help="also Ray's object store against the network channel, into Ray actors")
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown --cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from rollbook.devices import resolve_device
    from rollbook.weights.base import Layout

    device = resolve_device(args.device)
    cases = [c for c in CASES if c in args.cases.split(",")]
    spec, model = build(args, device)
    result = {
        "bench": "weights",
        "model": args.model,
        "device": str(device),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "load_avg_1m": os.getloadavg()[0],
    }  # other work on the host skews every timing
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    state_dict = model.state_dict()
    nbytes = Layout.from_state_dict(state_dict).nbytes
    result["model_bytes"] = nbytes
    no_shm = _shm_too_small(2 * nbytes)
    if "memcpy" in cases or "shared_memory" in cases:
        if no_shm:
            result["memcpy"] = result["shared_memory"] = {"skipped": no_shm}
        else:
            result["memcpy"], result["shared_memory"], ratio = bench_local(state_dict, args.repeats * 3, checksum=False)
            result["shm_over_memcpy"] = round(ratio, 3)
    if "shared_memory_checksummed" in cases:
        result["shared_memory_checksummed"] = (
            {"skipped": no_shm} if no_shm else bench_local(state_dict, args.repeats, checksum=True)[1]
        )
    if "network_full" in cases:
        result["network_full"] = bench_network(model, args, delta=False)
    if "network_delta" in cases:
        result["network_delta"] = bench_network(model, args, delta=True)
    if "memcpy_device" in cases:
        result["memcpy_device"] = (
            bench_device_memcpy(state_dict, args.repeats * 3) if device.type == "cuda" else {"skipped": "needs --device cuda"}
        )
    loaded, failed = [c for c in LOADED_CASES if c in cases], []
    if loaded:
        result["pipe_roundtrip_s"] = None
    for case in loaded:
        why = _cannot_run(case, device, no_shm)
        if why:
            result[case] = {"skipped": why}
            continue
        try:
            result[case] = bench_loaded(case, state_dict, spec, args, device)
        except Exception as exc:  # reported, and the other cases still measured; exit status 1 at the end
            result[case] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
            failed.append(case)
            continue
        roundtrip = result[case].pop("pipe_roundtrip_s")
        result["pipe_roundtrip_s"] = result["pipe_roundtrip_s"] or roundtrip
    for a, b in (("cuda_ipc_loaded", "shared_memory_loaded"), ("awex_ipc_loaded", "cuda_ipc_loaded")):
        if "seconds" in result.get(a, {}) and "seconds" in result.get(b, {}):
            result[f"{a.removesuffix('_loaded')}_over_{b}"] = round(result[a]["seconds"] / result[b]["seconds"], 3)
    if args.ray:
        result.update(bench_ray(spec, model, args))
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        for name, row in result.items():
            if isinstance(row, dict) and "seconds" in row:
                print(f"{name:28s} {row['seconds'] * 1e3:9.2f} ms {row['bytes'] / 2**20:9.2f} MiB")
            elif isinstance(row, dict) and ("skipped" in row or "error" in row):
                print(f"{name:28s} {'skipped: ' + row['skipped'] if 'skipped' in row else 'failed: ' + row['error']}")
        for key in [k for k in result if "_over_" in k]:
            print(f"{key} {result[key]}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (the error is in its row)")


def build(args: argparse.Namespace, device):
    """(what a receiver process needs to build the same model, the model on ``device`` in ``--dtype``)."""
    spec = {
        "model": args.model,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "intermediate_size": args.intermediate_size,
        "device": str(device),
        "dtype": args.dtype,
    }
    return spec, build_model(spec, seed=0)


def build_model(spec: dict, seed: int):
    """The model of ``spec``, initialized directly on its device (a 0.5B model builds in seconds there)."""
    import torch

    with torch.device(spec["device"]):
        if spec["model"] == "qwen2-0.5b":
            sys.path.insert(0, str(ROOT))  # bench.models
            from bench.models import qwen2_half_billion

            model = qwen2_half_billion(seed)
        else:
            from rollbook.language_models import TinyModelSpec, build_tiny_model

            tiny = TinyModelSpec(
                vocab_size=spec["vocab_size"],
                hidden_size=spec["hidden_size"],
                num_layers=spec["num_layers"],
                num_heads=8,
                num_kv_heads=4,
                intermediate_size=spec["intermediate_size"],
            )
            model = build_tiny_model(tiny, seed=seed)
    return model.to(getattr(torch, spec["dtype"]))


def _shm_too_small(need: int) -> str | None:
    """Why the shared-memory cases cannot run (a container's /dev/shm is often 64 MiB), or None."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return "no /dev/shm here"
    free = st.f_bavail * st.f_frsize
    if free < need + (64 << 20):
        return f"/dev/shm has {free >> 20} MiB free, two slots of this model need {need >> 20} MiB"
    return None


def _cannot_run(case: str, device, no_shm: str | None) -> str | None:
    if case == "shared_memory_loaded":
        return no_shm
    if case == "awex_ipc_loaded":
        if device.type != "cuda":
            return "awex's IPC path shares CUDA memory: needs --device cuda"
        try:
            _awex_tensor_util()
        except Exception as exc:  # absent (ImportError), or broken against this torch/transformers
            return f"awex not importable ({type(exc).__name__}: {exc}); pip install awex"
    return None


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


def bench_device_memcpy(state_dict, repeats: int) -> dict:
    """``copy_`` of every tensor into one flat buffer on the same device, synchronized: what a
    channel that never leaves the device cannot beat."""
    import torch

    from rollbook.devices import synchronize
    from rollbook.weights.base import Layout
    from rollbook.weights.cuda_ipc import device_views

    layout = Layout.from_state_dict(state_dict)
    device = next(iter(state_dict.values())).device
    views = device_views(layout, torch.empty(layout.nbytes, dtype=torch.uint8, device=device))
    pairs = list({s.offset: (views[s.name], state_dict[s.name]) for s in layout.tensors}.values())

    def memcpy() -> None:
        for dst, src in pairs:
            dst.copy_(src)
        synchronize(device)

    memcpy()
    return {"seconds": statistics.median(_timed(memcpy) for _ in range(repeats)), "bytes": layout.nbytes}


def bench_loaded(case: str, state_dict, spec: dict, args: argparse.Namespace, device) -> dict:
    """Publish here; a spawned receiver process fetches each version and loads it into its model."""
    from rollbook.weights import CudaIpcPublisher, SharedMemoryPublisher
    from rollbook.weights.base import Layout

    nbytes = Layout.from_state_dict(state_dict).nbytes
    name = f"rollbook-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if case == "shared_memory_loaded":
        publisher = SharedMemoryPublisher(name, state_dict)
    elif case == "cuda_ipc_loaded":
        publisher = CudaIpcPublisher(name, state_dict)
    else:
        publisher = _AwexPublisher(device)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(child_conn, case, name, spec), daemon=True)
    receiver.start()
    versions = iter(range(1_000_000))

    def ask(message) -> object:
        if message is not None:
            conn.send(message)
        if not conn.poll(RECEIVER_START_S):
            raise RuntimeError(f"{case}: the receiver process did not answer within {RECEIVER_START_S:g} s")
        answer = conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"{case}: the receiver process failed:\n{answer[1]}")
        return answer

    def round_trip() -> None:
        v = next(versions)
        blob = publisher.publish(v, state_dict)
        assert ask(("load", v, blob)) == v
        if case == "awex_ipc_loaded":
            publisher.release()  # after the answer, as awex's writer frees its buffers once readers are done

    def timed_round() -> float:
        v = next(versions)
        t0 = time.perf_counter()
        blob = publisher.publish(v, state_dict)
        assert ask(("load", v, blob)) == v
        seconds = time.perf_counter() - t0
        if case == "awex_ipc_loaded":
            publisher.release()
        return seconds

    try:
        assert ask(None) == "ready"  # unasked, once its model is built and the channel open
        pings = [_timed(lambda: ask(("ping",))) for _ in range(20)]
        for _ in range(2):  # first touch of every page, the receiver's handles opened
            round_trip()
        times = [timed_round() for _ in range(args.repeats)]
    finally:
        conn.send(None)
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
        publisher.close()
    row = {"seconds": statistics.median(times), "bytes": nbytes, "receiver": f"a spawned process, its own model on {device}"}
    if case == "awex_ipc_loaded":
        row["what"] = f"awex {_awex_version()} colocated-mode data path: concatenate per dtype, CUDA IPC handles per version"
    row["pipe_roundtrip_s"] = statistics.median(pings)
    return row


def _receiver(conn, case: str, name: str, spec: dict) -> None:
    """A rollout worker's side, in a spawned process: its own model; each ``("load", v, blob)`` fetches
    and loads version ``v`` and answers ``v`` once the copy is done on the device."""
    try:
        import torch

        from rollbook.devices import synchronize
        from rollbook.weights import CudaIpcReceiver, SharedMemoryReceiver
        from rollbook.weights.base import load_into

        torch.set_num_threads(1)
        model = build_model(spec, seed=1)
        device = torch.device(spec["device"])
        if case == "shared_memory_loaded":
            channel = SharedMemoryReceiver(name, verify=False)
        elif case == "cuda_ipc_loaded":
            channel = CudaIpcReceiver(name)
        else:
            awex = _awex_tensor_util()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send("ready")
    while (message := conn.recv()) is not None:
        try:
            if message[0] == "ping":
                conn.send("pong")
                continue
            _, version, blob = message
            with torch.no_grad():
                if case == "awex_ipc_loaded":
                    weights, _ = awex.reconstruct_ipc_weights(blob, ipc_backend="cuda")
                    model.load_state_dict(weights, strict=True)
                    synchronize(device)
                    del weights  # let go of the handles: the writer frees the buffers next
                else:
                    snapshot = channel.fetch()
                    assert snapshot is not None and snapshot.version == version, (version, snapshot)
                    load_into(model, snapshot)
                    synchronize(device)
            conn.send(version)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return


class _AwexPublisher:
    """The writer side of awex's colocated mode, per version: the state dict's tensors concatenated
    per dtype into new device buffers (a copy), CUDA IPC handles of them pickled for the reader."""

    def __init__(self, device) -> None:
        self.awex = _awex_tensor_util()
        self.device = device
        self._held: list = []

    def publish(self, version: int, state_dict) -> bytes:
        from rollbook.devices import synchronize

        names = list(state_dict)
        groups, metadata = self.awex.group_tensors_by_shape_and_dtype([state_dict[n] for n in names])
        shared = [g.share_memory_() for g in groups]  # a no-op on CUDA, as in awex
        blob = self.awex.cuda_ipc_serialize((shared, metadata, names))
        synchronize(self.device)
        self._held = groups
        return blob

    def release(self) -> None:
        from rollbook.devices import synchronize

        self.awex.release_tensors(self._held)
        self._held = []
        synchronize(self.device)

    def close(self) -> None:
        self._held = []


def _awex_tensor_util():
    """``awex.util.tensor_util``: awex's colocated-mode IPC helpers. ``import awex`` also loads its
    metadata server, which needs aiohttp and requests (not in awex's declared dependencies); when
    that fails, the submodule is loaded without running the package's ``__init__``."""
    import importlib
    import importlib.util
    import types

    if "awex" not in sys.modules:
        spec = importlib.util.find_spec("awex")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("no module named 'awex'")
        try:
            importlib.import_module("awex")
        except ImportError:
            sys.modules.pop("awex", None)
            package = types.ModuleType("awex")
            package.__path__ = list(spec.submodule_search_locations)
            package.__spec__ = spec
            sys.modules["awex"] = package
    return importlib.import_module("awex.util.tensor_util")


def _awex_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("awex")
    except PackageNotFoundError:
        return "(version unknown)"


class _RayReceiver:
    """A Ray actor holding its own copy of the model, as a rollout actor does."""

    def __init__(self, spec) -> None:
        import torch

        torch.set_num_threads(1)
        self.model = build_model({**spec, "device": "cpu"}, seed=0)
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
    ids = ids.to(next(model.parameters()).device)

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
