"""Check: llama.cpp's own converter reads the feature layers ogspo writes into a head's config.json.

    PATH=.venv/bin:$PATH python benchmarks/check_llamacpp_head.py --model results/quick/model

Builds an ogspo head for the prepared model with non-default feature layers (random weights: only the
format is checked), writes it in EAGLE-3's format, converts it with llama.cpp's `convert_hf_to_gguf.py`
(the pinned source and the converter's venv of `llamacpp.py`, cached under ~/.cache/ogspo/peers; the
first run downloads them) and compares the GGUF's `target_layers` with the top-level
`eagle_aux_hidden_state_layer_ids`. Not part of `make test` (it downloads llama.cpp's source and builds a
venv). Prints one line; exit status 1 when they differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from llamacpp import VERSION, convert_to_gguf, peers_cache_dir  # noqa: E402

from ogspo.drafter.eagle3 import CONFIG, save_eagle3  # noqa: E402
from ogspo.drafter.head import EagleHead, HeadConfig  # noqa: E402
from ogspo.engine.model import load_target  # noqa: E402


def source_root() -> Path:
    root = peers_cache_dir() / f"llama.cpp-{VERSION}"
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{root} lacks llama.cpp's converter: run benchmarks/bench_peers.py once (it fetches the source)")
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("results/quick/model"), help="prepared model folder (the target)")
    args = ap.parse_args()
    model, _ = load_target(args.model)
    n = model.config.num_hidden_layers
    cfg = HeadConfig.for_target(model, draft_vocab=256)
    layers = (1, n // 3, n - 5)  # outputs of these layers: not the default ids (2, N/2, N-3) entering layers
    cfg = dataclasses.replace(cfg, feature_layers=layers)
    d2t = torch.arange(cfg.draft_vocab)
    head = EagleHead(cfg, embed=model.get_input_embeddings().weight, lm_rows=model.get_output_embeddings().weight[d2t], d2t=d2t)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "head"
        folder.mkdir()
        save_eagle3(head, folder, target_config=model.config)
        written = json.loads((folder / CONFIG).read_text())
        gguf = convert_to_gguf(folder, Path(tmp) / "head.gguf", outtype="f32", src_root=source_root(), target_dir=args.model)
        fields = GGUFReader(str(gguf)).fields
        key = next(k for k in fields if k.endswith(".target_layers"))
        got = [int(x) for x in fields[key].contents()]
    want = written["eagle_aux_hidden_state_layer_ids"]
    same = got == want
    print(f"llama.cpp {VERSION} converter: {key} = {got}, config.json eagle_aux_hidden_state_layer_ids = {want} "
          f"(eagle_config's SGLang copy {written['eagle_config']['eagle_aux_hidden_state_layer_ids']}): "
          f"{'equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
