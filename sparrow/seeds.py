"""Seed mixing: every derived seed of a job comes from these functions, so runs are reproducible
wherever they are computed (driver, rollout workers, engines, calibration)."""

MASK64 = (1 << 64) - 1


def stable_seed(*parts) -> int:
    """A stable 63-bit seed from ints (Python's hash of strings is salted per process): per-worker engine
    seeds, per-request sampling seeds, data order."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & MASK64)) * 0xBF58476D1CE4E5B9 & MASK64
        x ^= x >> 31
    return x >> 1


def mix_seed(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): distinct, well-spread generator seeds per sample and position."""
    x = (seed * 0x9E3779B97F4A7C15 + counter + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request seeded `base` (both rollout engines draw sample j with it)."""
    return mix_seed(base, index)
