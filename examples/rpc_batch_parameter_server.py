"""PyTorch's batch-updating parameter server on ``aiopar.rpc``: ``@rpc.functions.async_execution``.

https://pytorch.org/tutorials/intermediate/rpc_async_execution.html

The parameter server updates its model once every trainer has sent the
gradients of a batch. A trainer's call to ``update_and_fetch_model``
returns a Future, which the server settles with the updated model once
the last trainer's gradients are in: with ``@rpc.functions.async_execution``
the reply goes out only then, and no server thread waits meanwhile. So
the trainers move in step: each trains batch ``i`` on the model of ``i``
updates, which each trainer prints.

What differs from the tutorial: numpy instead of torch, so the model is a
linear layer over small random images (the tutorial trains torchvision's
ResNet-50) whose gradient of the MSE loss is written out, and
``torch.optim.SGD``'s update with momentum is a small class here; the
futures are ``aiopar.Future``. Two trainers update the model together
(the tutorial: five), in three processes.

Run each rank in a process of its own (rank 0 is the server):

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
    python examples/rpc_batch_parameter_server.py 0 &
    python examples/rpc_batch_parameter_server.py 1 &
    python examples/rpc_batch_parameter_server.py 2
"""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np

import aiopar
from aiopar import rpc

batch_size = 20
image_w = 8
image_h = 8
num_classes = 30
batch_update_size = 2
num_batches = 6


class Model:
    """A linear layer over the flattened images (the tutorial's ResNet-50)."""

    def __init__(self):
        rng = np.random.default_rng(0)
        in_features = 3 * image_w * image_h
        bound = 1 / np.sqrt(in_features)  # nn.Linear's initialisation
        self.weight = rng.uniform(-bound, bound, (num_classes, in_features))
        self.bias = rng.uniform(-bound, bound, num_classes)
        self.updates = 0  # the optimizer steps it has taken

    def parameters(self):
        return [self.weight, self.bias]

    def __call__(self, inputs):
        return inputs.reshape(len(inputs), -1) @ self.weight.T + self.bias


def mse_loss_and_grads(model, inputs, labels):
    """nn.MSELoss()(model(inputs), labels), and the gradient of each of the
    model's parameters (what loss.backward() leaves in their .grad)."""
    x = inputs.reshape(len(inputs), -1)
    error = model(inputs) - labels
    grad_output = 2 * error / error.size
    return (error**2).mean(), [grad_output.T @ x, grad_output.sum(axis=0)]


class SGD:
    """torch.optim.SGD(params, lr, momentum)'s step, for gradients passed to it."""

    def __init__(self, params, lr, momentum=0.0):
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.momentum_buffers = [None] * len(params)

    def step(self, grads):
        for i, (param, grad) in enumerate(zip(self.params, grads, strict=True)):
            buf = self.momentum_buffers[i]
            buf = grad.copy() if buf is None else self.momentum * buf + grad
            self.momentum_buffers[i] = buf
            param -= self.lr * buf


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size=batch_update_size):
        self.model = Model()
        self.lock = threading.Lock()
        self.future_model = aiopar.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = SGD(self.model.parameters(), lr=0.001, momentum=0.9)
        self.grads = [np.zeros_like(p) for p in self.model.parameters()]  # each p.grad

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        # The RRef's value is this process's server.
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for acc, g in zip(self.grads, grads, strict=True):
                acc += g
            # This call's reply: the model after the update that this
            # batch's gradients take part in, whichever trainer's come last.
            fut = self.future_model

            if self.curr_update_size >= self.batch_update_size:
                for acc in self.grads:
                    acc /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step(self.grads)
                self.model.updates += 1
                for acc in self.grads:  # optimizer.zero_grad()
                    acc.fill(0)
                # Settling it sends the replies of every call of this batch.
                fut.set_result(self.model)
                self.future_model = aiopar.Future()

        return fut


class Trainer:
    def __init__(self, ps_rref, seed):
        self.ps_rref = ps_rref
        self.rng = np.random.default_rng(seed)
        self.one_hot_indices = self.rng.integers(num_classes, size=(batch_size, 1))

    def get_next_batch(self):
        for _ in range(num_batches):
            inputs = self.rng.standard_normal((batch_size, 3, image_w, image_h))
            labels = np.zeros((batch_size, num_classes))
            np.put_along_axis(labels, self.one_hot_indices, 1, axis=1)
            yield inputs, labels

    def train(self):
        name = rpc.get_worker_info().name
        m = self.ps_rref.rpc_sync().get_model()
        for i, (inputs, labels) in enumerate(self.get_next_batch()):
            loss, grads = mse_loss_and_grads(m, inputs, labels)
            print(f"{name} batch {i}: loss {loss:.4f} on the model of {m.updates} updates")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, grads),
            )


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref, seed=rpc.get_worker_info().id)
    trainer.train()


def run_ps(trainers):
    print("Start training")
    ps_rref = rpc.RRef(BatchUpdateParameterServer())
    futs = []
    for trainer in trainers:
        futs.append(rpc.rpc_async(trainer, run_trainer, args=(ps_rref,)))

    aiopar.wait_all(futs)
    print(f"Finish training: the model took {ps_rref.local_value().model.updates} updates")


def run(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16,
        rpc_timeout=0,  # no limit
    )
    if rank != 0:
        rpc.init_rpc(
            f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options
        )
        # a trainer waits for the server to start its training
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_ps([f"trainer{r}" for r in range(1, world_size)])

    # until every peer is done
    rpc.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Batch-updating parameter server")
    parser.add_argument("rank", type=int, help="this process's rank: 0 for the parameter server")
    run(parser.parse_args().rank, world_size=batch_update_size + 1)
