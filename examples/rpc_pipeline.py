"""PyTorch's distributed pipeline parallelism tutorial on ``aiopar.rpc``: RRefs as the pipeline.

https://pytorch.org/tutorials/intermediate/dist_pipeline_parallel_tutorial.html

The model is split in two shards, the first on ``worker1`` and the second
on ``worker2``; the master holds RRefs to them. It splits each batch into
micro-batches and, for each, asks the first shard for an RRef of its
output (``remote``) and hands that RRef to the second shard
(``rpc_async``), which fetches it from the first: the master never sees
the intermediate activations, and micro-batch ``k + 1`` goes through the
first shard while micro-batch ``k`` goes through the second.

What differs from the tutorial, since numpy has no autograd: the shards
are two small stacks of linear layers and ReLUs (the tutorial splits
torchvision's ResNet-50); ``dist_autograd.backward`` is a backward pass
that the master pipelines through the shards as it does the forward
pass, each shard keeping its activations per micro-batch until then; and
the ``DistributedOptimizer``'s step is a call to each shard. The
tutorial starts its three processes anew for each number of splits;
here the master trains a new model for each, in one run.

Run each rank in a process of its own (rank 0 is the master):

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
    python examples/rpc_pipeline.py 0 &
    python examples/rpc_pipeline.py 1 &
    python examples/rpc_pipeline.py 2

For each number of splits the master prints the loss of each batch:
the same for 1, 2, 4 and 8 micro-batches, since pipelining changes the
schedule and not the arithmetic.
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time

import numpy as np

import aiopar
from aiopar import rpc
from aiopar.rpc import RRef

num_classes = 10
in_features = 64
hidden = 128

num_batches = 3
batch_size = 120


class Linear:
    """nn.Linear, with the backward pass autograd would run."""

    def __init__(self, rng, in_features, out_features):
        bound = 1 / np.sqrt(in_features)  # nn.Linear's initialisation
        self.weight = rng.uniform(-bound, bound, (out_features, in_features))
        self.bias = rng.uniform(-bound, bound, out_features)

    def parameters(self):
        return [self.weight, self.bias]

    def forward(self, x):
        return x @ self.weight.T + self.bias

    def backward(self, x, grad_out):
        """The gradients of the input, the weight and the bias."""
        return grad_out @ self.weight, grad_out.T @ x, grad_out.sum(axis=0)


class Shard:
    """Linear layers, each followed by a ReLU but perhaps the last: one part of the model.

    The forward pass of a micro-batch keeps what its backward pass needs;
    the backward pass keeps the parameters' gradients until the optimizer's
    step, which adds them up over the micro-batches in their order."""

    def __init__(self, seed, sizes, relu_last):
        rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.layers = [Linear(rng, n_in, n_out) for n_in, n_out in itertools.pairwise(sizes)]
        self.relu = [True] * (len(self.layers) - 1) + [relu_last]
        self.saved = {}  # (context id, micro-batch) -> each layer's input and ReLU mask
        self.grads = {}  # (context id, micro-batch) -> each parameter's gradient

    def forward(self, key, x_rref):
        x = x_rref.to_here()
        with self._lock:
            saved = []
            for layer, relu in zip(self.layers, self.relu, strict=True):
                y = layer.forward(x)
                saved.append((x, y > 0 if relu else None))
                x = np.maximum(y, 0) if relu else y
            self.saved[key] = saved
        return x

    def backward(self, key, grad_rref):
        """The loss's gradient at this shard's input, from the one at its output."""
        grad = grad_rref.to_here()
        with self._lock:
            saved = self.saved.pop(key)
            grads = []
            for layer, (x, mask) in zip(reversed(self.layers), reversed(saved), strict=True):
                if mask is not None:
                    grad = grad * mask
                grad, grad_weight, grad_bias = layer.backward(x, grad)
                grads[:0] = [grad_weight, grad_bias]
            self.grads[key] = grads
        return grad

    def step(self, context_id, lr):
        """DistributedOptimizer(optim.SGD, params, lr=lr).step(context_id), for this shard."""
        params = [param for layer in self.layers for param in layer.parameters()]
        with self._lock:
            keys = sorted(key for key in self.grads if key[0] == context_id)
            for i, param in enumerate(params):
                param -= lr * sum(self.grads[key][i] for key in keys)
            for key in keys:
                del self.grads[key]


class Shard1(Shard):
    """The first part of the model (the tutorial's ResNetShard1)."""

    def __init__(self):
        super().__init__(seed=1, sizes=[in_features, hidden, hidden], relu_last=True)


class Shard2(Shard):
    """The second part of the model, ending in the classes' scores (the tutorial's ResNetShard2)."""

    def __init__(self):
        super().__init__(seed=2, sizes=[hidden, hidden, num_classes], relu_last=False)


class DistNet:
    """The two shards as one model, and the pipelining (the tutorial's DistResNet50)."""

    def __init__(self, split_size, workers):
        self.split_size = split_size
        # The first shard on workers[0], the second on workers[1].
        self.p1_rref = rpc.remote(workers[0], Shard1)
        self.p2_rref = rpc.remote(workers[1], Shard2)

    def forward(self, context_id, xs):
        # One call of each shard per micro-batch, all in flight at once.
        out_futures = []
        for k, x in enumerate(self._split(xs)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward((context_id, k), x_rref)
            z_fut = self.p2_rref.rpc_async().forward((context_id, k), y_rref)
            out_futures.append(z_fut)
        return np.concatenate(aiopar.wait_all(out_futures))

    def backward(self, context_id, grad_output):
        """dist_autograd.backward: the loss's gradient goes back through the
        shards, micro-batch by micro-batch, pipelined as the forward pass."""
        futs = []
        for k, grad in enumerate(self._split(grad_output)):
            grad_rref = self.p2_rref.remote().backward((context_id, k), RRef(grad))
            futs.append(self.p1_rref.rpc_async().backward((context_id, k), grad_rref))
        aiopar.wait_all(futs)

    def step(self, context_id, lr):
        aiopar.wait_all(
            [rref.rpc_async().step(context_id, lr) for rref in (self.p1_rref, self.p2_rref)]
        )

    def _split(self, xs):
        return [xs[i : i + self.split_size] for i in range(0, len(xs), self.split_size)]


def mse_loss(outputs, labels):
    """nn.MSELoss()(outputs, labels), and its gradient with respect to ``outputs``."""
    error = outputs - labels
    return (error**2).mean(), 2 * error / error.size


def run_master(split_size):
    # The two shards on worker1 and worker2.
    model = DistNet(split_size, ["worker1", "worker2"])
    rng = np.random.default_rng(0)
    one_hot_indices = rng.integers(num_classes, size=(batch_size, 1))
    losses = []
    for i in range(num_batches):
        print(f"Processing batch {i}")
        # random inputs and labels
        inputs = rng.standard_normal((batch_size, in_features))
        labels = np.zeros((batch_size, num_classes))
        np.put_along_axis(labels, one_hot_indices, 1, axis=1)

        context_id = i  # what dist_autograd.context() names: this pass
        outputs = model.forward(context_id, inputs)
        loss, grad_output = mse_loss(outputs, labels)
        model.backward(context_id, grad_output)
        model.step(context_id, lr=0.05)
        losses.append(loss)
    return losses


def run_worker(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=300)

    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        for num_split in [1, 2, 4, 8]:
            tik = time.time()
            losses = run_master(batch_size // num_split)
            tok = time.time()
            print(
                f"number of splits = {num_split}, losses = "
                f"{' '.join(f'{loss:.6f}' for loss in losses)}, execution time = {tok - tik:.3f} s"
            )
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
        # a worker serves the master's calls

    # until every peer is done
    rpc.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Pipeline parallelism with RPC and RRefs")
    parser.add_argument("rank", type=int, help="this process's rank: 0 for the master")
    run_worker(parser.parse_args().rank, world_size=3)
