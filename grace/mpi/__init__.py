"""The reference transport: NumPy payloads over mpi4py, with no toolkit and no Horovod."""
from grace.mpi.communicator import MPICommunicator

__all__ = ["MPICommunicator"]
