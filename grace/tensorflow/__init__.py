"""The Horovod TensorFlow adapter: ``hvd.DistributedGradientTape`` and Keras's
``DistributedOptimizer`` carrying grace methods. Imports horovod.tensorflow, never horovod.torch."""
from grace.tensorflow.gradients import GradientExchange, exchange_for
from grace.tensorflow.state import VariableStore, VariableWireStats

__all__ = ["GradientExchange", "VariableStore", "VariableWireStats", "exchange_for"]
