"""What a worker returns to the driver holds no device tensor.

The driver may have no GPU at all (a Slurm step with ``--gpus=0``, a KubeRay head): a CUDA tensor
in a Ray result fails there at deserialisation, far from the method that returned it. Every
public method of the worker classes is therefore wrapped (:func:`returns_host_values`) so that a
device tensor in its result raises in the worker, naming the method and where in the value it
lies.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

_MARK = "__returns_host_values__"


class DeviceTensorReturned(RuntimeError):
    """A worker method was about to send a device tensor to the driver."""


def device_tensors(value: Any, path: str = "") -> list[str]:
    """Where in ``value`` (dataclasses, mappings, sequences) a tensor lies outside host memory."""
    if torch.is_tensor(value):
        return [f"{path} ({value.device})"] if value.device.type != "cpu" else []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, dict):
        items = ((str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return []
    return [hit for key, item in items for hit in device_tensors(item, f"{path}.{key}" if path else key)]


def returns_host_values(cls: type) -> type:
    """Class decorator: each public method's result is searched for device tensors."""
    for name, method in list(vars(cls).items()):
        if name.startswith("_") or not callable(method):
            continue
        setattr(cls, name, _checked(method, f"{cls.__name__}.{name}"))
    return cls


def _checked(method, qualified: str):
    def check(result):
        found = device_tensors(result)
        if found:
            raise DeviceTensorReturned(f"{qualified} returned device tensors to the driver, which may have no GPU: "
                                       f"{', '.join(found[:5])}{' …' if len(found) > 5 else ''}; "
                                       "move them to host memory (.cpu()) in the worker")
        return result

    if inspect.isgeneratorfunction(method):  # a streaming method stays one (Ray looks), each value checked
        @functools.wraps(method)
        def stream(*args, **kwargs):
            for value in method(*args, **kwargs):
                yield check(value)

        setattr(stream, _MARK, True)
        return stream

    @functools.wraps(method)
    def call(*args, **kwargs):
        return check(method(*args, **kwargs))

    setattr(call, _MARK, True)
    return call


def is_checked(method) -> bool:
    return getattr(method, _MARK, False)
