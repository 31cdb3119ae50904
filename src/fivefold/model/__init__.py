from .transformer import Transformer, loss_sum

__all__ = ["Transformer", "loss_sum"]
