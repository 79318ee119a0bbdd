"""What an actor call's result costs to return, by size, on rayfl's private Ray instance: a call returning
``n`` bytes (as ``bytes`` and as a numpy array) against ``ray.put`` of the same bytes inside the actor,
timed from the driver until the result exists (not fetched). Results up to ``rayfl.session.INLINE_BYTES`` (4 MiB)
travel inside the reply, larger ones through the object store. This is the price of the clients' per-round
in-memory snapshot when their blobs are large (FedFomo: about 1.3 MB a client, its weights and baseline).

    .venv/bin/python benchmarks/return_cost.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rayfl.session import init_ray, shutdown_ray  # noqa: E402

SIZES = (50_000, 500_000, 1_300_000, 3_000_000, 6_400_000)


def main() -> None:
    init_ray(None)
    import ray

    @ray.remote
    class Actor:
        def __init__(self):
            self.data = os.urandom(8 << 20)

        def as_bytes(self, n):
            return self.data[:n]

        def as_array(self, n):
            return np.frombuffer(self.data[:n], dtype=np.uint8)

        def put_here(self, n):
            t = time.perf_counter()
            ray.put(self.data[:n])
            return time.perf_counter() - t

        def nothing(self):
            return 0

    actor = Actor.remote()
    ray.get(actor.nothing.remote())

    def timed(method, *args) -> float:
        times = []
        for _ in range(30):
            t = time.perf_counter()
            ref = method.remote(*args)
            ray.wait([ref], fetch_local=False)
            times.append(time.perf_counter() - t)
            del ref
        return statistics.median(times) * 1e3

    try:
        print(f"a call returning nothing: {timed(actor.nothing):.2f} ms (median of 30)")
        for n in SIZES:
            put = statistics.median(ray.get([actor.put_here.remote(n) for _ in range(30)])) * 1e3
            print(f"  {n:9,d} bytes returned: as bytes {timed(actor.as_bytes, n):5.2f} ms, as an array "
                  f"{timed(actor.as_array, n):5.2f} ms; ray.put inside the actor {put:5.2f} ms")
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
