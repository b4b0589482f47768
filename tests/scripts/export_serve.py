"""The serving side of the export tests: ``torch`` and ``torchrec`` only, no training code.

``python export_serve.py INPUTS.pt PREDICTIONS.pt ARTIFACT...`` loads each artifact
(``.pt2``: ``torch.export``; anything else: TorchScript), predicts click probabilities for the
batches in ``INPUTS.pt`` (plain tensors) and saves them, with the first line of what each
artifact raised for each of the bad requests in ``INPUTS.pt["bad"]`` (``{artifact: [line]}``
under ``"refused"``). Importing ``lightning_torchrec`` (or
the tests) is made impossible first, so the artifacts provably do not need them.
"""

from __future__ import annotations

import sys

sys.modules["lightning_torchrec"] = None  # type: ignore[assignment]  # any import now fails
sys.modules["tests"] = None  # type: ignore[assignment]

import torch  # noqa: E402
import torchrec  # noqa: E402, F401  (registers fbgemm's operators and the KJT pytree)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402


def load(path: str):
    """The served model: ``model(dense_features, sparse_features) -> logits``."""
    if path.endswith(".pt2"):
        return torch.export.load(path).module()
    return torch.jit.load(path)


def refusal(model, keys, b) -> str:
    """The last line of what the model raised for a request (``b``: plain tensors)."""
    kjt = KeyedJaggedTensor(keys=keys, values=b["values"], lengths=b["lengths"])
    try:
        with torch.inference_mode():
            model(b["dense"], kjt)
    except Exception as err:  # noqa: BLE001  (any refusal is recorded)
        return f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
    return "accepted"


def main() -> None:
    inputs = torch.load(sys.argv[1], weights_only=True)
    out, refused = {}, {}
    for path in sys.argv[3:]:
        model = load(path)
        probs = []
        with torch.inference_mode():
            for b in inputs["batches"]:
                kjt = KeyedJaggedTensor(
                    keys=inputs["keys"], values=b["values"], lengths=b["lengths"]
                )
                probs.append(torch.sigmoid(model(b["dense"], kjt)).reshape(-1))
        out[path] = torch.cat(probs)
        refused[path] = [refusal(model, inputs["keys"], b) for b in inputs.get("bad", [])]
    out["refused"] = refused
    torch.save(out, sys.argv[2])
    loaded = sorted(
        m
        for m, v in sys.modules.items()
        if v is not None and m.startswith(("lightning", "tests", "factory"))
    )
    print("modules:", loaded)


if __name__ == "__main__":
    main()
