"""LLM worker: the target model, drafters, verification, the decode loop and the gRPC server."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specdraft")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
