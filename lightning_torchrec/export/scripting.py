"""The ``torchscript`` format: ``torchrec.fx.symbolic_trace`` then ``torch.jit.script``.

TorchRec's own inference path. ``torch.jit.script`` compiles the traced ``forward`` from its
source, so the model's ``forward`` needs real type annotations: an unannotated parameter is
taken for a ``Tensor`` (a ``KeyedJaggedTensor`` then fails inside the package's id check), and
the string annotations of a module with ``from __future__ import annotations`` come back from
the trace as names TorchScript does not know (``Unknown type name '_torch_Tensor_'``). When
scripting fails on such a ``forward``, :func:`script` says so.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torchrec.fx
from torch import nn

from lightning_torchrec.export.managed import RawIdRemap
from lightning_torchrec.export.validate import IdRangeCheck


def annotation_problem(model: nn.Module) -> str | None:
    """What in ``model.forward``'s signature TorchScript cannot compile, if anything.

    Args:
        model: the exported model.

    Returns:
        A description naming the parameters without an annotation or with a string one, or
        None when every parameter has a real (not string) annotation.
    """
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: nothing to say
        return None
    missing = [p.name for p in parameters if p.annotation is inspect.Parameter.empty]
    strings = [p.name for p in parameters if isinstance(p.annotation, str)]
    problems = []
    if strings:
        problems.append(
            f"{strings} have string annotations (its module has `from __future__ import "
            "annotations`, or quotes them)"
        )
    if missing:
        problems.append(f"{missing} are not annotated (TorchScript takes them for Tensors)")
    return "; ".join(problems) or None


def script(model: nn.Module) -> Any:
    """Traces the quantized model with ``torchrec.fx`` and scripts it.

    Args:
        model: the quantized model (its table buffers stripped).

    Returns:
        The ``torch.jit.ScriptModule``.

    Raises:
        TypeError: when scripting fails and ``model.forward`` has parameters without an
            annotation or with a string one (saying what to write instead).
        RuntimeError: TorchScript's own error, for a failure of any other cause.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        # torch 2.14 deprecates it with a FutureWarning; the user asked for TorchScript.
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", FutureWarning)
        warnings.filterwarnings("ignore", "The TorchScript type system", UserWarning)
        warnings.filterwarnings("ignore", "TorchScript will treat type annotations", UserWarning)
        # The id check is scripted from its source (it formats the offending id), and so is
        # the remap of raw ids (its loop over tables).
        leaves = [IdRangeCheck.__name__, RawIdRemap.__name__]
        traced = torchrec.fx.symbolic_trace(model, leaf_modules=leaves)
        try:
            return torch.jit.script(traced)
        except RuntimeError as err:
            problem = annotation_problem(model)
            if problem is None:
                raise
            name = f"{type(model).__module__}.{type(model).__qualname__}.forward"
            raise TypeError(
                f"TorchScript export needs real (not string) type annotations on {name}: "
                f"{problem}. Annotate every parameter, e.g. `def forward(self, dense: "
                "torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor`, in a module without "
                "`from __future__ import annotations`; or export with format='pt2'. "
                f"TorchScript said: {str(err).strip()[:300]}"
            ) from err
