"""Counting the torch functions a piece of code calls: the ops a forward issues, each a kernel launch on a GPU
(the meter for launches that grow with the documents of a row). Counts are of calls, exact and the
same on every machine."""

from torch.overrides import TorchFunctionMode


class TorchCalls(TorchFunctionMode):
    """with TorchCalls() as calls: ... ; calls.calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))
