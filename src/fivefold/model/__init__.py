from .loss import loss_sum
from .transformer import Transformer

__all__ = ["Transformer", "loss_sum"]
