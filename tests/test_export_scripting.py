"""TorchScript export of a ``forward`` without real type annotations: a named, actionable error.

No ``from __future__ import annotations`` here: the model with string annotations is written to
a file of its own (as a user's module would have them).
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from lightning_torchrec.checkpoint import save_sharded
from lightning_torchrec.export.artifact import export
from lightning_torchrec.export.scripting import annotation_problem

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # 1-process save

#: A user's module with the future import (the same tables and layers as ``Unannotated``).
FUTURE_MODULE = """
from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class StringAnnotated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10,
                                    feature_names=["f"])
        self.ebc = EmbeddingBagCollection([config], device=torch.device("cpu"))
        self.over = nn.Linear(8 + 3, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(torch.cat([dense, self.ebc(kjt).values()], 1))
"""


class Unannotated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = EmbeddingBagConfig(
            name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"]
        )
        self.ebc = EmbeddingBagCollection([config], device=torch.device("cpu"))
        self.over = nn.Linear(8 + 3, 1)

    def forward(self, dense, kjt):  # noqa: ANN001, ANN201 - what the test is about
        return self.over(torch.cat([dense, self.ebc(kjt).values()], 1))


def _string_annotated(folder: Path) -> nn.Module:
    source = folder / "user_model_future.py"
    source.write_text(FUTURE_MODULE)
    spec = importlib.util.spec_from_file_location("user_model_future", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StringAnnotated()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scripting")
    save_sharded(out / "ckpt", Unannotated(), [], {})  # the same state as StringAnnotated
    return out / "ckpt"


def test_string_annotations_name_the_future_import(checkpoint: Path, tmp_path: Path) -> None:
    """Was ``RuntimeError: Unknown type name '_torch_Tensor_'`` from inside TorchScript."""
    model = _string_annotated(tmp_path)
    message = (
        "TorchScript export needs real (not string) type annotations on "
        "user_model_future.StringAnnotated.forward: ['dense', 'kjt'] have string annotations "
        "(its module has `from __future__ import annotations`"
    )
    with pytest.raises(TypeError, match=re.escape(message)) as refused:
        export(checkpoint, model, tmp_path / "m.ts", dtype="fp32", format="torchscript")
    assert "format='pt2'" in str(refused.value)
    assert "Unknown type name" in str(refused.value)  # TorchScript's own words, shortened
    assert not (tmp_path / "m.ts").exists()


def test_unannotated_forward_is_named_not_the_id_check(checkpoint: Path, tmp_path: Path) -> None:
    """Was a TorchScript error pointing at the package's internal ``IdRangeCheck``."""
    message = (
        f"annotations on {__name__}.Unannotated.forward: ['dense', 'kjt'] are not annotated "
        "(TorchScript takes them for Tensors)"
    )
    with pytest.raises(TypeError, match=re.escape(message)) as refused:
        export(checkpoint, Unannotated(), tmp_path / "m.ts", dtype="fp32", format="torchscript")
    assert "def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor)" in str(refused.value)
    assert isinstance(refused.value.__cause__, RuntimeError)


def test_annotation_problem_is_none_for_real_annotations(tmp_path: Path) -> None:
    class Annotated(nn.Module):
        def forward(self, dense: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return dense * scale

    assert annotation_problem(Annotated()) is None
    assert "['dense', 'kjt'] have string annotations" in annotation_problem(
        _string_annotated(tmp_path)
    )
