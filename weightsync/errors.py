"""The small set of exceptions every component raises.

Permanent errors mean "this input will never work; fix it" (a model mismatch, a
corrupt shard, an unknown channel). Retryable errors mean "the world was not ready"
(a peer timed out, a lease expired). Messages name the field or tensor, what was
received, what was expected, and what to do.
"""

from __future__ import annotations


class WeightsyncError(Exception):
    """Base of every weightsync error."""


class PermanentError(WeightsyncError):
    """Retrying with the same input fails the same way."""


class RetryableError(WeightsyncError):
    """The same call may succeed later (timeouts, lost peers)."""


class ModelMismatchError(PermanentError):
    """The sender's tensors do not match what the receiver expects."""


class IntegrityError(PermanentError):
    """Bytes were lost or altered: a truncated shard, a wrong checksum."""


class TransferTimeoutError(RetryableError):
    """A blocking transfer step did not finish within its timeout."""
