"""Content hashes that identify full KV blocks for prefix caching.

A block's hash chains over the hash of the block before it and its own token ids, so two
blocks match only when the whole prefix up to and including them matches. The chain
starts from a per-namespace root, so tenants in different namespaces never share blocks.
BLAKE2b with 128-bit digests: fast, and collisions (which would silently serve another
prompt's K/V) are out of reach, unlike Python's 64-bit ``hash``.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Sequence

_DIGEST = 16


def root_hash(namespace: str) -> bytes:
    return blake2b(b"kvpager/prefix/v1\0" + namespace.encode(), digest_size=_DIGEST).digest()


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return blake2b(parent + array("q", token_ids).tobytes(), digest_size=_DIGEST).digest()
