"""weightsync core: the typed models, channels, coordinator, metrics and CLI shared by every component.

Import names: ``weightsync`` (this core), ``weightsync_trainer`` (the publisher),
``weightsync_inference`` (the vLLM plugin and replica agent), ``weightsync_operator``
(the Kubernetes operator). Torch is imported only inside ``weightsync.channels``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
