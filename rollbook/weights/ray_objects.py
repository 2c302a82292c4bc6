"""Ray's object store as a weight channel: the ray placement's default (rollbook/run/ray_cluster.py).

``bench/weights.py --ray`` measured it against the network channel into a Ray actor holding its own
model (48 MiB, docs/RESULTS.md "Weight channel"): 0.035 s against 0.218 s on the publisher's node
and 0.087 s against 0.219 s on another node of the cluster. Ray's object store moves the buffer
(shared memory on one node, its object manager between nodes) without the network channel's
chunked stream and its blake2b on both ends.

- a ``WeightBoard`` actor (named; the launcher creates it, so it outlives trainer restarts) holds the
  newest version: its number, the object ref of its flat buffer (``base.Layout``) and the layout;
- ``RayObjectPublisher`` (trainer rank 0): packs the state dict into one flat buffer, ``ray.put``\\ s
  it and tells the board; the object is owned by the trainer process, so a trainer that dies takes
  its versions with it, and the restarted one publishes its resumed version again;
- ``RayObjectReceiver`` (a rollout actor, ``weights = "ray:BOARD"``): asks the board for anything
  newer than it holds and ``ray.get``\\ s the buffer (zero copy on the same node). A board or object
  that cannot be reached (the trainer restarting) is ``None``, as an unreachable weight server is:
  generation goes on with the resident weights under the staleness gate.

No checksum: the object store hands back exactly the bytes that were put, or an error. Ray is
imported inside the functions (it is an optional extra).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rollbook.weights.base import Layout, WeightSnapshot, pack_into, tensor_views

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("rollbook.weights")

UNREACHABLE_LOG_EVERY_S = 30.0


class WeightBoard:
    """The newest published version (a Ray actor: ``ray.remote(WeightBoard)``). Refs travel inside a
    list so that Ray passes the reference, not the object."""

    def __init__(self) -> None:
        self._latest: tuple[int, list, bytes] | None = None

    def put(self, version: int, refs: list, layout_json: bytes) -> None:
        """The newest publish wins, even an older version: a restarted trainer publishes the version
        it resumed from, and the objects of the one that died went with it."""
        self._latest = (version, refs, layout_json)

    def latest(self, have_version: int) -> tuple[int, list, bytes] | None:
        """The newest version when it is not ``have_version`` (None otherwise)."""
        if self._latest is None or self._latest[0] == have_version:
            return None
        return self._latest


def create_board(name: str):
    """The board actor, named ``name`` in the job's namespace (fails if the name is taken)."""
    import ray

    return ray.remote(WeightBoard).options(name=name, num_cpus=0, max_restarts=0).remote()


class RayObjectPublisher:
    """Trainer end: ``publish(version, state_dict)`` puts the flat buffer and tells the board
    (waiting for the board's answer, so versions reach it in order)."""

    def __init__(self, board_name: str) -> None:
        import ray

        self._board = ray.get_actor(board_name)
        self._layout: Layout | None = None
        self._flat: np.ndarray | None = None
        self._views: dict[str, torch.Tensor] = {}

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        import ray

        if self._layout is None:
            self._layout = Layout.from_state_dict(state_dict)
            self._flat = np.zeros(self._layout.nbytes, dtype=np.uint8)
            self._views = tensor_views(self._layout, self._flat)
        pack_into(self._layout, state_dict, self._views)  # checks the state dict still fits the layout
        ref = ray.put(self._flat)  # copied into the object store: the buffer is ours again at once
        ray.get(self._board.put.remote(version, [ref], self._layout.to_json()))

    def close(self) -> None:
        self._views, self._flat = {}, None


class RayObjectReceiver:
    """Rollout end of the board named ``board_name``. ``FileNotFoundError`` when there is no such
    board (yet): ``rollbook rollout`` waits for a channel to appear as it does for shared memory."""

    def __init__(self, board_name: str, *, timeout_s: float = 120.0) -> None:
        import ray

        try:
            self._board: Any = ray.get_actor(board_name)
        except ValueError:
            raise FileNotFoundError(f"no weight board {board_name!r} in this Ray job") from None
        self.board_name, self._timeout_s = board_name, timeout_s
        self._version = -1
        self._last_said = float("-inf")

    @property
    def version(self) -> int:
        return self._version

    def fetch(self) -> WeightSnapshot | None:
        """The newest version if it is not the one held; None when up to date or unreachable."""
        import ray

        try:
            latest = ray.get(self._board.latest.remote(self._version), timeout=self._timeout_s)
            if latest is None:
                return None
            version, refs, layout_json = latest
            flat = ray.get(refs[0], timeout=self._timeout_s)  # read-only: a view of the object store
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            now = time.monotonic()
            if now - self._last_said >= UNREACHABLE_LOG_EVERY_S:
                self._last_said = now
                log.warning(
                    "weight board %s unreachable (%s); keeping version %d (said at most every %.0f s)",
                    self.board_name,
                    type(exc).__name__,
                    self._version,
                    UNREACHABLE_LOG_EVERY_S,
                )
            return None
        with warnings.catch_warnings():  # torch warns that the buffer is read-only: the views are only read
            warnings.simplefilter("ignore", UserWarning)
            views = tensor_views(Layout.from_json(layout_json), flat)
        self._version = version
        return WeightSnapshot(version, views, b"")

    def close(self) -> None:
        self._board = None
