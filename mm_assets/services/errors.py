"""Errors that stop a service's step, shared by the services (each names what to do)."""


class ServerUnavailable(RuntimeError):
    """vLLM stopped answering mid-run; what was stored is kept for the rerun."""


class DiskBudgetError(RuntimeError):
    """The results to request cannot fit on the disk that would store them."""
