"""Input guards of a ``.pt2``: the forms torch writes load and serve; crafted ones are refused.

A ``FeatureProcessedEmbeddingBagCollection`` (position weights) exports with guards such as
``max(1, L['kjt']._lengths.size()[0] // 4) < ...``; ``load_artifact`` refused them. The artifact
comes from a small model saved in this process (a few seconds).
"""

import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.feature_processor_ import PositionWeightedModule
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.checkpoint import save_sharded
from lightning_torchrec.errors import IdOutOfRangeError, UnsafeCheckpointError
from lightning_torchrec.export.archive import check_pt2, load_pt2
from lightning_torchrec.export.artifact import export, load_artifact
from lightning_torchrec.export.modules import takes_weights
from lightning_torchrec.sharding.planning import shard_model
from tests.helpers import one_rank_group  # noqa: F401 - a fixture

ROWS = (50, 60)
FEATURES = ["cat_0", "cat_1"]
DENSE = 5
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # 1-process save


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows,
                           feature_names=[FEATURES[i]])
        for i, rows in enumerate(ROWS)
    ]  # fmt: skip


def _ebc(weighted: bool, device: str = "cpu") -> EmbeddingBagCollection:
    return EmbeddingBagCollection(_tables(), is_weighted=weighted, device=torch.device(device))


def _position_weighted(device: str = "cpu") -> FeatureProcessedEmbeddingBagCollection:
    processors = {f: PositionWeightedModule(max_feature_length=3) for f in FEATURES}
    return FeatureProcessedEmbeddingBagCollection(_ebc(True, device), processors)


class PositionWeighted(nn.Module):
    """A position-weighted EBC (weights made inside, from each id's position in its bag)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = _position_weighted()
        self.over = nn.Linear(DENSE + 8 * len(FEATURES), 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(torch.cat([dense, self.ebc(kjt).values()], dim=1))


def _request(
    batch: int, seed: int, bad: int | None = None
) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(FEATURES) * batch,), generator=generator, dtype=torch.int32)
    per_feature = lengths.view(len(FEATURES), batch).sum(1).tolist()
    ids = [
        torch.randint(0, r, (n,), generator=generator)
        for r, n in zip(ROWS, per_feature, strict=True)
    ]
    values = torch.cat(ids)
    if bad is not None:
        values[-1] = bad
    kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)
    return torch.randn(batch, DENSE, generator=generator), kjt


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PositionWeighted]:
    out = tmp_path_factory.mktemp("guards")
    torch.manual_seed(0)
    model = PositionWeighted()
    for param in model.ebc.parameters():  # the tables and the position weights
        nn.init.normal_(param)
    save_sharded(out / "ckpt", model, [], {})
    path = out / "fp.pt2"
    export(out / "ckpt", PositionWeighted(), path, dtype="fp32", example_inputs=_request(4, 0))
    return path, model.eval()


def _with_guards(src: Path, dst: Path, guards: list[str]) -> Path:
    """Copies the archive with its program's ``guards_code`` replaced."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/models/model.json"):
                program = json.loads(data)
                program["guards_code"] = guards
                data = json.dumps(program).encode()
            zout.writestr(info, data)
    return dst


def _guards(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/models/model.json"))
        return json.loads(archive.read(name))["guards_code"]


def test_position_weighted_pt2_loads_and_serves_like_the_float_model(
    exported: tuple[Path, PositionWeighted],
) -> None:
    """load_artifact refused the guards torch writes for it (max(1, ...)); the side file said
    the served model takes weights."""
    path, model = exported
    served = load_artifact(path)
    for batch, seed in ((3, 1), (7, 2)):
        request = _request(batch, seed)
        with torch.inference_mode():
            want, got = model(*request), served(*request)
        assert got.shape == (batch, 1)
        assert float((got - want).abs().max()) <= 1e-5
    message = "feature 'cat_1' (table 't1', 60 rows) got"
    with pytest.raises(IdOutOfRangeError, match=re.escape(message)):
        served(*_request(3, 3, bad=ROWS[1]))
    side = json.loads(Path(f"{path}.json").read_text())
    assert side["weighted"] is False  # the feature processors make the weights


def test_only_weights_fed_from_the_input_make_an_artifact_weighted() -> None:
    plain, weighted, processed = _ebc(False, "meta"), _ebc(True, "meta"), _position_weighted("meta")
    root = nn.ModuleDict({"plain": plain, "weighted": weighted, "fp": processed})
    inner = next(p for p, m in root.named_modules() if p.startswith("fp.") and m is not processed
                 and isinstance(m, EmbeddingBagCollection))  # fmt: skip
    assert not takes_weights(root, {"plain": plain})
    assert takes_weights(root, {"weighted": weighted})
    assert not takes_weights(root, {inner: root.get_submodule(inner)})
    assert takes_weights(root, {inner: root.get_submodule(inner), "weighted": weighted})
    assert takes_weights(weighted, {"": weighted})  # the collection is the exported model


#: Forms torch writes (sympy's Max/Min printed as Python's max/min), over this model's inputs.
ALLOWED = [
    "max(1, L['kjt']._lengths.size()[0] // 2) < "
    "max(1, L['kjt']._lengths.size()[0] // 2)*max(1, L['kjt']._lengths.size()[0] // 2)",
    "min(L['dense'].size()[0], 64) >= 1",
    "max(1, 2, L['dense'].size()[0], min(L['kjt']._lengths.size()[0], 3)) > 0",
    "L['kjt']._lengths.size()[0] == (2*L['dense'].size()[0])",
]


@pytest.mark.parametrize("guard", ALLOWED)
def test_guards_of_the_grammar_pass_the_check(
    exported: tuple[Path, PositionWeighted], tmp_path: Path, guard: str
) -> None:
    path, _ = exported
    check_pt2(_with_guards(path, tmp_path / "ok.pt2", [*_guards(path), guard]))


def test_an_artifact_with_max_and_min_guards_serves(
    exported: tuple[Path, PositionWeighted], tmp_path: Path
) -> None:
    """The accepted forms load, and torch runs them (the names resolve where it execs them)."""
    path, model = exported
    ok = _with_guards(path, tmp_path / "ok.pt2", [*_guards(path), *ALLOWED])
    request = _request(3, 4)
    with torch.inference_mode():
        assert float((load_artifact(ok)(*request) - model(*request)).abs().max()) <= 1e-5
    # torch execs the guards only for a program with example inputs (the package writes none).
    failing = _with_guards(
        path, tmp_path / "fails.pt2", [*ALLOWED, "min(L['dense'].size()[0], 64) >= 5"]
    )
    for artifact, passes in ((ok, True), (failing, False)):
        program = load_pt2(artifact)
        program.example_inputs = (_request(4, 0), {})
        guarded = program.module()
        if passes:
            with torch.inference_mode():
                assert float((guarded(*request) - model(*request)).abs().max()) <= 1e-5
        else:
            with pytest.raises(
                AssertionError, match=re.escape("Guard failed: min(dense.size()[0], 64) >= 5")
            ):
                guarded(*request)


def _refused(marker: Path) -> list[str]:
    """Guards outside the grammar; those marked ``M`` create ``marker`` if run."""
    run = f"__import__('os').system('touch {marker}')"
    size = "L['dense'].size()[0]"
    return [
        f"max(1, {run}) >= 1",  # a call other than max/min inside
        f"{run} == 0",
        f"max(1, {size}, key=lambda v: {run}) > 0",  # keyword argument
        "max(1, *L['dense'].size()) > 0",  # starred
        f"max(1, sum(1 for _ in [{run}])) > 0",  # generator
        f"max(1, [{run} for _ in [0]][0]) > 0",  # comprehension
        f"max(1, (lambda: {run})()) > 0",  # lambda
        f"max({size}) > 0",  # one argument: max iterates it
        "max(1, L['dense'].__class__.__init__) != 0",  # dunder
        f"max(1, {size}).real > 0",  # an attribute of a result, not of an input
        f"{size}.real > 0",
        "max(1, args[0].size()[0]) > 0",  # the name torch execs the inputs under
        "max(1, max.__self__.exec('pass') or 1) > 0",
        "max > 0",  # the function itself
        f"math.floor({size}) > 0",  # another function
        f"(max := print) and max(1, {size}) > 0",  # rebinding
        f"max(1, {size}) if {run} else 1",
        f"{size} > 0 # comment hiding the rest of torch's line",
        "L['dense'].to('cpu').size()[0] > 0",  # a call that is not a size
        "L['dense'].size(*[0]) > 0",
        f"max(1, L['dense'][{run}]) > 0",
    ]


def test_crafted_guards_are_refused_before_anything_runs(
    exported: tuple[Path, PositionWeighted], tmp_path: Path
) -> None:
    """Calls other than max/min and size methods, keywords, starred arguments, lambdas,
    comprehensions, dunders, other names, attributes of results, comments: all refused."""
    path, _ = exported
    marker = tmp_path / "PAYLOAD_RAN"
    for i, guard in enumerate(_refused(marker)):
        bad = _with_guards(path, tmp_path / f"bad{i}.pt2", [guard])
        with pytest.raises(UnsafeCheckpointError, match="input guard it would exec") as refused:
            load_artifact(bad)
        assert repr(guard)[:40] in str(refused.value)
        assert not marker.exists()
    # What the check prevents: torch execs the guards on every call of ``.module()`` when the
    # program has example inputs (the package writes none; a crafted file can carry them).
    program = torch.export.load(tmp_path / "bad0.pt2")
    program.example_inputs = (_request(4, 5), {})
    program.module()(*_request(3, 5))
    assert marker.exists()


class TwoTowers(nn.Module):
    """Two collections that each name a table ``t`` (of different widths), a user and an item
    tower."""

    def __init__(self) -> None:
        super().__init__()
        self.user = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=ROWS[0],
                                feature_names=[FEATURES[0]])]
        )  # fmt: skip
        self.item = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=ROWS[1],
                                feature_names=[FEATURES[1]])]
        )  # fmt: skip
        self.over = nn.Linear(DENSE + 12, 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = [self.user(kjt).values(), self.item(kjt).values()]
        return self.over(torch.cat([dense, *pooled], dim=1))


def test_tables_of_one_name_in_two_collections_are_both_described(tmp_path: Path) -> None:
    """The side file's ``tables`` (and ``ExportResult.tables``) kept one of them, keyed ``t``."""
    torch.manual_seed(0)
    model = TwoTowers()
    save_sharded(tmp_path / "ckpt", model, [], {})
    request = _request(3, 1)
    result = export(tmp_path / "ckpt", TwoTowers(), tmp_path / "towers.pt2", dtype="fp32",
                    example_inputs=request)  # fmt: skip
    want = {"user/t": (ROWS[0], 8), "item/t": (ROWS[1], 4)}
    assert result.tables == want
    side = json.loads(Path(f"{result.path}.json").read_text())
    assert side["tables"] == {k: list(v) for k, v in want.items()}
    assert side["inputs"] == (  # what this model takes (it said DLRM's whatever the model)
        "forward(float32 [B, 5], KeyedJaggedTensor(keys=['cat_0', 'cat_1'], values=int64, "
        "lengths=int32)) -> float32 [B, 1]"
    )
    with torch.inference_mode():
        assert float((result.model(*request) - model(*request)).abs().max()) <= 1e-6


@pytest.mark.usefixtures("one_rank_group")
def test_a_module_a_fit_has_sharded_is_refused_naming_what_is_sharded(tmp_path: Path) -> None:
    """It said the module "holds no TorchRec EmbeddingBagCollection": its EBCs were shards."""
    save_sharded(tmp_path / "ckpt", TwoTowers(), [], {})
    holder = nn.Module()
    with pytest.warns(UserWarning, match="built whole on every rank"):  # not on meta: fine here
        holder.towers = shard_model(TwoTowers(), torch.device("cpu")).dmp
    with pytest.raises(TypeError, match=r"is sharded \(towers is a DistributedModelParallel\)"):
        export(tmp_path / "ckpt", holder, tmp_path / "x.pt2", dtype="fp32")
    assert not (tmp_path / "x.pt2").exists()
