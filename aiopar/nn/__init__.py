"""Numpy float32 inference modules, PyTorch-compatible by state-dict key.

`LSTM` has `torch.nn.LSTM`'s inference semantics; `BidirectionalRecurrentLSTM`
and `LSTMEnsemble` are the models of the TorchScript dynamic-parallelism
tutorial, run on aiopar's fork/wait. A module is called like a function,
``ens(x)``, or forked, ``await aiopar.fork(ens, x)``.
"""

from .ensemble import BidirectionalRecurrentLSTM, LSTMEnsemble
from .lstm import LSTM
from .module import IncompatibleKeys, Module, ModuleList

__all__ = [
    "LSTM",
    "BidirectionalRecurrentLSTM",
    "IncompatibleKeys",
    "LSTMEnsemble",
    "Module",
    "ModuleList",
]
