"""kvpager: a paged KV-cache memory manager for LLM serving, offered as a gRPC service.

Subpackages map onto the repository's top-level folders (see pyproject.toml):
``kvpager.manager`` (manager/), ``kvpager.worker`` (worker/), ``kvpager.kernels`` (kernels/).
This top package holds the typed client and the generated protobuf code (``kvpager.v1``).
"""

from importlib import metadata


def package_version() -> str:
    """The installed distribution's version ("unknown" when run from a checkout not installed)."""
    try:
        return metadata.version("kvpager")
    except metadata.PackageNotFoundError:
        return "unknown"
