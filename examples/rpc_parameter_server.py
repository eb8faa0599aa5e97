"""PyTorch's parameter server tutorial on ``aiopar.rpc``, with numpy arrays for tensors.

https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html

One process, the parameter server, holds the model. Each trainer makes an
RRef to it with ``rpc.remote("parameter_server", get_parameter_server)``
and trains through it: the server runs the forward pass, the trainer
computes the loss, the server gets the gradient back and takes the
optimizer step. Every trainer reaches the same server, because the first
call to ``get_parameter_server`` makes it under the module's lock and
keeps it in the module's ``param_server``: a function of this script
travels by name to a peer that runs the same script, so that lock and
that global are the server process's own, as in torch.

What differs from the tutorial, since numpy has no autograd: the network
is a linear layer and log_softmax over 8x8 "digits" made from ten noisy
prototypes (no MNIST download), ``dist_autograd.backward(cid, [loss])``
is a call that hands the server the loss's gradient, and the
``DistributedOptimizer``'s ``opt.step(cid)`` a call that takes the SGD
step there (with a learning rate of 0.1, not 0.03, so that ten batches
train it). Three processes instead of four by default: the server and
two trainers (``--world_size`` changes it on every rank).

Run each rank in a process of its own (rank 0 is the server):

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
    python examples/rpc_parameter_server.py 0 &
    python examples/rpc_parameter_server.py 1 &
    python examples/rpc_parameter_server.py 2

Each trainer prints its loss every fifth batch and its accuracy on the
test set; the server prints how many optimizer steps it took, one per
batch of each trainer.
"""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np

from aiopar import rpc

NUM_CLASSES = 10
IMAGE_SIZE = 8 * 8
BATCH_SIZE = 32
TRAIN_BATCHES = 10
TEST_BATCHES = 4
LEARNING_RATE = 0.1


# --------- The network ---------


class Net:
    """The tutorial's MNIST network, as small as numpy trains it by hand:
    a linear layer and log_softmax."""

    def __init__(self):
        rng = np.random.default_rng(0)
        bound = 1 / np.sqrt(IMAGE_SIZE)  # nn.Linear's initialisation
        self.weight = rng.uniform(-bound, bound, (NUM_CLASSES, IMAGE_SIZE))
        self.bias = rng.uniform(-bound, bound, NUM_CLASSES)

    def parameters(self):
        return {"weight": self.weight, "bias": self.bias}

    def forward(self, x):
        logits = x @ self.weight.T + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))  # log_softmax

    def gradients(self, x, output, grad_output):
        """What autograd computes: the parameters' gradients, from the
        forward pass's input and output and the loss's gradient at the output."""
        grad_logits = grad_output - np.exp(output) * grad_output.sum(axis=1, keepdims=True)
        return {"weight": grad_logits.T @ x, "bias": grad_logits.sum(axis=0)}


def nll_loss(output, target):
    """F.nll_loss, and its gradient at ``output`` (where loss.backward() starts)."""
    rows = np.arange(len(target))
    grad_output = np.zeros_like(output)
    grad_output[rows, target] = -1 / len(target)
    return -output[rows, target].mean(), grad_output


# --------- Helper methods ---------


def call_method(method, rref, *args, **kwargs):
    """On the owner of ``rref``: ``method`` of the value it holds."""
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    """``method`` of the value ``rref`` holds, called on its owner; the result comes back here."""
    args = [method, rref, *args]
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter server ---------


class ParameterServer:
    def __init__(self):
        self.model = Net()
        self.lock = threading.Lock()  # trainers step concurrently
        self.steps = 0
        # What dist_autograd keeps per context id: the forward pass's input
        # and output until backward, and the gradients until the step.
        self.saved = {}
        self.dist_gradients = {}

    def forward(self, inp, cid=None):
        out = self.model.forward(inp)
        if cid is not None:  # a training pass: backward follows
            self.saved[cid] = (inp, out)
        return out

    def backward(self, cid, grad_output):
        """dist_autograd.backward(cid, [loss]), from the loss's gradient at the output."""
        inp, out = self.saved.pop(cid)
        self.dist_gradients[cid] = self.model.gradients(inp, out, grad_output)

    def get_dist_gradients(self, cid):
        return self.dist_gradients[cid]

    def step(self, cid, lr):
        """DistributedOptimizer(optim.SGD, params, lr=lr).step(cid)."""
        grads = self.dist_gradients.pop(cid)
        with self.lock:
            for name, param in self.model.parameters().items():
                param -= lr * grads[name]
            self.steps += 1


param_server = None
global_lock = threading.Lock()


def get_parameter_server():
    global param_server
    # One server for every trainer: the first call makes it.
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server


def run_parameter_server(rank, world_size):
    # The server only answers the trainers' calls: rpc.shutdown() waits for
    # every trainer to finish and shut down too.
    print("PS master initializing RPC")
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
    print("RPC initialized! Running parameter server...")
    rpc.shutdown()
    print("RPC shutdown on parameter server.")
    print(f"The parameter server took {param_server.steps} optimizer steps.")


# --------- Trainers ---------


class TrainerNet:
    """The trainer's view of the network: each pass runs on the parameter server."""

    def __init__(self):
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def forward(self, x, cid=None):
        return remote_method(ParameterServer.forward, self.param_server_rref, x, cid)

    def backward(self, cid, grad_output):
        remote_method(ParameterServer.backward, self.param_server_rref, cid, grad_output)

    def step(self, cid, lr):
        remote_method(ParameterServer.step, self.param_server_rref, cid, lr)


def run_training_loop(rank, train_loader, test_loader):
    # The usual forward, backward and optimizer step, each on the server.
    net = TrainerNet()
    for i, (data, target) in enumerate(train_loader):
        cid = (rank, i)  # what dist_autograd.context() names: this pass
        model_output = net.forward(data, cid)
        loss, grad_output = nll_loss(model_output, target)
        if i % 5 == 0:
            print(f"Rank {rank} training batch {i} loss {loss:.4f}")
        net.backward(cid, grad_output)
        # The server has the gradients of this pass.
        assert remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
        net.step(cid, LEARNING_RATE)

    print("Training complete!")
    print("Getting accuracy....")
    get_accuracy(test_loader, net)


def get_accuracy(test_loader, model):
    correct_sum = 0
    total = 0
    for data, target in test_loader:
        pred = model.forward(data).argmax(axis=1)
        correct_sum += int((pred == target).sum())
        total += len(target)
    print(f"Accuracy {correct_sum / total}")


def run_worker(rank, world_size, train_loader, test_loader):
    print(f"Worker rank {rank} initializing RPC")
    rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
    print(f"Worker {rank} done initializing RPC")
    run_training_loop(rank, train_loader, test_loader)
    rpc.shutdown()


# --------- Data and launcher ---------


def digits(seed, num_batches):
    """Batches of (images, labels): the ten classes' fixed 8x8 patterns, with noise."""
    prototypes = np.random.default_rng(0).choice([-1.0, 1.0], size=(NUM_CLASSES, IMAGE_SIZE))
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num_batches):
        target = rng.integers(NUM_CLASSES, size=BATCH_SIZE)
        images = prototypes[target] + rng.normal(scale=0.5, size=(BATCH_SIZE, IMAGE_SIZE))
        batches.append((images, target))
    return batches


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Parameter-server RPC based training")
    parser.add_argument("rank", type=int, help="this process's rank: 0 for the parameter server")
    parser.add_argument(
        "--world_size",
        type=int,
        default=3,
        help="the number of processes: the parameter server and the trainers",
    )
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    if args.rank == 0:
        run_parameter_server(0, args.world_size)
    else:
        train_loader = digits(seed=args.rank, num_batches=TRAIN_BATCHES)
        # seeded with no trainer's rank: images that no trainer trains on
        test_loader = digits(seed=args.world_size, num_batches=TEST_BATCHES)
        run_worker(args.rank, args.world_size, train_loader, test_loader)
