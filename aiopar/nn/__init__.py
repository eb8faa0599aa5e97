"""Numpy float32 inference modules, PyTorch-compatible by state-dict key.

`LSTM` has `torch.nn.LSTM`'s inference semantics; `BidirectionalRecurrentLSTM`
and `LSTMEnsemble` are the models of the TorchScript dynamic-parallelism
tutorial, run on aiopar's fork/wait. A module is called like a function,
``ens(x)``, or forked, ``await aiopar.fork(ens, x)``.

The LSTM's recurrent step runs through numpy (BLAS), or through oneDNN when
``aiopar[onednn]`` is installed and has a packed kernel for this CPU:
`lstm_engine` says which, `set_lstm_engine` (or ``AIOPAR_LSTM_ENGINE``)
chooses.
"""

from aiopar.lowlevel import add_info_lines

from ._engine import engine_info, lstm_engine, set_lstm_engine
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
    "lstm_engine",
    "set_lstm_engine",
]

add_info_lines(engine_info)
