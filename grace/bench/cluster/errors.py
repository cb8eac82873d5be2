"""What the emulated cluster raises."""
from __future__ import annotations


class ClusterError(RuntimeError):
    """Setting up, using or tearing down the emulated cluster failed."""


class PrivilegeError(ClusterError):
    """The caller may not create network namespaces or shape links."""


class VerificationError(ClusterError):
    """Measured throughput (or latency) is not what the links were configured to."""

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


class UnverifiedError(VerificationError):
    """The configured rate is beyond what this machine can carry: the link is CPU-bound, not
    shaped, so its rate cannot be certified."""
