"""Building and serving the proxy: the engine from its config, the loopback rule, uvicorn on a thread,
and ``serve`` (what ``rollbook proxy`` runs)."""

import functools
import threading
import time

from rollbook.config import ProxyConfig
from rollbook.rollout.engine import GenerationEngine
from rollbook.rollout.proxy.app import create_app
from rollbook.rollout.proxy.core import Proxy, read_state_dict

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# below this many parameters the native engine decodes on one PyTorch thread (ProxyConfig.torch_threads)
SMALL_MODEL_PARAMETERS = 10_000_000


def torch_threads(configured: int | None, num_parameters: int | None, available: int) -> int:
    """The engine's PyTorch intra-op threads: ``configured`` when set; 1 for a model under
    ``SMALL_MODEL_PARAMETERS`` (measured on the 2-core reference machine, tiny model: the first
    streamed token 5.9 ms instead of 10-12 ms, the call no slower); else ``available`` up to 4."""
    if configured is not None:
        return configured
    if num_parameters is not None and num_parameters < SMALL_MODEL_PARAMETERS:
        return 1
    return max(1, min(4, available))


def build_engine(config: ProxyConfig) -> GenerationEngine:
    """The served engine, sized by the proxy's workload: sequences of ``max_context_tokens`` (refused in
    one line when the model has fewer positions), ``proxy_batch_size`` of them at once (native)."""
    from rollbook.rollout.engines import check_proxy_fits

    if config.engine == "vllm":
        from rollbook.rollout.vllm_engine import VllmEngine

        if not config.model.path:
            from rollbook.errors import ConfigError

            raise ConfigError("engine = 'vllm' needs model.path (a local model directory)")
        check_proxy_fits(config)
        return VllmEngine(config.model.path, version=config.version, max_model_len=config.max_context_tokens)
    check_proxy_fits(config)
    if config.engine_process:
        from rollbook.rollout.engine_process import EngineProcess

        return EngineProcess(functools.partial(native_engine, config))
    return native_engine(config)


def native_engine(config: ProxyConfig) -> GenerationEngine:
    """The native engine of ``config``, built in this process (with ``engine_process``: the child's);
    its PyTorch threads set by ``torch_threads``."""
    import torch

    from rollbook.devices import place
    from rollbook.language_models import build_student
    from rollbook.rollout.engine import NativeEngine
    from rollbook.rollout.engines import proxy_batch_size

    available = torch.get_num_threads()
    model = place(build_student(config.model), config.device, config.dtype)
    if config.checkpoint:
        model.load_state_dict(read_state_dict(config.checkpoint), strict=True)
    # with a weight channel the built weights are never served: version -1 until the first one arrives
    version = -1 if config.weights else config.version
    engine = NativeEngine(
        model,
        version=version,
        seed=config.seed,
        max_batch_size=proxy_batch_size(config),
        max_seq_len=config.max_context_tokens,
    )
    torch.set_num_threads(torch_threads(config.torch_threads, engine.num_parameters, available))
    return engine


def check_exposure(config: ProxyConfig, admin_key: str | None, worker_key: str | None) -> None:
    if config.host not in LOOPBACK and (admin_key is None or worker_key is None):
        from rollbook.errors import ConfigError

        raise ConfigError(
            f"host {config.host} is not loopback: set ROLLBOOK_ADMIN_KEY and ROLLBOOK_WORKER_KEY, else anyone "
            "who reaches the port may start sessions and load weights"
        )


class ProxyServer:
    """The app under uvicorn on its own thread (tests, ``rollbook run``); ``url`` once started."""

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        import uvicorn

        self.proxy = proxy
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(proxy),
                log_level="warning",
                access_log=False,
                proxy_headers=False,  # no client address is used: no forwarded-for middleware per request
                timeout_graceful_shutdown=5,
            )
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ProxyServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy's HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.proxy.close()


def serve(config: ProxyConfig, stop: threading.Event | None = None) -> None:
    """``rollbook proxy``: build the engine, serve until ``stop`` is set (None: SIGINT/SIGTERM set it;
    the CLI passes ``rollbook.lifetime.stop_event()``, also set when a tied parent dies)."""
    from rollbook import environment as env

    admin_key, worker_key = env.role_key("admin"), env.role_key("worker")
    check_exposure(config, admin_key, worker_key)  # before anything slow is imported
    from rollbook.client import StoreClient
    from rollbook.rollout.engines import close_engine

    engine = build_engine(config)
    client = StoreClient.from_env(config.server)
    proxy = Proxy(config, engine, client, admin_key=admin_key, worker_key=worker_key)
    server = ProxyServer(proxy, config.host, config.port).start()
    print(f"listening on {server.url}", flush=True)
    if stop is None:
        from rollbook.lifetime import stop_event  # a handler that takes no lock (StopEvent)

        stop = stop_event()
    try:
        while not stop.is_set() and server.thread.is_alive():
            stop.wait(0.5)
    finally:
        server.stop()
        client.close()
        close_engine(engine)  # an engine process ends with it
