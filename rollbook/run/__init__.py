"""``rollbook run``: the orchestration of a whole run on an embedded store.

``main`` (the command's body: the run directory, the store child, the placement chosen),
``colocated``, ``separated``, ``online`` and ``ray_cluster`` (the placements), ``driving`` (metrics
file and the drive loop with the run's settings), ``inputs`` (the files a run names, checked before
its store starts) and ``store_process`` (the ``rollbook serve`` child).
"""
