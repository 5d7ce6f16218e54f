"""Does rung's GOMP_SPINCOUNT reach OpenMP? CPU time per wall second of a loop of short
parallel regions separated by 5 ms sleeps, where idle OpenMP workers spin (burning CPU) or
sleep. Run it with and without the policy, in fresh interpreters:

    python -m rung.bench.spin_proof; RUNG_THREAD_POLICY=off python -m rung.bench.spin_proof
"""

# NOTE: rung before torch: OpenMP reads GOMP_SPINCOUNT once, when torch loads it
import rung  # noqa: F401, I001

import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    x = torch.randn(2000, 2000)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(100):
        (x * 2).sum()          # a parallel region, then the workers go idle
        time.sleep(0.005)
    ratio = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}: CPU s per wall s {ratio:.3f}")


if __name__ == "__main__":
    main()
