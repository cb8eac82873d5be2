"""The toolkit-neutral GRACE pipeline: compressor, memory, collectives, exchange."""
from grace.core.communicator import Communicator, Handle
from grace.core.compression import GradientCompression
from grace.core.compressor import Collective, Compressor, TensorInfo
from grace.core.exchange import Exchange, WireStats
from grace.core.memory import Memory

__all__ = ["Collective", "Communicator", "Compressor", "Exchange", "GradientCompression", "Handle",
           "Memory", "TensorInfo", "WireStats"]
