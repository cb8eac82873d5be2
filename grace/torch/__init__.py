"""grace on Horovod's PyTorch API. Importing this imports torch and horovod.torch."""
import horovod.torch  # noqa: F401  (installs grace's route through hvd.DistributedOptimizer)

from grace.torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
