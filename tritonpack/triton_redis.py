"""A drop-in for Triton's ``RedisRemoteCacheBackend``, for the Tritons whose own one cannot start.

Triton 3.4 to 3.9 moved the Redis settings to ``triton.knobs.redis`` but their ``RedisRemoteCacheBackend`` still
reads ``knobs.cache.redis``: the first compile of a process configured for it fails with ``AttributeError``. This
class is Triton's backend with the settings read where they are: same keys (``TRITON_REDIS_KEY_FORMAT``, default
``triton:{key}:{filename}``), same values, same ``TRITON_REDIS_HOST``/``TRITON_REDIS_PORT``, so that it reads
what ``tritonpack unpack --to-redis`` writes, and what Triton 3.0-3.3's own backend writes and reads. Use it with
Triton's own manager::

    TRITON_CACHE_MANAGER=triton.runtime.cache:RemoteCacheManager
    TRITON_REMOTE_CACHE_BACKEND=tritonpack.triton_redis:RedisRemoteCacheBackend

Imported only by Triton processes (it imports Triton).
"""
from __future__ import annotations

import os

import triton
from triton.runtime.cache import RemoteCacheBackend

DEFAULT_KEY_FORMAT = "triton:{key}:{filename}"


def settings() -> tuple[str, str, int]:
    """Key format, host, port: from ``triton.knobs.redis`` where it exists (3.4+), else the environment (3.0-3.3)."""
    knobs = getattr(getattr(triton, "knobs", None), "redis", None)
    if knobs is not None:
        return knobs.key_format, knobs.host, int(knobs.port)
    return (os.environ.get("TRITON_REDIS_KEY_FORMAT", DEFAULT_KEY_FORMAT),
            os.environ.get("TRITON_REDIS_HOST", "localhost"), int(os.environ.get("TRITON_REDIS_PORT", 6379)))


class RedisRemoteCacheBackend(RemoteCacheBackend):
    """Triton's ``RedisRemoteCacheBackend``, with its settings read from where Triton keeps them."""

    def __init__(self, key: str):
        import redis

        self._key = key
        self._key_fmt, host, port = settings()
        self._redis = redis.Redis(host=host, port=port)

    def _get_key(self, filename: str) -> str:
        return self._key_fmt.format(key=self._key, filename=filename)

    def get(self, filenames: list[str]) -> dict[str, bytes]:
        results = self._redis.mget([self._get_key(f) for f in filenames])
        return {filename: result for filename, result in zip(filenames, results, strict=True) if result is not None}

    def put(self, filename: str, data: bytes) -> None:
        self._redis.set(self._get_key(filename), data)
