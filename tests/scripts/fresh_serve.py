"""The serving side of the delta tests: ``torch``, ``torchrec`` and ``export/fresh.py`` only.

``python fresh_serve.py INPUTS.pt OUTPUTS.pt ARTIFACT...`` loads ``export/fresh.py`` by file
path (``INPUTS.pt["fresh"]``), serves each artifact with ``FreshModel`` and, for each, applies
the deltas of ``INPUTS.pt["deltas"][artifact]`` in order, then tries those of
``INPUTS.pt["bad"][artifact]`` (each expected to be refused). It saves, per artifact: the
logits of the batches before any delta and after each (``"outputs"``), each table's served
bytes at the end (``"tables"``), the id and sequence served, and what each bad delta raised
(``"refused"``: type name and message) with the logits after it. Importing
``lightning_torchrec`` (or the tests) is made impossible first.
"""

from __future__ import annotations

import importlib.util
import sys

sys.modules["lightning_torchrec"] = None  # type: ignore[assignment]  # any import now fails
sys.modules["tests"] = None  # type: ignore[assignment]

import torch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402


def load_fresh(path: str):
    spec = importlib.util.spec_from_file_location("fresh", path)
    module = importlib.util.module_from_spec(spec)  # not put in sys.modules: not needed
    spec.loader.exec_module(module)
    return module


def logits(model, inputs) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for b in inputs["batches"]:
            kjt = KeyedJaggedTensor(keys=inputs["keys"], values=b["values"], lengths=b["lengths"])
            out.append(model(b["dense"], kjt).reshape(-1))
    return torch.cat(out)


def main() -> None:
    inputs = torch.load(sys.argv[1], weights_only=True)
    fresh = load_fresh(inputs["fresh"])
    results = {}
    for path in sys.argv[3:]:
        model = fresh.FreshModel(path, key=inputs.get("key"))
        outputs = [logits(model, inputs)]
        for delta in inputs["deltas"].get(path, []):
            model.apply(delta)
            outputs.append(logits(model, inputs))
        refused = []
        for delta in inputs["bad"].get(path, []):
            try:
                model.apply(delta)
            except fresh.DeltaRefusedError as err:
                refused.append((type(err).__name__, str(err), logits(model, inputs)))
            else:
                refused.append(("applied", "", logits(model, inputs)))
        tables = {}
        for table, spec in model.tables.items():
            buffer = model.module
            for attr in spec["state"].split("."):
                buffer = getattr(buffer, attr)
            start = spec["offset"]
            tables[table] = buffer[start : start + spec["rows"] * spec["row_bytes"]].clone()
        results[path] = {
            "outputs": outputs,
            "tables": tables,
            "id": model.current_id,
            "sequence": model.sequence,
            "refused": refused,
        }
    torch.save(results, sys.argv[2])
    loaded = sorted(
        m
        for m, v in sys.modules.items()
        if v is not None and m.startswith(("lightning", "tests", "factory"))
    )
    print("modules:", loaded)


if __name__ == "__main__":
    main()
